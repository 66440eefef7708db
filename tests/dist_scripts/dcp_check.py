"""Distributed checkpoints (``torch.distributed.checkpoint``) of an FSDP2 model on "tpu".

Usage (under torchrun):
  dcp_check.py save CKPT REF  train the FSDP2 model of fsdp_check.py, save model + optimizer
                              state with ``dcp.save`` (``get_state_dict``); load it into a fresh
                              sharded model and optimizer (``dcp.load`` + ``set_state_dict``):
                              every local shard equal bit for bit, and one more step from each
                              gives identical parameters. Rank 0 writes REF (``torch.save``):
                              the full state dicts and the parameters after that one more step.
  dcp_check.py load CKPT REF  on another number of ranks: load CKPT (resharded), full state dicts
                              equal REF bit for bit; one more step equals REF's (float32
                              tolerance: the reduction runs over another number of ranks).
Prints "OK <check>" per check and "ALL OK <n>".
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_check import BATCH, Net, batch, shard, train  # noqa: E402

done = []


def ok(name):
    done.append(name)
    if dist.get_rank() == 0:
        print("OK", name, flush=True)


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def same_tree(a, b, where=""):
    """Bitwise equality of two (nested) state dicts; DTensors compared by their local shards."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        x, y = local(a).detach().cpu(), local(b).detach().cpu()
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (
            where, x.dtype, y.dtype, x.shape, y.shape, x.flatten()[:4], y.flatten()[:4])
    else:
        assert a == b, (where, a, b)


def one_step(m, opt, rank, n, dev, step=100):
    sl = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    x, y = batch(step)
    opt.zero_grad()
    nn.functional.mse_loss(m(x[sl].to(dev)), y[sl].to(dev)).backward()
    opt.step()
    return {k: p.full_tensor().detach().cpu() for k, p in m.named_parameters()}


def full_state(m, opt):
    """Full (unsharded) model and optimizer state dicts on CPU (rank 0 holds them); copies:
    a CPU tensor of the state (AdamW's ``step``) is returned as is, and later steps change it."""
    sd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, sd)


def fresh(init, dev, mesh):
    m = shard("block", init, dev, mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def main():
    what, ckpt, ref_path = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank, n = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local_rank)
    dev = torch.device(f"tpu:{local_rank}")
    mesh = init_device_mesh("tpu", (n,))
    torch.manual_seed(0)
    init = Net()
    if what == "save":
        m, opt = train("block", init, rank, n, dev, mesh, with_opt=True)
        msd, osd = get_state_dict(m, opt)
        assert all(isinstance(v, DTensor) for v in msd.values())
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        ok("save")
        full_msd, full_osd = full_state(m, opt)
        m2, opt2 = fresh(init, dev, mesh)
        msd2, osd2 = get_state_dict(m2, opt2)
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=ckpt)
        set_state_dict(m2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
        after_msd, after_osd = get_state_dict(m2, opt2)
        same_tree(after_msd, msd, "model")
        same_tree(after_osd, osd, "optim")
        ok("round trip bitwise (local shards of model and optimizer state)")
        a, b = one_step(m, opt, rank, n, dev), one_step(m2, opt2, rank, n, dev)
        same_tree(a, b, "next step")
        ok("one more step from the loaded state identical")
        if rank == 0:
            torch.save({"model": full_msd, "optim": full_osd, "next": a, "world": n}, ref_path)
    elif what == "load":
        ref = torch.load(ref_path, weights_only=True)
        assert ref["world"] != n, "load with another number of ranks than the save"
        m, opt = fresh(init, dev, mesh)
        msd, osd = get_state_dict(m, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
        full_msd, full_osd = full_state(m, opt)
        if rank == 0:
            same_tree(full_msd, ref["model"], "model")
            same_tree(full_osd, ref["optim"], "optim")
        ok(f"resharded load {ref['world']} -> {n} ranks bitwise (full model and optimizer "
           "state)")
        nxt = one_step(m, opt, rank, n, dev)
        for k, v in nxt.items():
            torch.testing.assert_close(v, ref["next"][k], msg=lambda s, k=k: f"{k}: {s}")
        ok("one more step equals the saving run's")
    else:
        raise SystemExit(f"unknown command {what}")
    dist.destroy_process_group()
    if rank == 0:
        print("ALL OK", len(done), flush=True)


if __name__ == "__main__":
    main()
