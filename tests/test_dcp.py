"""Distributed checkpoints (``torch.distributed.checkpoint``) of an FSDP2 model on "tpu".

tests/dist_scripts/dcp_check.py saves model and optimizer state of a trained FSDP2 model with
``dcp.save`` (``get_state_dict``) on 2 ranks and loads it back (exact round trip); the
checkpoint is then loaded with other numbers of ranks (resharded, bitwise) and into a plain
CPU model without a process group (``dcp_to_torch_save`` and ``dcp.load``). A launch passes
only if it exits 0 and printed "ALL OK".
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dist_launch import SCRIPTS, ok, torchrun


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved by 2 ranks, and the saving run's full state (REF)."""
    d = tmp_path_factory.mktemp("dcp")
    ckpt, ref = str(d / "ckpt"), str(d / "ref.pt")
    ok(*torchrun("dcp_check.py", "save", ckpt, ref, timeout=500))
    return ckpt, ref


def _net():
    sys.path.insert(0, SCRIPTS)
    try:
        from fsdp_check import Net
    finally:
        sys.path.remove(SCRIPTS)
    torch.manual_seed(123)  # other values than the checkpoint's
    return Net()


@pytest.mark.slow  # ~1 min (a 2-rank launch); the suite's default budget holds test_fsdp's
def test_dcp_save_round_trip_and_plain_cpu_load(saved, tmp_path):
    """2 ranks: save, load into fresh sharded model + optimizer bitwise, one more step
    identical. Then, in this process (no process group): the checkpoint converted with
    dcp_to_torch_save, and loaded with dcp.load into a CPU state dict, loads into a plain CPU
    model with the saving run's exact values."""
    ckpt, ref_path = saved
    ref = torch.load(ref_path, weights_only=True)
    assert not dist.is_initialized()
    out = tmp_path / "full.pt"
    dcp_to_torch_save(ckpt, str(out))
    full = torch.load(out, weights_only=True)
    m = _net()
    m.load_state_dict(full["model"])
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref["model"][k]), k
    for k, st in ref["optim"]["state"].items():
        for name, v in st.items():
            assert torch.equal(full["optim"]["state"][k][name], v), (k, name)
    m2 = _net()
    sd = m2.state_dict()
    dcp.load({"model": sd}, checkpoint_id=ckpt)
    m2.load_state_dict(sd)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, ref["model"][k]), k


@pytest.mark.slow  # ~1 min
def test_dcp_resharded_load_one_rank(saved):
    """Saved by 2 ranks, loaded by 1: full model and optimizer state bitwise, one more step
    equal to the saving run's."""
    ok(*torchrun("dcp_check.py", "load", *saved, nproc=1, timeout=400))


@pytest.mark.slow  # ~3 min: 4 processes on this host
def test_dcp_resharded_load_four_ranks(saved):
    ok(*torchrun("dcp_check.py", "load", *saved, nproc=4, timeout=600))
