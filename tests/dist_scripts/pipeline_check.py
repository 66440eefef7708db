"""``torch.distributed.pipelining`` on "tpu" (tpu_dist): every schedule PyTorch ships, losses
and gradients equal to one process running the whole model on CPU.

Usage: pipeline_check.py [--compile] [--stages-per-rank K] SCHEDULE [SCHEDULE ...]
(GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV;
``mismatch``: ranks whose send/recv disagree get a clear error, 2 ranks).
The model is a stack of Linear+Tanh blocks split evenly over ``world * K`` stages; single-stage
schedules use K = 1, the multi-stage ones K = 2 unless told (more stages than ranks). Stage
``s`` lives on rank ``s % world`` ("loop"), or on the V's ranks for ZBVZeroBubble and
DualPipeV (rank r holds stages r and 2 * world - 1 - r). ``--compile``: each stage's module is
``torch.compile(backend="tpu")``'d. Prints "OK <case>" per schedule and "ALL OK <n>".
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import pipelining as pp

D, BATCH, LAYERS_PER_STAGE = 16, 24, 2
SINGLE = {"GPipe": pp.ScheduleGPipe, "1F1B": pp.Schedule1F1B}
MULTI = {"Interleaved1F1B": pp.ScheduleInterleaved1F1B, "LoopedBFS": pp.ScheduleLoopedBFS,
         "InterleavedZeroBubble": pp.ScheduleInterleavedZeroBubble,
         "ZBVZeroBubble": pp.ScheduleZBVZeroBubble, "DualPipeV": pp.ScheduleDualPipeV}
V_STYLE = ("ZBVZeroBubble", "DualPipeV")
checked = []


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


def full_model(n_stages, seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(n_stages * LAYERS_PER_STAGE)])


def stage_module(model, s):
    return nn.Sequential(*list(model)[s * LAYERS_PER_STAGE:(s + 1) * LAYERS_PER_STAGE])


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target)


def stages_of(rank, world, n_stages, v_style):
    if v_style:
        return [rank, 2 * world - 1 - rank]
    return list(range(rank, n_stages, world))


def run(name, world, rank, dev, k, compiled, seed, n_micro):
    sched_cls = SINGLE.get(name) or MULTI[name]
    n_stages = world * k
    model = full_model(n_stages, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(BATCH, D, generator=g)
    y = torch.randn(BATCH, D, generator=g)
    # the reference: one process, the whole model on CPU, the same microbatches; the schedule
    # averages the microbatches' gradients (scale_grads=True)
    ref = copy.deepcopy(model)
    ref_losses = []
    for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro)):
        loss = loss_fn(ref(xm), ym)
        (loss / n_micro).backward()
        ref_losses.append(loss.detach())

    mine = stages_of(rank, world, n_stages, name in V_STYLE)
    stages, mods = [], []
    for s in mine:
        mod = stage_module(model, s).to(dev)
        mods.append((s, mod))
        run_mod = torch.compile(mod, backend="tpu") if compiled else mod
        stages.append(pp.PipelineStage(run_mod, s, n_stages, dev))
    if name in SINGLE:
        sched = sched_cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn)
    else:
        sched = sched_cls(stages, n_microbatches=n_micro, loss_fn=loss_fn)
    losses = []
    has_first, has_last = 0 in mine, n_stages - 1 in mine
    args = (x.to(dev),) if has_first else ()
    kwargs = {}
    if has_last:
        kwargs = {"target": y.to(dev), "losses": losses}
    out = sched.step(*args, **kwargs)
    if has_last:
        assert len(losses) == n_micro, (name, len(losses))
        for got, want in zip(losses, ref_losses):
            torch.testing.assert_close(got.detach().cpu(), want,
                                       msg=lambda m: f"{name} rank {rank} loss: {m}")
        assert out is not None and out.device.type == "tpu"
    for s, mod in mods:
        ref_mod = stage_module(ref, s)
        for (pn, p), rp in zip(mod.named_parameters(), ref_mod.parameters()):
            assert p.device.type == "tpu"
            assert p.grad is not None, (name, s, pn)
            torch.testing.assert_close(p.grad.cpu(), rp.grad,
                                       msg=lambda m: f"{name} rank {rank} stage {s} {pn}: {m}")
    dist.barrier()
    checked.append(name)
    if rank == 0:
        print(f"OK {name} ({n_stages} stages on {world} ranks, {n_micro} microbatches"
              f"{', compiled stages' if compiled else ''})", flush=True)


def mismatch(rank, dev):
    """Ranks whose programs disagree (a stage built for another width; both waiting to
    receive): a clear error on both ranks naming both sides' transfers (the receiver at its
    wait; the sender, whose send completed when it was buffered, at its next send/recv call
    after the receiver found it); the group stays usable."""
    peer = 1 - rank

    def check(e):
        msg = str(e)
        assert "does not match rank" in msg, msg
        assert f"float32[4, {D}]" in msg and f"float32[4, {D + 1}]" in msg, msg
        assert f"rank {peer}" in msg, msg

    if rank == 0:
        dist.isend(torch.ones(4, D, device=dev), 1).wait()  # buffered: completes at once
    else:
        try:
            dist.irecv(torch.empty(4, D + 1, device=dev), 0).wait()
            raise AssertionError("no error")
        except RuntimeError as e:
            check(e)
    dist.barrier()
    if rank == 0:
        try:
            dist.irecv(torch.empty(3, device=dev), 1)
            raise AssertionError("no error")
        except RuntimeError as e:
            check(e)
    w = dist.irecv(torch.empty(3, device=dev), peer)
    try:
        w.wait()
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "deadlock with rank" in str(e) and "no send meets a recv" in str(e), str(e)
    t = torch.full((2,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert t.cpu().tolist() == [3.0, 3.0]
    checked.append("mismatch")
    if rank == 0:
        print("OK mismatched send/recv: a clear error on both ranks (shapes; deadlock)",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("schedules", nargs="+")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--stages-per-rank", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300, help="the process group's (s)")
    a = ap.parse_args()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    for i, name in enumerate(a.schedules):
        if name == "mismatch":
            mismatch(rank, dev)
            continue
        k = 1 if name in SINGLE else (2 if name in V_STYLE else a.stages_per_rank)
        n_micro = max(4, world * k)
        run(name, world, rank, dev, k, a.compile, 10 + i, n_micro)
    dist.destroy_process_group()
    if rank == 0:
        print("ALL OK", len(checked), flush=True)


if __name__ == "__main__":
    main()
