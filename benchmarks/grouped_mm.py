"""Grouped matmul (mixture-of-experts experts): one grouped program vs a per-expert loop, on
"tpu" and in PyTorch CPU, forward + backward, side by side in one run.

    python benchmarks/grouped_mm.py [--quick]

Each case is an MoE expert product: ``m`` routed tokens (tokens x top-k) of width ``k`` grouped
by expert (random, uneven group sizes, some experts empty), ``g`` expert weights [g, k, n].
Timed: ``y = torch._grouped_mm(x, w, offs); y.backward(dy)`` (forward 2d x 3d, backward a
2d x 3d and a 2d x 2d grouped product) against the loop a plain MoE layer would run,
``torch.cat([x[s:e] @ w[i] for each expert])`` with the offsets on the host, both on "tpu"
(Strict eager, each step ending with ``torch.tpu.synchronize()``) and on PyTorch CPU (its
``_grouped_mm`` is a per-group ``mm`` loop in C++).

A second table compares the two portable JAX kernels the lowering could use on XLA:CPU, forward
only, raw ``jax.jit``: the tiled loop (lowering/grouped_mm.py, the CPU choice) and
``jax.lax.ragged_dot`` (which XLA:CPU runs as JAX's dense expansion, every expert's product over
all m rows), with XLA's temporary buffer size for each compiled program.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, Timer, environment  # noqa: E402

# (name, m routed tokens, k, n, g experts)
CASES = [
    ("debug model x16 (8 experts)", 4096, 256, 256, 8),
    ("8 experts, wider", 8192, 512, 1024, 8),
    ("64 experts", 8192, 512, 256, 64),
]
QUICK = [("debug model x16 (8 experts)", 4096, 256, 256, 8)]


def group_sizes(m, g, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(g) * 0.7)
    sizes = np.floor(p * m).astype(np.int64)
    sizes[0] += m - sizes.sum()
    return sizes


def inputs(m, k, n, g, dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(g, n, k, generator=gen).to(dtype) / k ** 0.5
    dy = torch.randn(m, n, generator=gen).to(dtype)
    x, w, dy = x.to(device), w.to(device), dy.to(device)
    x.requires_grad_()
    w.requires_grad_()
    return x, w, dy


def grouped_step(x, w, dy, offs):
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # TorchTitan's call
    y.backward(dy)


def loop_step(x, w, dy, bounds):
    y = torch.cat([x[s:e] @ w[i].t() for i, (s, e) in enumerate(bounds)])
    y.backward(dy)


def torch_rows(timer, table, cases, dtypes):
    for name, m, k, n, g in cases:
        sizes = group_sizes(m, g)
        ends = np.cumsum(sizes)
        bounds = list(zip((ends - sizes).tolist(), ends.tolist()))
        offs = torch.tensor(ends, dtype=torch.int32)
        for dtype in dtypes:
            row = {}
            for dev in ("tpu", "cpu"):
                x, w, dy = inputs(m, k, n, g, dtype, dev)
                o = offs.to(dev)
                sync = torch.tpu.synchronize if dev == "tpu" else None
                label = "tpu" if dev == "tpu" else "CPU"
                row[f"{label} grouped"] = timer.measure(
                    lambda: grouped_step(x, w, dy, o), sync=sync).median_s * 1e3
                row[f"{label} loop"] = timer.measure(
                    lambda: loop_step(x, w, dy, bounds), sync=sync).median_s * 1e3
            short = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
            table.add(f"{name}: m={m} k={k} n={n} g={g} {short}", row)


def jax_rows(timer, table, mem_table, cases):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from torchtpu.lowering import grouped_mm as G

    for name, m, k, n, g in cases:
        sizes = jnp.asarray(group_sizes(m, g), jnp.int32)
        rng = np.random.default_rng(1)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
        tiled = jax.jit(lambda a, b, s: G._gmm_tiled(a, b, s, jnp.float32,
                                                      lax.Precision.HIGHEST))
        ragged = jax.jit(lambda a, b, s: lax.ragged_dot(a, b, s,
                                                        precision=lax.Precision.HIGHEST))
        dense = jax.jit(lambda a, b: jnp.dot(a, b[0], precision=lax.Precision.HIGHEST))
        row, mem_row = {}, {}
        for col, f, args in (("tiled loop", tiled, (x, w, sizes)),
                             ("lax.ragged_dot", ragged, (x, w, sizes)),
                             ("one dense m x k x n", dense, (x, w))):
            last = [None]

            def run(f=f, args=args):
                last[0] = f(*args)
                return last[0]

            row[col] = timer.measure(run, sync=lambda: last[0].block_until_ready()).median_s * 1e3
            mem = f.lower(*args).compile().memory_analysis()
            mem_row[col] = (mem.temp_size_in_bytes / 2**20) if mem is not None else None
        table.add(f"{name}: m={m} k={k} n={n} g={g} f32", row)
        mem_table.add(f"{name}: m={m} k={k} n={n} g={g} f32", mem_row)


def main():
    quick = "--quick" in sys.argv
    cases = QUICK if quick else CASES
    timer = Timer(warmup=2, repeats=5, min_repeat_s=0.2)
    t = Table("Grouped matmul, forward + backward (ms per step)",
              ["tpu grouped", "tpu loop", "CPU grouped", "CPU loop"], unit="ms")
    torch_rows(timer, t, cases, [torch.float32] if quick else [torch.float32, torch.bfloat16])
    t.notes.append(environment())
    t.notes.append(timer.noise_note())
    t.print(ratios=[("tpu grouped", "tpu loop"), ("tpu grouped", "CPU grouped"),
                    ("tpu grouped", "CPU loop")])
    print()
    timer2 = Timer(warmup=2, repeats=5, min_repeat_s=0.2)
    cols = ["tiled loop", "lax.ragged_dot", "one dense m x k x n"]
    j = Table("XLA:CPU grouped forward kernels, raw jax.jit (ms per call)", cols, unit="ms")
    mj = Table("XLA temporary buffers of the same programs (MiB)", cols, unit="MiB")
    jax_rows(timer2, j, mj, cases)
    j.notes.append(environment())
    j.notes.append(timer2.noise_note())
    j.print(ratios=[("lax.ragged_dot", "tiled loop"), ("tiled loop", "one dense m x k x n")])
    print()
    mj.print(ratios=[("lax.ragged_dot", "tiled loop")])


if __name__ == "__main__":
    main()
