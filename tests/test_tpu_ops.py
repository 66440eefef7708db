"""``torch.tpu.ops``: optimization_barrier, max_pool, all_gather_dim, reduce_scatter_dim,
ragged_all_to_all, send/recv: Strict, Fused and compiled against PyTorch CPU (and, for the collectives,
their definitions composed from ordinary collectives on CPU/gloo: tests/dist_scripts/
tpu_ops_check.py on 2 ranks)."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchtpu.ops as tops
from dist_launch import ok, torchrun

POOLS = [dict(kernel_size=(3, 3)),
         dict(kernel_size=(3, 2), stride=(2, 1), padding=1, ceil_mode=True),
         dict(kernel_size=(2, 2), dilation=2),
         dict(kernel_size=(3,), stride=2, padding=1),
         dict(kernel_size=(2, 2, 2), stride=1)]
_F = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _ref_pool(x, kw):
    k = kw["kernel_size"]
    return _F[len(k)](x, k, kw.get("stride"), kw.get("padding", 0), kw.get("dilation", 1),
                      kw.get("ceil_mode", False))


def _pool_input(nd):
    torch.manual_seed(nd)
    x = torch.randn((2, 3) + (7, 8, 6)[:nd])
    x.view(-1)[5] = x.view(-1)[6]  # a tie inside a window: the first maximum takes the grad
    return x


def _pool_cases():
    for mode in ("strict", "fused", "compiled", "cpu"):
        for i, kw in enumerate(POOLS):
            # every case in Strict and on CPU; Fused and compiled: two by default
            slow = mode in ("fused", "compiled") and i >= 2
            yield pytest.param(kw, mode, id=f"{mode}-{i}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("kw,mode", list(_pool_cases()))
def test_max_pool(kw, mode):
    x = _pool_input(len(kw["kernel_size"]))
    xr = x.clone().requires_grad_()
    ref = _ref_pool(xr, kw)
    gout = torch.randn(ref.shape)
    ref.backward(gout)
    dev = "cpu" if mode == "cpu" else "tpu"
    xt = x.clone().to(dev).requires_grad_()
    fn = (lambda t: tops.max_pool(t, **kw))
    if mode == "compiled":
        fn = torch.compile(fn, backend="tpu", fullgraph=True)
    if mode == "fused":
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            y = fn(xt)
            y.backward(gout.to(dev))
    else:
        y = fn(xt)
        y.backward(gout.to(dev))
    assert y.device.type == dev
    torch.testing.assert_close(y.detach().cpu(), ref.detach())
    torch.testing.assert_close(xt.grad.cpu(), xr.grad)
    if mode == "compiled":
        fb = torch.tpu.metrics()["per_op"].get("compile_cpu_fallbacks", {})
        assert not any(k.startswith("tpu::max_pool") for k in fb), fb


def test_max_pool_nan_int_and_errors():
    x = torch.randn(1, 2, 6, 6)
    x[0, 1, 2, 3] = float("nan")
    torch.testing.assert_close(tops.max_pool(x.to("tpu"), 2).cpu(), F.max_pool2d(x, 2),
                               equal_nan=True)
    xi = torch.randint(-100, 100, (1, 2, 6, 6), dtype=torch.int32)
    assert torch.equal(tops.max_pool(xi.to("tpu"), (3, 3), 2, 1).cpu(),
                       F.max_pool2d(xi.float(), 3, 2, 1).to(torch.int32))
    with pytest.raises(RuntimeError, match="max_pool: a 2-d pooling expects"):
        tops.max_pool(torch.randn(5, device="tpu"), 2)
    with pytest.raises(RuntimeError, match="max_pool: stride must be"):
        tops.max_pool(torch.randn(1, 1, 4, 4, device="tpu"), (2, 2), stride=(1, 1, 1))
    assert "max_pool" in tops.__all__ and "optimization_barrier" in tops.__all__


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_optimization_barrier(mode):
    a, b = torch.randn(3, 4), torch.randint(0, 5, (2,))
    at = a.to("tpu").requires_grad_()

    def f(a, b):
        x, y = tops.optimization_barrier((a * 2, b + 1))
        return (x.sin() * 3).sum(), y

    fn = torch.compile(f, backend="tpu", fullgraph=True) if mode == "compiled" else f
    if mode == "fused":
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            s, y = fn(at, b.to("tpu"))
            s.backward()
    else:
        s, y = fn(at, b.to("tpu"))
        s.backward()
    ar = a.clone().requires_grad_()
    sr, yr = f(ar, b)
    sr.backward()
    torch.testing.assert_close(s.detach().cpu(), sr.detach())
    assert torch.equal(y.cpu(), yr)
    torch.testing.assert_close(at.grad.cpu(), ar.grad)
    one = tops.optimization_barrier(at)
    assert isinstance(one, torch.Tensor) and torch.equal(one.detach().cpu(), a)


def test_optimization_barrier_in_the_program():
    from torchtpu.lowering import registry

    low = registry.get(torch.ops.tpu.optimization_barrier.default)
    import jax
    import jax.numpy as jnp

    text = jax.jit(lambda x, y: low.fn([x, y])).lower(jnp.ones(3), jnp.ones(2)).as_text()
    assert "optimization_barrier" in text


def test_topology_aware_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        torch.tpu.topology_aware_mesh((1,))


def test_collectives_fake_kernels_and_group_of_one():
    """One process: the ops over a world of one (identities), eager and compiled; fake
    kernels' shapes; argument errors; topology_aware_mesh of one rank."""
    dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        x = torch.randn(4, 6)
        io, ss, oo, rs = (torch.tensor([v], dtype=torch.int32) for v in (1, 2, 0, 2))
        out = torch.zeros(3, 6)

        def f(x, out, io, ss, oo, rs):
            return (tops.all_gather_dim(x, 1), tops.reduce_scatter_dim(x, 0, "max"),
                    tops.ragged_all_to_all(x, out, io, ss, oo, rs))

        want = (x, x, torch.cat([x[1:3], out[2:]]))
        args = [t.to("tpu") for t in (x, out, io, ss, oo, rs)]
        for fn in (f, torch.compile(f, backend="tpu", fullgraph=True)):
            for g, w in zip(fn(*args), want):
                assert g.device.type == "tpu"
                torch.testing.assert_close(g.cpu(), w)
        from torch._subclasses.fake_tensor import FakeTensorMode

        name = tops.collectives.group_name(None)
        with FakeTensorMode():
            fx = torch.empty(4, 6)
            assert torch.ops.tpu.all_gather_dim(fx, -1, name).shape == (4, 6)
            assert torch.ops.tpu.reduce_scatter_dim(fx, 1, "sum", name).shape == (4, 6)
        with pytest.raises(ValueError, match="unsupported reduce_op 'bor'"):
            tops.reduce_scatter_dim(args[0], 0, "bor")
        with pytest.raises(IndexError, match="all_gather_dim: dim 2 is out of range"):
            tops.all_gather_dim(args[0], 2)
        m = torch.tpu.topology_aware_mesh(1, ["dp"])
        assert m.mesh.tolist() == [0] and m.mesh_dim_names == ("dp",)
        with pytest.raises(RuntimeError, match="ragged_all_to_all: rows"):
            tops.ragged_all_to_all(args[0], args[1], args[2], args[3], args[2] + 5, args[5])
    finally:
        dist.destroy_process_group()


def test_collective_ops_two_ranks():
    """Strict, Fused and compiled (forward, and backward through aot_autograd) on 2 ranks of
    tpu_dist, each against the definition run with ordinary collectives on CPU/gloo; send/recv
    eager and in compiled graphs that differ between the ranks (MPMD)."""
    ok(*torchrun("tpu_ops_check.py", timeout=400))
