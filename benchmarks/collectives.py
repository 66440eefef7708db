"""Collective latency and bus bandwidth: "tpu_dist" vs torch gloo (CPU tensors) vs the raw JAX
program, side by side in the same processes; and DDP's cost on the small GPT.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        benchmarks/collectives.py [--max-bytes 67108864] [--ddp-steps 20]

Per size and collective, every contender runs the same fixed number of back-to-back calls
(every rank must issue the same collectives, so no per-rank autorange), synchronised at the
end of each repeat; the table shows the median over repeats of the time per call, and the bus
bandwidth in nccl-tests' convention (all_reduce 2(n-1)/n x bytes / t; all_gather and
reduce_scatter (n-1)/n x the full buffer / t). "raw JAX" calls the same jitted shard_map program
on prebuilt global arrays, each call taking the previous one's order token as tpu_dist's
programs do: the floor of this design (no tensor reads or writes, no Work).

DDP: the GPT of examples/train_gpt.py, one step = forward, backward, AdamW. Both ranks run N
steps without DDP (no communication), then N steps under DDP, at the same time, so the CPU
contention of this machine is the same in both; scaling efficiency = local step / DDP step
(the fraction of a perfectly scaling 2-rank step).
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

from torchtpu.eager import copy as _copy

SIZES = [4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def calls_for(nbytes: int) -> int:
    return int(max(3, min(50, 64e6 / max(nbytes, 1) / 4)))


def timed(fn, sync, calls, repeats):
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts)


def busbw(kind, nbytes, n, t):
    f = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return f * nbytes / t / 1e9


def raw_program(kind, pg, elems):
    """The jitted program tpu_dist runs, called on prebuilt global arrays."""
    import jax

    from torchtpu.distributed import collectives as C

    gm = pg._gm
    n = gm.n
    static = {"all_reduce": ("sum", None), "all_gather": (), "reduce_scatter": ("sum", None)}
    prog = {"all_reduce": "allreduce", "all_gather": "allgather",
            "reduce_scatter": "reduce_scatter"}[kind]
    fn = C._program(prog, gm, static[kind])
    rows = elems if kind != "reduce_scatter" else elems  # block rows
    x = jax.device_put(np.ones((rows,), np.float32), gm.local)
    tok = jax.device_put(np.zeros((1,), np.uint32), gm.local)
    gx, gt = gm.enter(x), gm.enter(tok)
    out = [(gt,)]

    def call():  # each call takes the previous one's order token, as tpu_dist's do
        out[0] = fn(out[0][0], gx)

    def sync():
        jax.block_until_ready(out[0])

    del n
    return call, sync


def bench_collectives(args, rank, n, dev, gloo):
    pg = dist.distributed_c10d._get_default_group()
    rows = []
    for nbytes in [s for s in SIZES if s <= args.max_bytes]:
        elems = max(nbytes // 4, 1)
        calls = calls_for(nbytes)
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            res = {}
            for who in ("tpu_dist", "gloo", "raw JAX"):
                d = dev if who == "tpu_dist" else torch.device("cpu")
                if kind == "all_reduce":
                    x = torch.ones(elems, device=d)
                    fn = (lambda x=x, g=(gloo if who == "gloo" else None):
                          dist.all_reduce(x, group=g))
                    full = nbytes
                elif kind == "all_gather":
                    x = torch.ones(elems, device=d)
                    y = torch.empty(elems * n, device=d)
                    fn = (lambda x=x, y=y, g=(gloo if who == "gloo" else None):
                          dist.all_gather_into_tensor(y, x, group=g))
                    full = nbytes * n
                else:
                    x = torch.ones(elems * n, device=d)
                    y = torch.empty(elems, device=d)
                    fn = (lambda x=x, y=y, g=(gloo if who == "gloo" else None):
                          dist.reduce_scatter_tensor(y, x, group=g))
                    full = nbytes * n
                # wait for the last result only (collectives run in issue order);
                # torch.tpu.synchronize() would wait for every live array (milliseconds here)
                sync = ((lambda y=(x if kind == "all_reduce" else y):
                         _copy.value_of(y).block_until_ready())
                        if who == "tpu_dist" else (lambda: None))
                if who == "raw JAX":
                    blk = elems * n if kind == "reduce_scatter" else elems
                    fn, sync = raw_program(kind, pg, blk)
                t = timed(fn, sync, calls, args.repeats)
                res[who] = (t, busbw(kind, full if kind != "all_reduce" else nbytes, n, t))
            rows.append((kind, nbytes, res))
            if rank == 0:
                t_ours, t_gloo, t_raw = (res[w][0] for w in ("tpu_dist", "gloo", "raw JAX"))
                print(f"{kind:15s} {fmt_bytes(nbytes):>7s}  tpu_dist {t_ours * 1e6:9.1f} us "
                      f"({res['tpu_dist'][1]:6.3f} GB/s)  gloo {t_gloo * 1e6:9.1f} us "
                      f"({res['gloo'][1]:6.3f} GB/s)  raw JAX {t_raw * 1e6:9.1f} us  "
                      f"ours-raw {(t_ours - t_raw) * 1e6:8.1f} us  ours/gloo "
                      f"{t_ours / t_gloo:5.2f}", flush=True)
    return rows


def fmt_bytes(b):
    for unit, s in (("MB", 1 << 20), ("KB", 1 << 10)):
        if b >= s:
            return f"{b // s}{unit}"
    return f"{b}B"


def bench_ddp(args, rank, n, dev):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples"))
    from train_gpt import GPT, CharData, DATA
    from torch.nn.parallel import DistributedDataParallel as DDP

    data = CharData(DATA)
    torch.manual_seed(0)
    model = GPT(data.vocab_size, 64, 2, 4, 96, dropout=0.0).to(dev)
    gen = torch.Generator().manual_seed(rank)

    def run(m, steps):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        ts = []
        for i in range(steps + 3):
            x, y = data.batch("train", 16, 64, gen)
            t0 = time.perf_counter()
            _, loss = m(x.to(dev), y.to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss.item()
            if i >= 3:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    dist.barrier()
    t_local = run(model, args.ddp_steps)
    dist.barrier()
    t_ddp = run(DDP(model, device_ids=[dev.index]), args.ddp_steps)
    dist.barrier()
    t_view = run(DDP(model, device_ids=[dev.index], gradient_as_bucket_view=True),
                 args.ddp_steps)
    if rank == 0:
        print(f"GPT step (2 layers, embd 96, batch 16x64 per rank): local {t_local * 1e3:.1f} ms, "
              f"DDP on {n} ranks {t_ddp * 1e3:.1f} ms (scaling efficiency "
              f"{t_local / t_ddp:.2f}), with gradient_as_bucket_view {t_view * 1e3:.1f} ms "
              f"({t_local / t_view:.2f})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ddp-steps", type=int, default=15)
    ap.add_argument("--skip-ddp", action="store_true")
    ap.add_argument("--skip-collectives", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("tpu_dist")
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    gloo = dist.new_group(backend="gloo")
    if rank == 0:
        import jax

        print(f"{n} ranks; jax {jax.__version__}, torch {torch.__version__}, "
              f"cpu collectives {jax.config.jax_cpu_collectives_implementation}; "
              f"median of {args.repeats} repeats", flush=True)
    if not args.skip_collectives:
        bench_collectives(args, rank, n, dev, gloo)
    if not args.skip_ddp:
        bench_ddp(args, rank, n, dev)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
