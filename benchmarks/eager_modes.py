"""Eager modes side by side: Strict vs Fused vs compiled ("tpu") vs PyTorch CPU eager.

    python benchmarks/eager_modes.py [--steps N] [--only gpt|mlp]

Runs the MLP and small-GPT training steps of benchmarks/compile_step.py (same models, data and
AdamW) in one process and prints the median ms per step, the first-step time, how many XLA
programs Fused mode compiled after its third step (the target is none), and the per-op recording
cost of Fused mode on a chain of 1000 small elementwise ops.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_step as cs  # noqa: E402  (the shared benchmark models)
from common import Table, environment  # noqa: E402

MODES = {
    "strict": torch.tpu.EagerMode.DEFER_NEVER,
    "fused": torch.tpu.EagerMode.DEFER_AND_FUSE,
}


def build(which, device):
    torch.manual_seed(0)
    if which == "gpt":
        model, data, loss_fn = cs.TinyGPT(**cs.GPT), cs.gpt_data(device), cs.gpt_loss
    else:
        model, data, loss_fn = cs.make_mlp(**cs.MLP), cs.mlp_data(device), cs.mlp_loss
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cs.LR, foreach=True)
    return model, opt, data, cs.make_step(loss_fn)


def _compiles():
    c = torch.tpu.metrics()["counters"]
    return c.get("fused_graph_compiles", 0) + c.get("eager_compiles", 0) + c.get("xla_compiles", 0)


def bench(which, mode, steps):
    device = "cpu" if mode == "cpu" else "tpu"
    model, opt, data, step = build(which, device)
    if mode == "compiled":
        step = torch.compile(step, backend="tpu")
    ctx = torch.tpu.set_eager_mode(MODES.get(mode, torch.tpu.EagerMode.DEFER_NEVER))
    with ctx:
        t0 = time.perf_counter()
        loss = float(step(model, opt, *data))
        first = time.perf_counter() - t0
        for _ in range(2):
            float(step(model, opt, *data))
        compiles_before = _compiles()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = float(step(model, opt, *data))  # a step is done when its loss is on the host
            times.append(time.perf_counter() - t)
        late = _compiles() - compiles_before
    return {"ms": 1000 * statistics.median(times), "first_s": first, "loss": loss,
            "compiles_after_3": late if device == "tpu" else None}


def recording_cost(n=1000, repeats=7):
    """Median us per recorded op in Fused mode (recording only; the flush is timed apart)."""
    a = torch.ones(16, 16, device="tpu")
    per_op, flush = [], []
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        for _ in range(repeats + 1):
            torch.tpu.synchronize()
            x = a
            t0 = time.perf_counter()
            for _ in range(n // 2):
                x = x * 1.0001 + 0.5
            t1 = time.perf_counter()
            torch.tpu.synchronize()
            t2 = time.perf_counter()
            per_op.append((t1 - t0) / n * 1e6)
            flush.append((t2 - t1) * 1e3)
    return statistics.median(per_op[1:]), statistics.median(flush[1:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", choices=["gpt", "mlp"])
    p.add_argument("--modes", default="cpu,strict,fused,compiled")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    print(environment())
    table = Table("Training step, ms (median of %d steps)" % args.steps, modes, unit="ms")
    firsts = Table("First step (trace + compile + run), s", modes, unit="s")
    notes = []
    for which in ([args.only] if args.only else ["mlp", "gpt"]):
        row, frow = {}, {}
        for mode in modes:
            r = bench(which, mode, args.steps)
            row[mode], frow[mode] = r["ms"], r["first_s"]
            if r["compiles_after_3"] is not None:
                notes.append(f"{which}/{mode}: {r['compiles_after_3']} compiles after step 3, "
                             f"final loss {r['loss']:.4f}")
        table.add(which, row)
        firsts.add(which, frow)
    ratios = [(a, b) for a, b in [("strict", "fused"), ("fused", "compiled"), ("cpu", "fused")]
              if a in modes and b in modes]
    table.notes = notes
    table.print(ratios)
    print()
    firsts.print()
    if "fused" in modes:
        us, ms = recording_cost()
        print(f"\nFused recording cost: {us:.2f} us/op (median, chain of 1000 elementwise ops; "
              f"flush {ms:.1f} ms)")


if __name__ == "__main__":
    main()
