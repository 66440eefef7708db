"""torchtpu's CPU paged-attention kernel (runtime/cpu_paged_attention.cc, the path vLLM / SGLang
on "tpu" take on XLA:CPU every layer) on the calling thread alone vs over XLA's intra-op
thread pool, side by side, interleaved, on benchmarks/paged_attention_portable.py's cases
(the tiny Llama of vllm_serving.py: 4 query heads, 2 KV heads, head dim 64, pages of 16,
float32; decode of 32 sequences of 100..260 positions, a 512-token prefill, a mixed step).

    python benchmarks/cpu_paged_attention_threads.py [--rounds 7] [--baseline OLD.cc]

Per call: wall (median over rounds, each many calls ending with the output ready) and the CPU
of every thread of the process (XLA's pool included). ``1 thread`` is
``TORCHTPU_CPU_ATTENTION_THREADS=1`` set in the running process (``set_attention_threads``);
the outputs of both are checked equal bit for bit. The load average is printed: compare runs
taken on a quiet host.

``--baseline OLD.cc``: another version of the kernel's source (e.g. ``git show
REV:torchtpu/runtime/cpu_paged_attention.cc > old.cc``), built and registered here under its own
target name and timed interleaved with this one (same inputs, same thread caps); its outputs are
checked close to this kernel's (2e-6, the kernel tests' tolerance).
"""
from __future__ import annotations

import argparse
import ctypes
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
from torchtpu.runtime import native_build  # noqa: E402

BASELINE = "torchtpu_cpu_paged_attention_baseline"


def load_baseline(source):
    """Build and register another version of the kernel; returns its thread-cap setter."""
    path = native_build.library_path(source, ffi=True)
    native_build.build_locked(path, source, "the baseline kernel", "", ffi=True)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(BASELINE, jax.ffi.pycapsule(lib.TorchtpuCpuPagedAttention),
                                platform="cpu")
    lib.torchtpu_cpu_attention_threads.argtypes = [ctypes.c_int64]
    lib.torchtpu_cpu_attention_threads.restype = ctypes.c_int64
    return lib.torchtpu_cpu_attention_threads


def baseline_call(q, kv, lens, pages, cu, ns):
    """The lowering's custom call (ragged_paged_attention_cpu), to the baseline's target."""
    i32 = lambda x: x.astype(jax.numpy.int32)  # noqa: E731
    call = jax.ffi.ffi_call(BASELINE, jax.ShapeDtypeStruct(q.shape, jax.numpy.float32))
    return call(q, kv, i32(lens), i32(pages), i32(cu), i32(ns.reshape(1)),
                sm_scale=np.float32(0.125), sliding_window=np.int32(0),
                soft_cap=np.float32(0.0))


def timed(fn, args, n):
    w, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - w) / n * 1e3, (time.process_time() - c) / n * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--baseline", help="another version of cpu_paged_attention.cc to compare")
    a = ap.parse_args()
    if not cpu_kernels.available("paged_attention"):
        sys.exit("the CPU paged-attention kernel is not available here")
    fns = {"new": (jax.jit(lambda *x: pa.ragged_paged_attention(*x, sm_scale=0.125,
                                                                 impl="cpu")),
                   cpu_kernels.set_attention_threads)}
    if a.baseline:
        fns["old"] = (jax.jit(baseline_call), load_baseline(a.baseline))
    print(f"load before: {os.getloadavg()}", flush=True)
    rows = {}
    for name, targs in cases(np.random.default_rng(0), 2048).items():
        args = [jax.numpy.asarray(t.cpu().numpy()) for t in targs]
        outs = {}
        for k, (fn, cap) in fns.items():
            for threads in (1, 0):
                cap(threads)
                outs[k, threads] = np.asarray(fn(*args))
            assert outs[k, 1].tobytes() == outs[k, 0].tobytes(), (name, k)
        if a.baseline:
            np.testing.assert_allclose(outs["new", 1], outs["old", 1], atol=2e-6, rtol=2e-6)
        t0 = time.perf_counter()
        timed(fns["new"][0], args, 3)
        n = max(5, int(0.05 / max(time.perf_counter() - t0, 1e-6) * 3))
        res = {key: [] for key in outs}
        for _ in range(a.rounds):
            for k, threads in outs:
                fn, cap = fns[k]
                cap(threads)
                res[k, threads].append(timed(fn, args, n))
        for _, cap in fns.values():
            cap(0)
        rows[name] = {key: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
                      for key, v in res.items()}
    print(f"\n## CPU paged-attention kernel, one layer; {os.cpu_count()} cores; load "
          f"{os.getloadavg()}\n")
    print("| case | 1 thread: wall / CPU ms | XLA's pool: wall / CPU ms | wall speed-up |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        (w1, c1), (w0, c0) = r["new", 1], r["new", 0]
        print(f"| {name} | {w1:.3f} / {c1:.3f} | {w0:.3f} / {c0:.3f} | {w1 / w0:.2f}x |")
    if a.baseline:
        print(f"\n## this kernel (new) vs {a.baseline} (old), interleaved\n")
        print("| case | old, 1 thread: wall / CPU ms | new, 1 thread | CPU speed-up | "
              "old, pool: wall / CPU ms | new, pool | wall speed-up |")
        print("|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            (ow1, oc1), (nw1, nc1) = r["old", 1], r["new", 1]
            (ow0, oc0), (nw0, nc0) = r["old", 0], r["new", 0]
            print(f"| {name} | {ow1:.3f} / {oc1:.3f} | {nw1:.3f} / {nc1:.3f} | {oc1 / nc1:.2f}x "
                  f"| {ow0:.3f} / {oc0:.3f} | {nw0:.3f} / {nc0:.3f} | {ow0 / nw0:.2f}x |")


if __name__ == "__main__":
    main()
