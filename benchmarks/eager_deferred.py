"""A serving loop's bookkeeping step at a new batch composition: compiled in the call vs served
on the host while its programs build (torchtpu/eager/deferred.py).

    python benchmarks/eager_deferred.py [--steps 8] [--workers]

Each step is what SGLang's scheduler does between forwards, on "tpu" tensors whose shapes
follow the composition: merge two batches (``cat`` of lengths, temperatures, request slots),
``lens + 1``, the sampler's ``argmax`` over the batch's logits, the overlap scheduler's future
map write (``index_put_``) and read (``index``), the allocator's free list (``cat`` of the
finished requests' KV slots to it), a row of the request-to-token table (``clone``). Every step
uses a composition (n1, n2) no earlier step used, so each op meets a new shape. Steps alternate
between deferral off and on (distinct compositions each), each ending with
``torch.tpu.synchronize()``; deferral as the SGLang platform runs it (``hold``: the programs
are built between steps, untimed, as a server does while idle). Medians are printed with the
load average. Results are checked equal to CPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

# a fresh compile cache: the programs of these shapes are not on disk from an earlier run
os.environ.setdefault("TORCHTPU_CACHE_DIR", tempfile.mkdtemp(prefix="bench-deferred-"))

import torch  # noqa: E402

import torchtpu  # noqa: F401,E402
from torchtpu.eager import deferred  # noqa: E402


def _inputs(n1, n2, seed):
    g = torch.Generator().manual_seed(seed)
    n = n1 + n2
    return dict(
        lens1=torch.randint(1, 90, (n1,), generator=g), lens2=torch.randint(1, 90, (n2,),
                                                                            generator=g),
        temp1=torch.rand(n1, generator=g), temp2=torch.rand(n2, generator=g),
        logits=torch.randn(n, 151, generator=g),
        free=torch.randperm(30000, generator=g)[:20000 + 7 * n],
        freed=torch.randint(1, 30000, (3 * n + 11,), generator=g),
        table=torch.randint(0, 30000, (257, 1024), generator=g, dtype=torch.int32),
        fmap=torch.zeros(1025, dtype=torch.int64), slots=torch.randperm(1025, generator=g)[:n])


def _step(x, n):
    lens = torch.cat([x["lens1"], x["lens2"]])
    temps = torch.cat([x["temp1"], x["temp2"]])
    nxt = torch.argmax(x["logits"], -1)
    x["fmap"][x["slots"]] = nxt
    got = x["fmap"][x["slots"]]
    free = torch.cat([x["free"], x["freed"]])
    row = x["table"][n % 257, 5:5 + 3 * n].clone()
    return [lens + 1, temps, nxt, got, free, row]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8, help="steps per mode")
    ap.add_argument("--workers", action="store_true",
                    help="build on prefetch workers beside the steps (not held until idle)")
    a = ap.parse_args()
    dev = torch.device("tpu")
    warm = _inputs(2, 3, 0)
    _step({k: v.to(dev) for k, v in warm.items()}, 5)  # the ops' first programs (any shape)
    torch.tpu.synchronize()
    times = {"compiled in the call": [], "served on the host": []}
    n1 = 3
    for i in range(2 * a.steps):
        on = i % 2 == 1
        n1 += 1
        n2 = 7 + i
        x = _inputs(n1, n2, i)
        want = _step({k: v.clone() for k, v in x.items()}, n1 + n2)
        xd = {k: v.to(dev) for k, v in x.items()}  # the step's inputs exist already (untimed)
        torch.tpu.synchronize()
        deferred.enable(on, hold=not a.workers)
        try:
            t0 = time.perf_counter()
            got = _step(xd, n1 + n2)
            torch.tpu.synchronize()
            dt = time.perf_counter() - t0
        finally:
            deferred.enable(False)
        while deferred.held():  # what a server does while idle (untimed)
            deferred.build_held(1)
        for w, o in zip(want, got):
            assert torch.equal(o.cpu(), w), "result differs from CPU"
        times["served on the host" if on else "compiled in the call"].append(dt)
    load = os.getloadavg()[0]
    off = statistics.median(times["compiled in the call"])
    on = statistics.median(times["served on the host"])
    print(f"\n## Bookkeeping step at a new batch composition (median of {a.steps}), load {load:.1f}\n")
    print("| eager calls at new shapes | step ms |\n|---|---|")
    print(f"| compiled in the call | {1000 * off:.1f} |")
    how = "built on workers meanwhile" if a.workers else "built while idle"
    print(f"| served on the host ({how}) | {1000 * on:.1f} |")
    print(f"\nratio: {off / on:.1f}x")


if __name__ == "__main__":
    main()
