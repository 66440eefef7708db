"""The collective programs on N devices of ONE process (XLA_FLAGS=
--xla_force_host_platform_device_count=N): each program's per-device results against numpy,
for group sizes the multi-process tests do not reach. Prints "ALL OK <n>"."""
from __future__ import annotations

import sys

import jax
import numpy as np

from torchtpu.distributed import collectives as C


def run(gm, kind, static, per_rank):
    """per_rank: one block per device -> the per-device result blocks of output 0."""
    shape = (per_rank[0].shape[0] * gm.n,) + per_rank[0].shape[1:]
    g = jax.make_array_from_single_device_arrays(
        shape, gm.sharding, [jax.device_put(b, d) for b, d in zip(per_rank, gm.devices)])
    tok = jax.make_array_from_single_device_arrays(
        (gm.n,), gm.sharding, [jax.device_put(np.zeros(1, np.uint32), d) for d in gm.devices])
    out = C._program(kind, gm, static)(tok, g)[1]
    by_dev = {s.device: np.asarray(s.data) for s in out.addressable_shards}
    return [by_dev[d] for d in gm.devices]


def main():
    n = int(sys.argv[1])
    devs = jax.devices()[:n]
    assert len(devs) == n, devs
    gm = C.GroupMesh(devs, 0)
    rng = np.random.default_rng(0)
    checks = 0
    xs = [rng.integers(-5, 6, (2 * n, 3)).astype(np.float32) for _ in range(n)]
    ints = [rng.integers(0, 64, (4,)).astype(np.int64) for _ in range(n)]
    for op, ref in [("sum", np.sum), ("max", np.max), ("min", np.min), ("product", np.prod)]:
        want = ref(np.stack(xs), axis=0)
        for got in run(gm, "allreduce", (op, None), xs):
            np.testing.assert_array_equal(got, want)
        full = ref(np.stack(xs), axis=0)
        for r, got in enumerate(run(gm, "reduce_scatter", (op, None), xs)):
            np.testing.assert_array_equal(got, full[2 * r:2 * r + 2])
        checks += 2
    for op, f in [("band", np.bitwise_and), ("bor", np.bitwise_or), ("bxor", np.bitwise_xor)]:
        want = f.reduce(np.stack(ints), axis=0)
        for got in run(gm, "allreduce", (op, None), ints):
            np.testing.assert_array_equal(got, want)
        checks += 1
    for got in run(gm, "allgather", (), xs):
        np.testing.assert_array_equal(got, np.concatenate(xs))
    for src in range(n):
        for got in run(gm, "broadcast", (src,), xs):
            np.testing.assert_array_equal(got, xs[src])
    for r, got in enumerate(run(gm, "alltoall", (), xs)):
        np.testing.assert_array_equal(got, np.concatenate([x[2 * r:2 * r + 2] for x in xs]))
    checks += 3
    print("ALL OK", checks, flush=True)


if __name__ == "__main__":
    main()
