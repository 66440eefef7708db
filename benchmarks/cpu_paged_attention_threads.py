"""torchtpu's CPU paged-attention kernel (runtime/cpu_paged_attention.cc, the path vLLM / SGLang
on "tpu" take on XLA:CPU every layer) on the calling thread alone vs over XLA's intra-op
thread pool, side by side, interleaved, on benchmarks/paged_attention_portable.py's cases
(the tiny Llama of vllm_serving.py: 4 query heads, 2 KV heads, head dim 64, pages of 16,
float32; decode of 32 sequences of 100..260 positions, a 512-token prefill, a mixed step).

    python benchmarks/cpu_paged_attention_threads.py [--rounds 7]

Per call: wall (median over rounds, each many calls ending with the output ready) and the CPU
of every thread of the process (XLA's pool included). ``1 thread`` is
``TORCHTPU_CPU_ATTENTION_THREADS=1`` set in the running process (``set_attention_threads``);
the outputs of both are checked equal bit for bit. The load average is printed: compare runs
taken on a quiet host.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_attention_portable import cases  # noqa: E402

from torchtpu.lowering import paged_attention as pa  # noqa: E402
from torchtpu.runtime import cpu_kernels  # noqa: E402


def timed(fn, args, n):
    w, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - w) / n * 1e3, (time.process_time() - c) / n * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if not cpu_kernels.available("paged_attention"):
        sys.exit("the CPU paged-attention kernel is not available here")
    fn = jax.jit(lambda *x: pa.ragged_paged_attention(*x, sm_scale=0.125, impl="cpu"))
    print(f"load before: {os.getloadavg()}", flush=True)
    rows = {}
    for name, targs in cases(np.random.default_rng(0), 2048).items():
        args = [jax.numpy.asarray(t.cpu().numpy()) for t in targs]
        outs = {}
        for threads in (1, 0):
            cpu_kernels.set_attention_threads(threads)
            outs[threads] = np.asarray(fn(*args))
        assert outs[1].tobytes() == outs[0].tobytes(), name
        t0 = time.perf_counter()
        timed(fn, args, 3)
        n = max(5, int(0.05 / max(time.perf_counter() - t0, 1e-6) * 3))
        res = {1: [], 0: []}
        for _ in range(a.rounds):
            for threads in (1, 0):
                cpu_kernels.set_attention_threads(threads)
                res[threads].append(timed(fn, args, n))
        cpu_kernels.set_attention_threads(0)
        rows[name] = {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
                      for k, v in res.items()}
    print(f"\n## CPU paged-attention kernel, one layer; {os.cpu_count()} cores; load "
          f"{os.getloadavg()}\n")
    print("| case | 1 thread: wall / CPU ms | XLA's pool: wall / CPU ms | wall speed-up |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        (w1, c1), (w0, c0) = r[1], r[0]
        print(f"| {name} | {w1:.3f} / {c1:.3f} | {w0:.3f} / {c0:.3f} | {w1 / w0:.2f}x |")


if __name__ == "__main__":
    main()
