"""DTensor, tensor parallel, 2-D FSDP2 x TP and DCP of a TP model on "tpu" (backend "tpu_dist").

Each test launches ranks on 127.0.0.1 (bounded in time, killed by session if they overrun)
running a script of tests/dist_scripts/ that compares every result with the same computation
on plain CPU tensors (float32 tolerance; exact where no arithmetic happens) and prints
"ALL OK". The default test runs tensor parallel with sequence parallel and loss_parallel, the
DCP round trip and the core DTensor checks in two launches' worth of time; the rest is slow.
"""
from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_launch import ok as _ok
from dist_launch import torchrun as _torchrun


def test_full_state_dict_broadcast_from_rank0_group_of_one():
    """DCP's broadcast_from_rank0 picks its device from ``group._device_types`` (empty for a
    Python group: IndexError); object collectives still choose CPU tensors."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        pg = dist.group.WORLD
        assert torch.device("tpu") in pg._device_types
        assert dist.distributed_c10d._get_object_coll_device(pg) == "cpu"
        mesh = init_device_mesh("tpu", (1,))
        torch.manual_seed(0)
        ref = nn.Linear(4, 3)
        m = parallelize_module(copy.deepcopy(ref).to("tpu"), mesh, ColwiseParallel())
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
        set_model_state_dict(m, ref.state_dict(), options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        for name, p in m.named_parameters():
            assert isinstance(p, DTensor) and p.to_local().device.type == "tpu"
            assert torch.equal(p.full_tensor().cpu(), ref.state_dict()[name]), name
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_llama_block_and_dcp(tmp_path):
    """A Llama-style model with ColwiseParallel / RowwiseParallel / SequenceParallel /
    PrepareModuleInput and loss_parallel trains 3 AdamW steps (clip_grad_norm_) equal to one CPU
    process; its model + optimizer state round-trips exactly through DCP."""
    _ok(*_torchrun("tp_check.py", "--ckpt", str(tmp_path / "ckpt"), "sp", "dcp", timeout=500))


@pytest.mark.slow
def test_dtensor_ops_strict():
    """distribute_tensor / from_local / full_tensor (uneven and empty shards), every
    Shard/Replicate/Partial transition, matmul, elementwise, reductions, softmax, embedding,
    view ops, autograd, distributed RNG and a named 2-D mesh, vs CPU."""
    _ok(*_torchrun("dtensor_check.py", timeout=600))


@pytest.mark.slow
def test_dtensor_ops_fused():
    """The same DTensor checks in Fused eager mode."""
    _ok(*_torchrun("dtensor_check.py", "--mode", "fused", timeout=900))


@pytest.mark.slow
def test_tensor_parallel_plain():
    """ColwiseParallel / RowwiseParallel with replicated activations, vs one CPU process."""
    _ok(*_torchrun("tp_check.py", "tp", timeout=500))


@pytest.mark.slow
def test_tensor_parallel_fused(tmp_path):
    _ok(*_torchrun("tp_check.py", "--mode", "fused", "--ckpt", str(tmp_path / "ckpt"),
                   "tp", "sp", "dcp", timeout=900))


@pytest.mark.slow
def test_tensor_parallel_compiled():
    """The sequence-parallel model under torch.compile(backend="tpu") matches one CPU process."""
    _ok(*_torchrun("tp_check.py", "sp_compile", timeout=600))


@pytest.mark.slow
def test_fsdp2_x_tp_4_ranks():
    """2-D: TP on mesh["tp"], fully_shard on mesh["dp"] of a (2, 2) mesh, 4 processes."""
    _ok(*_torchrun("tp_check.py", "fsdp_tp", nproc=4, timeout=1200))


@pytest.mark.slow
def test_dtensor_4_ranks():
    """The DTensor checks on 4 ranks: 1-D mesh of 4, and a (2, 2) ("dp", "tp") mesh."""
    _ok(*_torchrun("dtensor_check.py", nproc=4, timeout=1200))
