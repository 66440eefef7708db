"""Sharded training steps of the small GPT: DDP, FSDP2 (eager and compiled) and tensor parallel,
"tpu_dist" on device "tpu" side by side with torch gloo on CPU tensors, in the same processes.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        benchmarks/sharded_step.py [--layers 2 --embd 128 --heads 4 --seq-len 64 --batch 8]

The model is examples/train_gpt.py's GPT. One step = forward, backward, AdamW; the global batch
is split across ranks for DDP and FSDP2 (per block and root, reshard after forward), and every
rank sees all of it under TP (ColwiseParallel / RowwiseParallel on each block's MLP linears).
"fsdp2+compile" compiles every block (``block.compile``, backend "tpu" on tpu, "inductor" on
CPU) before sharding it. Each configuration warms up (compiles), then times --steps steps one
by one, each ending with ``torch.tpu.synchronize()`` (CPU steps are synchronous); the table
shows the median. "loss" is the first step's loss of the global batch (the same number in every
row shows the configurations compute the same thing). Memory: one more, untimed step samples
``torch.tpu.memory_allocated`` in every block's forward and backward hooks and after the step;
the peak, per rank, counts every live device buffer of the process (model, gradients,
optimizer state, activations, buffers in flight). "tpu graph programs": torch.compile graph
programs the tpu backend built during the configuration, compiled or loaded from the disk cache
(``compile_cache_misses``). A configuration that fails prints "n/a" and the first line of its
error.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_gpt import GPT  # noqa: E402

KINDS = ["ddp", "fsdp2", "fsdp2+compile", "tp"]


def sync(dev):
    if dev.type == "tpu":
        torch.tpu.synchronize()


def build(kind, dev, mesh, pg, a, vocab):
    torch.manual_seed(0)
    m = GPT(vocab, a.seq_len, a.layers, a.heads, a.embd).to(dev)
    model, foreach = m, None
    if kind == "ddp":
        model = DDP(m, device_ids=[dev.index] if dev.type == "tpu" else None, process_group=pg)
    elif kind.startswith("fsdp2"):
        for b in m.blocks:
            if kind == "fsdp2+compile":
                b.compile(backend="tpu" if dev.type == "tpu" else "inductor")
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
    elif kind == "tp":
        for b in m.blocks:
            parallelize_module(b.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        foreach = False  # DTensor and plain parameters in one optimizer: no multi-tensor ops
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=foreach)
    return m, model, opt


def run(kind, dev, mesh, pg, a, vocab, x, y, rank, n):
    m, model, opt = build(kind, dev, mesh, pg, a, vocab)
    if kind != "tp":  # data parallel: each rank its slice of the global batch
        sl = slice(rank * a.batch // n, (rank + 1) * a.batch // n)
        x, y = x[sl], y[sl]
    x, y = x.to(dev), y.to(dev)
    counters = torch.tpu.metrics()["counters"] if dev.type == "tpu" else {}
    c0 = counters.get("compile_cache_misses", 0)

    def step():
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    loss0 = step().detach().float()
    if kind != "tp":
        dist.all_reduce(loss0, op=dist.ReduceOp.AVG, group=pg)
    loss0 = loss0.item()
    for _ in range(a.warmup - 1):
        step()
    sync(dev)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    peak = graphs = None
    if dev.type == "tpu":
        graphs = torch.tpu.metrics()["counters"].get("compile_cache_misses", 0) - c0
        gc.collect()
        samples = []

        def probe(*_):
            samples.append(torch.tpu.memory_allocated(dev))

        hooks = []
        for b in m.blocks:
            hooks.append(b.register_forward_pre_hook(probe))
            hooks.append(b.register_forward_hook(probe))
            hooks.append(b.register_full_backward_hook(probe))
        probe()
        step()
        probe()
        sync(dev)
        probe()
        for h in hooks:
            h.remove()
        peak = max(samples)
    del m, model, opt
    gc.collect()
    return statistics.median(times) * 1e3, loss0, peak, graphs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--vocab", type=int, default=68, help="examples/data/fables.txt has 68")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS))
    a = ap.parse_args()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=600))
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    gloo = dist.new_group(backend="gloo")
    meshes = {"tpu": (init_device_mesh("tpu", (n,)), None),
              "cpu": (DeviceMesh.from_group(gloo, "cpu"), gloo)}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(a.vocab, (a.batch, a.seq_len), generator=g)
    y = torch.randint(a.vocab, (a.batch, a.seq_len), generator=g)
    rows = []
    for kind in a.kinds.split(","):
        res = {}
        for d in (dev, torch.device("cpu")):
            mesh, pg = meshes[d.type]
            try:
                res[d.type] = run(kind, d, mesh, pg, a, a.vocab, x, y, rank, n)
            except Exception as e:  # noqa: BLE001  (reported in the table)
                res[d.type] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
            if rank == 0:
                print(f"  done {kind} {d.type}", flush=True)
        rows.append((kind, res))
    peaks = [None] * n
    dist.all_gather_object(peaks, [r["tpu"][2] if isinstance(r["tpu"], tuple) else None
                                   for _, r in rows])
    if rank == 0:
        print(f"\nsmall GPT: {a.layers} layers, embd {a.embd}, {a.heads} heads, seq {a.seq_len},"
              f" global batch {a.batch}, {n} ranks; median of {a.steps} steps after {a.warmup}")
        print("| config | tpu ms/step | gloo CPU ms/step | tpu / CPU | first loss tpu | "
              "first loss CPU | peak memory_allocated per rank (tpu) | tpu graph programs |")
        print("|---|---|---|---|---|---|---|---|")
        notes = []
        for i, (kind, res) in enumerate(rows):
            cells = []
            for k in ("tpu", "cpu"):
                cells.append(f"{res[k][0]:.1f}" if isinstance(res[k], tuple) else "n/a")
            ratio = (f"{res['tpu'][0] / res['cpu'][0]:.2f}"
                     if all(isinstance(res[k], tuple) for k in res) else "")
            losses = [f"{res[k][1]:.6f}" if isinstance(res[k], tuple) else "" for k in
                      ("tpu", "cpu")]
            mem = " / ".join(f"{p[i] / 2**20:.2f} MiB" for p in peaks if p[i] is not None)
            graphs = res["tpu"][3] if isinstance(res["tpu"], tuple) else None
            print(f"| {kind} | {cells[0]} | {cells[1]} | {ratio} | {losses[0]} | {losses[1]} "
                  f"| {mem} | {graphs if graphs is not None else ''} |")
            notes += [f"{kind} {k}: {v}" for k, v in res.items() if isinstance(v, str)]
        for line in notes:
            print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
