"""What recording one op in Fused mode costs, next to a Strict fast-path hit (issue #33:
"recording an op should cost no more than a Strict hit").

    python benchmarks/fused_record.py [--batches 30] [--ops 100]

One process, cases interleaved batch by batch: ``a + b`` (16x16 f32) as a Strict fast-path hit
(each batch ends with ``torch.tpu.synchronize()``), recorded in Fused mode by the C++ path
(eager/fastpath.cpp "Fused recording"), and recorded by ``fused.record`` alone
(``fastpath.set_enabled(False)``). A recording batch is timed up to its last op; its values
are dead, so the synchronize that ends it runs nothing. Medians of the main thread's CPU time
per op (on a loaded host the wall clock mostly measures the wait for a core).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import torchtpu  # noqa: F401
from torchtpu.eager import fastpath

from common import environment


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--ops", type=int, default=100)
    args = ap.parse_args()
    a = torch.randn(16, 16, device="tpu")
    b = torch.randn(16, 16, device="tpu")

    def batch(n):
        t = time.thread_time()
        for _ in range(n):
            c = a + b
        dt = time.thread_time() - t
        del c
        torch.tpu.synchronize()
        return dt / n * 1e6

    cases = [("strict hit (C++)", "strict", True), ("fused record (C++)", "fused", True),
             ("fused record (Python)", "fused", False)]
    times = {name: [] for name, _, _ in cases}
    old = fastpath.set_enabled(True)
    try:
        for i in range(args.batches + 3):
            for name, mode, cpp in cases:
                fastpath.set_enabled(cpp)
                with torch.tpu.set_eager_mode(mode):
                    t = batch(args.ops)
                if i >= 3:  # warm-up batches install the entries and compile
                    times[name].append(t)
    finally:
        fastpath.set_enabled(old)
    print(environment())
    strict = statistics.median(times[cases[0][0]])
    for name, _, _ in cases:
        m = statistics.median(times[name])
        print(f"{name:24s} {m:7.2f} us/op  ({m / strict:.2f}x the Strict hit)")
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
