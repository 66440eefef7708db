"""Ops whose use depends on the torch version (torchtpu supports torch >=2.11,<2.15; CI runs one).

torch 2.14 added ``linalg.matrix_sqrth`` and ``linalg.polar`` to aten, removed
``aten.cholesky``, and routes ``torch.combinations`` through ``nonzero_static``. The lowerings
of the new ops are pure JAX functions, so they are checked here directly on every torch; through
the device (and OpInfo) where the installed torch has the op.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchtpu.lowering import attention, indexing, linalg

TPU = "tpu"


def _spd(n, batch=(), seed=0):
    g = np.random.default_rng(seed)
    a = g.standard_normal(batch + (n, n))
    return a @ np.swapaxes(a, -1, -2) + n * np.eye(n)


def test_matrix_sqrth_lowering_squares_back():
    a = _spd(4, (3,))
    x = np.asarray(linalg.linalg_matrix_sqrth(a))
    np.testing.assert_allclose(x @ x, a, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(x, np.swapaxes(x, -1, -2), atol=1e-12)  # symmetric
    assert (np.linalg.eigvalsh(x) > 0).all()  # the principal (positive-definite) root


def test_polar_lowering_factors():
    a = np.random.default_rng(1).standard_normal((2, 5, 3))
    u, h = (np.asarray(t) for t in linalg.linalg_polar(a))
    np.testing.assert_allclose(u @ h, a, atol=1e-12)
    np.testing.assert_allclose(np.swapaxes(u, -1, -2) @ u, np.broadcast_to(np.eye(3), (2, 3, 3)),
                               atol=1e-12)
    assert (np.linalg.eigvalsh(h) >= -1e-12).all()
    with pytest.raises(RuntimeError, match="at least as many rows as columns"):
        linalg.linalg_polar(np.zeros((2, 3)))


@pytest.mark.skipif(not hasattr(torch.ops.aten, "linalg_polar"), reason="torch < 2.14")
def test_new_linalg_ops_on_device():
    a = torch.from_numpy(_spd(4, (2,)))
    torch.testing.assert_close(torch.linalg.matrix_sqrth(a.to(TPU)).cpu(), torch.linalg.matrix_sqrth(a))
    b = torch.randn(3, 4, 2, dtype=torch.float64)
    for got, want in zip(torch.linalg.polar(b.to(TPU)), torch.linalg.polar(b)):
        torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("size", [2, 3, 7])
def test_nonzero_static_pads_and_truncates(size):
    x = torch.tensor([[0, 1, 0], [2, 0, 3]])
    got = torch.nonzero_static(x.to(TPU), size=size, fill_value=-5)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == torch.nonzero_static(x, size=size, fill_value=-5).tolist()
    assert np.asarray(indexing.nonzero_static(np.float32(3), size=size)).shape == (size, 0)


def test_combinations_runs_natively():
    x = torch.arange(5.0)
    got = torch.combinations(x.to(TPU), r=2)
    assert torch.equal(got.cpu(), torch.combinations(x, r=2))


def test_cpu_flash_attention_op_forward_and_backward():
    """Called directly (code written against PyTorch's CPU kernel): logsumexp has the shape
    (B, H, L), and the gradients agree with CPU's kernel to float32 rounding."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, s, 8, generator=g) for s in (4, 6, 6))
    outs = {}
    for dev in ("cpu", TPU):
        leaves = [t.detach().to(dev).requires_grad_() for t in (q, k, v)]
        out, lse = op(*leaves, is_causal=True)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dev))
        outs[dev] = [out.detach().cpu(), lse.detach().cpu()] + [t.grad.cpu() for t in leaves]
    for got, want in zip(outs[TPU], outs["cpu"]):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="dropout > 0"):
        op(q.to(TPU), k.to(TPU), v.to(TPU), 0.5)


def test_attention_output_normalises_after_the_value_product():
    """exp(s - max) / sum keeps the output within a few ulps of float64 (exp(s - logsumexp)
    put the logsumexp's rounding into every probability: 1.5e-5 on this sample)."""
    g = np.random.default_rng(3)
    q, k, v = (g.standard_normal((4, 4, n, 8)).astype(np.float32) for n in (3, 6, 6))
    out32 = np.asarray(attention._attend(q, k, v, None, True, None)[0], np.float64)
    out64 = np.asarray(attention._attend(*(t.astype(np.float64) for t in (q, k, v)),
                                         None, True, None)[0])
    assert np.abs(out32 - out64).max() < 5e-6


def test_only_known_version_dependent_ops_are_missing():
    """Lowering modules name aten ops through a lenient namespace (a missing op would otherwise
    fail ``import torch``); only ops known to come and go between releases may be missing, so
    a misspelt name still fails here."""
    from torchtpu.lowering import registry

    assert registry.MISSING_OPS <= registry.VERSION_DEPENDENT_OPS, registry.MISSING_OPS
    for name in registry.VERSION_DEPENDENT_OPS - registry.MISSING_OPS:
        assert hasattr(torch.ops.aten, name)
    try:
        assert isinstance(registry.aten.no_such_op_anywhere.default, registry._MissingOp)
    finally:
        registry.MISSING_OPS.discard("no_such_op_anywhere")
