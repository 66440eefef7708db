"""Matmul throughput: XLA:CPU (what every "tpu" program on the CPU platform uses) vs PyTorch CPU,
on the matmul shapes of the compile benchmark's GPT step, and the step-time floor it implies.

    python benchmarks/matmul_floor.py

For each (m, k) x (k, n) product of the GPT's forward and backward (tokens = batch * seq = 1024)
it times ``a @ b`` in PyTorch CPU eager and in a cached ``jax.jit`` on the same machine, side by
side, and prints GFLOP/s. Then it counts the GPT step's matmul FLOPs (forward + the two
backward products of every forward matmul) and prints how long they take at each rate: the
time no lowering can go below on this backend, and the gap to Inductor (which uses PyTorch's
CPU matmuls) that the matmuls alone explain.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, Timer, environment  # noqa: E402
from compile_step import GPT  # noqa: E402


def gpt_matmuls(layers, d, heads, seq, vocab, batch):
    """(batch, m, k, n, count) of every forward matmul of one GPT step."""
    t = batch * seq
    hd = d // heads
    bh = batch * heads
    return [
        (1, t, d, 3 * d, layers),  # qkv
        (1, t, d, d, layers),  # attention output projection
        (1, t, d, 4 * d, layers),  # fc1
        (1, t, 4 * d, d, layers),  # fc2
        (bh, seq, hd, seq, layers),  # q @ k^T, batched over batch and heads
        (bh, seq, seq, hd, layers),  # att @ v
        (1, t, d, vocab, 1),  # LM head
    ]


def step_gflop(shapes) -> float:
    # forward b*m*k*n, backward two products of the same size: 3 * 2*b*m*k*n flops each
    return sum(3 * 2 * b * m * k * n * c for b, m, k, n, c in shapes) / 1e9


def main():
    import jax
    import jax.numpy as jnp

    timer = Timer(warmup=3, repeats=9, min_repeat_s=0.1)
    shapes = gpt_matmuls(**GPT)
    table = Table("Matmul throughput on the GPT's shapes (GFLOP/s)", ["PyTorch CPU", "XLA:CPU"],
                  unit="GFLOP/s")
    rng = np.random.default_rng(0)
    mm = jax.jit(lambda a, b: a @ b)
    tot = {"PyTorch CPU": 0.0, "XLA:CPU": 0.0}
    for bt, m, k, n, count in shapes:
        lead = (bt,) if bt > 1 else ()  # a batched product only where the model has one
        a = rng.standard_normal(lead + (m, k)).astype(np.float32)
        b = rng.standard_normal(lead + (k, n)).astype(np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        flop = 2 * bt * m * k * n
        last = [None]

        def run_jax():
            last[0] = mm(ja, jb)
            return last[0]

        s_t = timer.measure(lambda: ta @ tb).median_s
        s_j = timer.measure(run_jax, sync=lambda: last[0].block_until_ready()).median_s
        table.add((f"{bt} x " if bt > 1 else "") + f"({m}x{k}) @ ({k}x{n})", {"PyTorch CPU": flop / s_t / 1e9,
                                              "XLA:CPU": flop / s_j / 1e9})
        # the backward's two products per matmul are timed at the forward shape's rate
        tot["PyTorch CPU"] += 3 * count * s_t
        tot["XLA:CPU"] += 3 * count * s_j
    table.notes.append(environment())
    table.notes.append(timer.noise_note())
    table.print(ratios=[("PyTorch CPU", "XLA:CPU")])
    gf = step_gflop(shapes)
    print(f"\nGPT step ({GPT}): {gf:.1f} GFLOP of matmuls (forward + backward)")
    print(f"time in matmuls at these rates: PyTorch CPU {1000 * tot['PyTorch CPU']:.0f} ms, "
          f"XLA:CPU {1000 * tot['XLA:CPU']:.0f} ms per step "
          f"(difference {1000 * (tot['XLA:CPU'] - tot['PyTorch CPU']):.0f} ms)")


if __name__ == "__main__":
    main()
