"""Pipeline parallelism of the small GPT on "tpu" (tpu_dist): GPipe, 1F1B and interleaved 1F1B
against DDP on the same ranks; step time, peak memory per rank, bubble fraction vs theory.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        benchmarks/pipeline.py [--layers 4 --embd 128 --heads 4 --seq-len 64 --batch 16 \\
                                --microbatches 4]

The model is examples/train_gpt.py's GPT (untied embeddings, so stages own disjoint
parameters), cut into stages of whole blocks: the first stage also holds the embeddings, the
last the final LayerNorm and the head. GPipe and 1F1B use one stage per rank; interleaved
1F1B two per rank (looped: stage s on rank s % world). One step = forward and backward of
--microbatches microbatches of the global batch, then SGD; DDP runs the whole model on each
rank with the batch split. Every timed step ends with ``torch.tpu.synchronize()`` on every
rank; the table shows the median of --steps steps (after --warmup) as rank 0 saw them.

Peak memory per rank: ``torch.tpu.max_memory_allocated`` over one more step after
``reset_peak_memory_stats`` (sampled where the runtime samples it: synchronize points and
allocations it tracks). Bubble fraction, measured: ``1 - t_ideal / t_step`` where ``t_ideal``
is the time of the same step of the whole model in one process (no pipeline, all
microbatches, measured first on rank 0 while the other ranks wait) divided by the number of
ranks; theory: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v * m + p - 1)`` for
interleaved with v stages per rank (p ranks, m microbatches). On a CPU host whose cores the
ranks share, the ranks' compute is not concurrent, so measured bubbles there say little
about an accelerator's: compare the columns on one machine only. The load average is printed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import pipelining as pp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_gpt import GPT  # noqa: E402

SCHEDULES = {"gpipe": (pp.ScheduleGPipe, 1), "1f1b": (pp.Schedule1F1B, 1),
             "interleaved": (pp.ScheduleInterleaved1F1B, 2)}


class Stage(nn.Module):
    """Blocks [lo, hi) of ``gpt``; the first stage embeds, the last projects to logits."""

    def __init__(self, gpt, lo, hi, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x):
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x)) if self.last else x


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def gpt(a):
    torch.manual_seed(0)
    return GPT(a.vocab, a.seq_len, a.layers, a.heads, a.embd, tie_weights=False)


def timed(step, a, dev):
    for _ in range(a.warmup):
        step()
    torch.tpu.synchronize(dev)
    dist.barrier()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        torch.tpu.synchronize(dev)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    torch.tpu.reset_peak_memory_stats(dev)
    step()
    torch.tpu.synchronize(dev)
    return statistics.median(times) * 1e3, torch.tpu.max_memory_allocated(dev)


def run_pipeline(name, a, dev, rank, world, x, y):
    cls, v = SCHEDULES[name]
    n_stages = world * v
    if a.layers % n_stages:
        raise ValueError(f"{a.layers} layers do not split into {n_stages} stages")
    per = a.layers // n_stages
    model = gpt(a)
    mine = list(range(rank, n_stages, world))
    mods = [Stage(model, s * per, (s + 1) * per, s == 0, s == n_stages - 1).to(dev)
            for s in mine]
    stages = [pp.PipelineStage(m, s, n_stages, dev) for m, s in zip(mods, mine)]
    sched = cls(stages[0] if v == 1 else stages, n_microbatches=a.microbatches,
                loss_fn=loss_fn)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=1e-2)
    xd, yd = x.to(dev), y.to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        if 0 in mine:
            sched.step(xd, target=yd if n_stages - 1 in mine else None)
        elif n_stages - 1 in mine:
            sched.step(target=yd)
        else:
            sched.step()
        opt.step()

    return timed(step, a, dev)


def run_ddp(a, dev, rank, world, x, y):
    model = gpt(a).to(dev)
    ddp = DDP(model, device_ids=[dev.index])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sl = slice(rank * a.batch // world, (rank + 1) * a.batch // world)
    xd, yd = x[sl].to(dev), y[sl].to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(xd.chunk(max(1, a.microbatches // world)),
                          yd.chunk(max(1, a.microbatches // world))):
            _, loss = ddp(xm, ym)
            loss.backward()
        opt.step()

    return timed(step, a, dev)


def run_single(a, dev, x, y):
    """The whole model, all microbatches, one process: the pipeline's work without a pipe."""
    model = gpt(a).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    xd, yd = x.to(dev), y.to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(xd.chunk(a.microbatches), yd.chunk(a.microbatches)):
            _, loss = model(xm, ym)
            (loss / a.microbatches).backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    torch.tpu.synchronize(dev)
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        torch.tpu.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--vocab", type=int, default=68)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    a = ap.parse_args()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(a.vocab, (a.batch, a.seq_len), generator=g)
    y = torch.randint(a.vocab, (a.batch, a.seq_len), generator=g)
    t_single = run_single(a, dev, x, y) if rank == 0 else 0.0
    dist.barrier()
    rows = []
    for name in ["ddp"] + a.schedules.split(","):
        try:
            res = run_ddp(a, dev, rank, world, x, y) if name == "ddp" else \
                run_pipeline(name, a, dev, rank, world, x, y)
        except Exception as e:  # noqa: BLE001  (reported in the table)
            res = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
        got = [None] * world
        dist.all_gather_object(got, res)
        rows.append((name, got))
    if rank == 0:
        m, p = a.microbatches, world
        print(f"small GPT: {a.layers} layers, embd {a.embd}, {a.heads} heads, seq "
              f"{a.seq_len}, global batch {a.batch}, {m} microbatches, {p} ranks; median of "
              f"{a.steps} steps; one process, whole model: {t_single:.1f} ms/step; "
              f"load average {os.getloadavg()[0]:.2f}")
        print("| config | ms/step | vs DDP | peak memory per rank (MiB) | bubble measured | "
              "bubble theory |")
        print("|---|---|---|---|---|---|")
        ddp_ms = rows[0][1][0][0] if isinstance(rows[0][1][0], tuple) else None
        for name, got in rows:
            if not isinstance(got[0], tuple):
                print(f"| {name} | {got[0]} | | | | |")
                continue
            ms = got[0][0]
            mem = " / ".join(f"{r[1] / 2**20:.2f}" for r in got if isinstance(r, tuple))
            theory = measured = ""
            if name != "ddp":
                v = SCHEDULES[name][1]
                theory = f"{(p - 1) / (v * m + p - 1):.2f}"
                measured = f"{max(0.0, 1 - (t_single / p) / ms):.2f}"
            vs = f"{ms / ddp_ms:.2f}" if ddp_ms else ""
            print(f"| {name} | {ms:.1f} | {vs} | {mem} | {measured} | {theory} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
