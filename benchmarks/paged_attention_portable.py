"""The portable paged attention lowering (``torch.tpu.ops.ragged_paged_attention``, impl
"xla": the path XLA:CPU runs and vLLM / SGLang on "tpu" call every layer) on the shapes of
benchmarks/vllm_serving.py's tiny Llama (4 query heads, 2 KV heads, head dim 64, pages of 16,
float32), with a small and a large KV pool side by side: attention reads only the batch's
pages, so the two columns should be equal (a pool-sized copy would show as a ratio >> 1).

    python benchmarks/paged_attention_portable.py [--pages 2048,16384]

Cases: a decode step of 32 sequences of 100..260 positions (one token each), a prefill of
three prompts (512 tokens), and a mixed step (20 decode tokens and a 100-token chunk). Per call
the wall time (median of repeats, each ending with ``torch.tpu.synchronize()``) and the
process CPU time (all threads: less sensitive to the host's load than the wall). The load
average is printed: compare runs taken on a quiet host.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

import torchtpu  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer  # noqa: E402

HQ, HKV, D, PAGE, PPS, SEQS = 4, 2, 64, 16, 64, 32


def case(rng, pages, q_lens, kv_lens):
    T = int(sum(q_lens))
    kv = rng.standard_normal((pages, PAGE, 2 * HKV, D), dtype=np.float32)
    q = rng.standard_normal((T, HQ, D), dtype=np.float32)
    kvl = np.zeros(SEQS, np.int32)
    kvl[:len(kv_lens)] = kv_lens
    pi = np.zeros((SEQS, PPS), np.int32)
    pi[:len(kv_lens)] = rng.permutation(pages)[:len(kv_lens) * PPS].reshape(-1, PPS)
    cu = np.full(SEQS + 1, T, np.int32)
    cu[0] = 0
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    n = np.array([len(q_lens)], np.int32)
    return [torch.from_numpy(a).to("tpu") for a in (q, kv, kvl, pi, cu, n)]


def cases(rng, pages):
    lens = rng.integers(100, 260, 32)
    return {
        "decode, 32 sequences": case(rng, pages, [1] * 32, lens),
        "prefill, 512 tokens": case(rng, pages, [200, 150, 162], [200, 150, 162]),
        "mixed, 20 decode + 100": case(rng, pages, [1] * 20 + [100], list(lens[:20]) + [300]),
    }


def cpu_ms(fn, n=20):
    out = []
    for _ in range(5):
        c = time.process_time()
        for _ in range(n):
            fn()
        torch.tpu.synchronize()
        out.append((time.process_time() - c) / n * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", default="2048,16384", help="two KV pool sizes, in pages")
    a = ap.parse_args()
    sizes = [int(x) for x in a.pages.split(",")]
    if len(sizes) != 2:
        ap.error("--pages takes two pool sizes, e.g. --pages 2048,16384")
    timer = Timer(repeats=7, min_repeat_s=0.05)
    rows = {}
    for pages in sizes:
        for name, args in cases(np.random.default_rng(0), pages).items():
            def call(args=args):
                return torch.tpu.ops.ragged_paged_attention(*args, sm_scale=0.125, impl="xla")

            call()
            torch.tpu.synchronize()
            wall = timer.per_call_us(call, sync=torch.tpu.synchronize) / 1e3
            rows.setdefault(name, []).append((wall, cpu_ms(call)))
    mib = [p * PAGE * 2 * HKV * D * 4 >> 20 for p in sizes]
    print(f"\n## portable paged attention, one layer, XLA:CPU; load {os.getloadavg()}\n")
    print(f"| case | {mib[0]} MiB pool: wall / CPU ms | {mib[1]} MiB pool: wall / CPU ms "
          "| CPU ratio large/small |")
    print("|---|---|---|---|")
    for name, ((w0, c0), (w1, c1)) in rows.items():
        print(f"| {name} | {w0:.2f} / {c0:.2f} | {w1:.2f} / {c1:.2f} | {c1 / c0:.2f}x |")


if __name__ == "__main__":
    main()
