"""Point-to-point transfer time: tpu_dist ``send``/``recv`` of "tpu" tensors vs torch gloo
(CPU tensors) vs a raw JAX ``ppermute`` program over the pair (the transport inside XLA), side
by side in the same two processes.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        benchmarks/p2p.py [--max-bytes 67108864] [--repeats 5]

One measurement is a ping-pong: rank 0 sends a float32 tensor to rank 1, which receives it and
sends it back; the table shows half the round trip (one transfer, received into device memory
and synchronised: ``torch.tpu.synchronize()``), the median over repeats, and the bandwidth
that makes. The load average is printed: this host is shared.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table  # noqa: E402

SIZES = [4 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def ping_pong(send, recv, rank, sync):
    def once():
        if rank == 0:
            send(1)
            recv(1)
        else:
            recv(0)
            send(0)
        sync()
    return once


def timed(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) / 2)
    return statistics.median(ts)


def raw_pair(elems):
    """A jitted ppermute over the 2-device mesh: rank 0's block to rank 1 and back."""
    import jax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from torchtpu.distributed import bootstrap

    devs = [bootstrap.rank_device(r) for r in range(2)]
    mesh = Mesh(np.array(devs, dtype=object), ("r",))
    sh = NamedSharding(mesh, P("r"))
    f = jax.jit(jax.shard_map(lambda x: lax.ppermute(x, "r", [(0, 1), (1, 0)]), mesh=mesh,
                              in_specs=P("r"), out_specs=P("r"), check_vma=False))
    me = devs[dist.get_rank()]
    block = jax.device_put(np.ones((elems,), np.float32), me)
    g = jax.make_array_from_single_device_arrays((2 * elems,), sh, [block])

    def once():  # one exchange each way at once: a round trip's worth of bytes
        f(g).addressable_shards[0].data.block_until_ready()
    return once


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    dist.init_process_group("tpu_dist")
    gloo = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    torch.tpu.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    table = Table("p2p: one transfer (half a ping-pong), float32, 2 processes",
                  ["tpu_dist", "gloo CPU", "raw JAX ppermute"], unit="ms")
    bw = Table("p2p bandwidth (GB/s)", ["tpu_dist", "gloo CPU", "raw JAX ppermute"], unit="GB/s")
    for nbytes in [s for s in SIZES if s <= a.max_bytes]:
        elems = nbytes // 4
        xt = torch.ones(elems, device="tpu")
        xc = torch.ones(elems)
        row = {}
        row["tpu_dist"] = timed(ping_pong(lambda p: dist.send(xt, p), lambda p: dist.recv(xt, p),
                                          rank, torch.tpu.synchronize), a.repeats)
        row["gloo CPU"] = timed(ping_pong(lambda p: dist.send(xc, p, group=gloo),
                                          lambda p: dist.recv(xc, p, group=gloo), rank,
                                          lambda: None), a.repeats)
        raw = raw_pair(elems)
        row["raw JAX ppermute"] = timed(lambda: (raw(), raw()), a.repeats)
        table.add(f"{nbytes >> 10} KiB", {k: v * 1e3 for k, v in row.items()})
        bw.add(f"{nbytes >> 10} KiB", {k: nbytes / v / 1e9 for k, v in row.items()})
    if rank == 0:
        table.notes.append(f"load average {os.getloadavg()}")
        table.print([("tpu_dist", "gloo CPU"), ("tpu_dist", "raw JAX ppermute")])
        bw.print()
        m = torch.tpu.metrics()["per_op"]
        print("dist_bytes", m.get("dist_bytes", {}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
