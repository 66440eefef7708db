"""``aten._unsafe_view`` in eager is PyTorch's own metadata kernel, as on CPU: no program.

matmul (and reshape of a non-contiguous tensor) ends in ``_unsafe_view``; HF generate ran it as
an XLA program 480 times per call. Its result aliases the input's storage (same data pointer,
writes through either are seen by the other), it is not a view for autograd (``_base`` None),
and gradients flow through it: each checked against CPU, in Strict and Fused modes.
"""
from __future__ import annotations

import pytest
import torch

aten = torch.ops.aten
MODES = {"strict": torch.tpu.EagerMode.DEFER_NEVER, "fused": torch.tpu.EagerMode.DEFER_AND_FUSE}


def _programs():
    c = torch.tpu.metrics()["counters"]
    return c.get("eager_cache_hits", 0) + c.get("eager_cache_misses", 0)


def _run(device):
    x = torch.arange(12.0, device=device).reshape(3, 4).requires_grad_()
    y = x * 2
    z = aten._unsafe_view(y, [4, 3])
    facts = {
        "same_data_ptr": z.data_ptr() == y.data_ptr(),
        "same_storage": z.untyped_storage().data_ptr() == y.untyped_storage().data_ptr(),
        "base_is_none": z._base is None,
        "is_view": z._is_view(),
        "shape": tuple(z.shape),
        "stride": z.stride(),
    }
    w = torch.arange(12.0, device=device).reshape(4, 3)
    (z * w).sum().backward()
    with torch.no_grad():
        z[0, 0] = 100.0  # a write through the result is seen by its input
        y[2, 3] = -5.0  # and a write to the input by the result
    return facts, x.grad.cpu(), y.detach().cpu(), z.detach().cpu()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_unsafe_view_aliases_like_cpu(mode):
    expect = _run("cpu")
    with torch.tpu.set_eager_mode(MODES[mode]):
        got = _run("tpu")
        torch.tpu.synchronize()
    assert got[0] == expect[0]
    for g, e in zip(got[1:], expect[1:]):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_unsafe_view_runs_no_program():
    a = torch.randn(2, 3, 4, device="tpu")
    torch.tpu.synchronize()
    torch.tpu.reset_metrics()
    out = aten._unsafe_view(a, [6, 4])
    assert _programs() == 0
    assert out.data_ptr() == a.data_ptr()
    b = torch.randn(4, 5, device="tpu")
    torch.tpu.reset_metrics()
    c = a @ b  # matmul: a reshape (a view), mm, _unsafe_view of mm's result
    assert _programs() == 1, torch.tpu.metrics()["per_op"]
    torch.testing.assert_close(c.cpu(), a.cpu() @ b.cpu())


def test_unsafe_view_of_a_non_contiguous_tensor_matches_cpu():
    """reshape of a transpose: a copy (a program), then its _unsafe_view; the result owns new
    storage, as on CPU."""
    base = torch.randn(4, 6)
    for dev in ("cpu", "tpu"):
        t = base.to(dev).t()
        r = t.reshape(24)
        assert r.data_ptr() != t.data_ptr()
        r[0] = 7.0
        assert t.cpu()[0, 0].item() == base[0, 0].item()  # the base is untouched
    torch.testing.assert_close(base.to("tpu").t().reshape(3, 8).cpu(), base.t().reshape(3, 8))
