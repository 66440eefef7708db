"""Functional collectives (``torch.distributed._functional_collectives``, the
``_c10d_functional`` ops) on "tpu": eager device kernels and lowerings inside compiled graphs;
``torch.compile`` of DDP, FSDP2 and tensor-parallel models.

The 2-rank launches run tests/dist_scripts/functional_check.py (and ddp_check.py), which compare
every result with a CPU reference computed in-process and print "ALL OK"; the compile metrics
prove the collectives were lowered into the programs (no CPU callback).
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dist_launch import ok, torchrun

C10D = torch.ops._c10d_functional


def test_lowerings_and_kernels_registered():
    from torchtpu.lowering import registry

    for name in ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor",
                 "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
                 "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"):
        low = registry.get(getattr(C10D, name).default)
        assert low is not None and low.graph_only and "mesh" in low.meta, name
    assert registry.get(C10D.wait_tensor.default) is not None
    for name in ("all_reduce", "all_reduce_", "all_gather_into_tensor", "wait_tensor",
                 "reduce_scatter_tensor", "all_to_all_single", "broadcast"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(
            f"_c10d_functional::{name}", "PrivateUse1"), name


def test_group_of_one_eager_and_compiled():
    """A world of one process: the kernels and the lowerings (identities, no mesh)."""
    dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        g = dist.group.WORLD
        x = torch.arange(6.0).reshape(3, 2)

        def f(t):
            a = funcol.all_reduce(t * 2, "sum", g)
            b = funcol.all_gather_tensor(a + 1, 0, g)
            c = funcol.reduce_scatter_tensor(b, "avg", 0, g)
            return a, b, c

        want = (x * 2, x * 2 + 1, x * 2 + 1)
        for fn in (f, torch.compile(f, backend="tpu", fullgraph=True)):
            got = [t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
                   for t in fn(x.to("tpu"))]
            for a, b in zip(got, want):
                assert a.device.type == "tpu"
                torch.testing.assert_close(a.cpu(), b)
        m = torch.tpu.metrics()["per_op"]
        assert m["compile_collectives"]["_c10d_functional::all_reduce.default"] >= 1
        assert "_c10d_functional::all_reduce.default" not in m.get("compile_cpu_fallbacks", {})
    finally:
        dist.destroy_process_group()


def test_functional_collectives_two_ranks():
    """Eager (every functional collective, in-place and out= overloads, uneven all_to_all,
    autograd variants; no host sync), Fused (cut around collectives), and one compiled program
    holding compute and every kind of collective, plus an in-place collective on an input."""
    ok(*torchrun("functional_check.py", "eager", "fused", "compiled_one", timeout=400))


@pytest.mark.slow
def test_functional_collectives_compiled_each_two_ranks():
    """Every functional collective and autograd variant in its own compiled graph."""
    ok(*torchrun("functional_check.py", "compiled", timeout=600))


@pytest.mark.slow
def test_compiled_training_fsdp2_and_tensor_parallel_two_ranks():
    """A tensor-parallel MLP with funcol.all_reduce trained in eager and compiled vs CPU gloo;
    torch.compile of an FSDP2 model (blocks compiled, then fully_shard) and of a
    tensor-parallel (DTensor) model: 3 AdamW steps vs one CPU process."""
    ok(*torchrun("functional_check.py", "train", "fsdp_compiled", "tp_compiled", timeout=600))


@pytest.mark.slow
def test_compiled_ddp_two_ranks():
    """torch.compile(DDP(model)): DDPOptimizer's split graphs compiled; parameters vs one
    CPU process on the full batch."""
    ok(*torchrun("ddp_check.py", "compile_outer", timeout=600))
