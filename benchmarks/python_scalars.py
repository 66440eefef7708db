#!/usr/bin/env python
"""Python scalars that change every step: compiles and step time, Strict vs Fused vs CPU.

Cases (one process, side by side):
  loop   the issue's 20-step loop: ``w = w - lr / bc * (x @ w) * 1e-3`` with a learning rate
         and a bias correction that change every step (64x64)
  gpt    the example GPT (2 layers, embd 96) trained with a hand-written functional AdamW whose
         bias corrections and scheduled learning rate are Python floats (the peer benchmark's
         style: ``p - lr / bc1 * m / ((v / bc2).sqrt() + eps)``), 12 steps, batch 8 x 64

Printed per case and contender: median step time after the first step (ms; every timed step
ends with torch.tpu.synchronize()) and the XLA programs compiled after step 1 (0 is the
target: a changing Python float must not recompile).

    python benchmarks/python_scalars.py [--steps N]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402

from common import environment  # noqa: E402

MODES = {"strict": torch.tpu.EagerMode.DEFER_NEVER, "fused": torch.tpu.EagerMode.DEFER_AND_FUSE}


def _compiles() -> int:
    c = torch.tpu.metrics()["counters"]
    return c.get("eager_compiles", 0) + c.get("fused_graph_compiles", 0)


def _sync(device):
    if device == "tpu":
        torch.tpu.synchronize()


def _loop(device, steps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g).to(device)
    w = torch.randn(64, 64, generator=g).to(device)
    state = {"w": w}

    def step(s):
        lr = 0.1 * (1 - s / 40)
        bc = 1 - 0.9 ** s
        state["w"] = state["w"] - lr / bc * (x @ state["w"]) * 1e-3
        state["w"].sum().item()

    return step


def _gpt(device, steps):
    import train_gpt

    torch.manual_seed(0)
    model = train_gpt.GPT(vocab_size=64, seq_len=64, n_layer=2, n_head=4, n_embd=96, dropout=0.0,
                          tie_weights=True).to(device)
    params = [p for p in model.parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (8, 65), generator=g) for _ in range(4)]
    b1, b2, eps, wd = 0.9, 0.95, 1e-8, 0.1

    def step(s):
        xb = batches[s % len(batches)].to(device)
        logits = model(xb[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), xb[:, 1:].reshape(-1))
        grads = torch.autograd.grad(loss, params)
        lr = 3e-3 * min(1.0, s / 4)  # warm-up, a new value each step
        bc1, bc2 = 1 - b1 ** s, 1 - b2 ** s
        with torch.no_grad():
            for i, (p, gr) in enumerate(zip(params, grads)):
                m[i] = b1 * m[i] + (1 - b1) * gr
                v[i] = b2 * v[i] + (1 - b2) * gr * gr
                p.copy_(p * (1 - lr * wd) - lr / bc1 * m[i] / ((v[i] / bc2).sqrt() + eps))
        return loss.item()

    return step


def run(case, device, mode, steps):
    make = {"loop": _loop, "gpt": _gpt}[case]
    ctx = torch.tpu.set_eager_mode(MODES[mode]) if device == "tpu" else None
    if ctx is not None:
        ctx.__enter__()
    try:
        step = make(device, steps)
        times = []
        after_first = None
        for s in range(1, steps + 1):
            _sync(device)
            t0 = time.perf_counter()
            step(s)
            _sync(device)
            times.append(time.perf_counter() - t0)
            if s == 1 and device == "tpu":
                after_first = _compiles()
        compiled_after = _compiles() - after_first if device == "tpu" else None
        return statistics.median(times[1:]) * 1e3, compiled_after
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="steps per case (default: 20 loop, 12 gpt)")
    args = p.parse_args(argv)
    print(environment())
    print(f"{'case':6s} {'contender':10s} {'ms/step':>9s} {'compiles after step 1':>22s}")
    for case, default in (("loop", 20), ("gpt", 12)):
        steps = args.steps or default
        cpu_ms, _ = run(case, "cpu", None, steps)
        print(f"{case:6s} {'cpu':10s} {cpu_ms:9.2f} {'-':>22s}")
        for mode in MODES:
            ms, n = run(case, "tpu", mode, steps)
            print(f"{case:6s} {'tpu ' + mode:10s} {ms:9.2f} {n:>22d}   ({ms / cpu_ms:.2f}x cpu)")


if __name__ == "__main__":
    main()
