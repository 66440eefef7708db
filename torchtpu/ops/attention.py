"""Attention kernels as torch ops: ``torch.tpu.ops.splash_sdpa``.

``splash_sdpa(query, key, value, *, is_causal=False, scale=None, q_segment_ids=None,
kv_segment_ids=None, window=None)`` is TorchTPU's name for splash attention: scaled
dot-product attention whose mask is described, not materialised — causal, a local window
(``window=(left, right)``: query i sees keys i - left .. i + right; ``None`` for an unbounded
side), and segment ids (packed documents: a query sees the keys of its own segment). Grouped
query attention: ``query`` may have a multiple of ``key``'s heads. Shapes: query
``(B, Hq, L, E)``, key ``(B, Hk, S, E)``, value ``(B, Hk, S, Ev)``, segment ids ``(B, L)`` and
``(B, S)``. A query with no visible key gets zeros (as PyTorch's fused SDPA).

Two torch ops in the ``tpu`` namespace carry it: ``tpu::splash_sdpa_forward`` (out, logsumexp)
and ``tpu::splash_sdpa_backward``; autograd connects them. Their lowerings
(``lowering/attention.py``: Pallas splash on TPU, the Pallas GPU kernel where it applies, the
blockwise ``flash.py`` kernel elsewhere, memory O(L*d) per head) are in the one table, so the
ops run in Strict, Fused and compiled mode on "tpu" without a CPU fallback. On CPU tensors a
dense PyTorch reference runs (the same math, O(L*S) memory).
"""
from __future__ import annotations

import math

import torch

from ..lowering import attention as _lowering
from ..lowering import registry
from ..lowering.registry import register

__all__ = ["splash_sdpa"]

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define(
    "splash_sdpa_forward(Tensor query, Tensor key, Tensor value, Tensor? q_segment_ids=None, "
    "Tensor? kv_segment_ids=None, bool is_causal=False, float? scale=None, "
    "int? window_left=None, int? window_right=None) -> (Tensor, Tensor)")
_lib.define(
    "splash_sdpa_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, Tensor? q_segment_ids=None, Tensor? kv_segment_ids=None, "
    "bool is_causal=False, float? scale=None, int? window_left=None, int? window_right=None) "
    "-> (Tensor, Tensor, Tensor)")

_fwd = torch.ops.tpu.splash_sdpa_forward.default
_bwd = torch.ops.tpu.splash_sdpa_backward.default


def _check(query, key, value, q_seg, kv_seg):
    # the lowering's checks read only shapes and dtypes: torch tensors answer them too
    _lowering._splash_checks(query, key, value, q_seg, kv_seg)


def visible(L, S, device, q_seg=None, kv_seg=None, is_causal=False, window_left=None,
            window_right=None):
    """The (B or 1, 1, L, S) boolean mask the op describes (True: the key is visible)."""
    i = torch.arange(L, device=device).view(-1, 1)
    j = torch.arange(S, device=device).view(1, -1)
    m = torch.ones(L, S, dtype=torch.bool, device=device)
    if is_causal:
        m = m & (j <= i)
    if window_left is not None:
        m = m & (j >= i - window_left)
    if window_right is not None:
        m = m & (j <= i + window_right)
    m = m.view(1, 1, L, S)
    if q_seg is not None:
        m = m & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    return m


def _reference_forward(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                       is_causal=False, scale=None, window_left=None, window_right=None):
    """Dense PyTorch math (CPU tensors): scores in float32 or float64."""
    _check(query, key, value, q_segment_ids, kv_segment_ids)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, 1).to(acc)
    v = value.repeat_interleave(g, 1).to(acc)
    sc = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    s = (query.to(acc) @ k.transpose(-2, -1)) * sc
    m = visible(query.shape[2], key.shape[2], query.device, q_segment_ids, kv_segment_ids,
                is_causal, window_left, window_right)
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None].nan_to_num(
        neginf=0.0)), torch.zeros((), dtype=acc))
    return (p @ v).to(query.dtype), lse.to(torch.float32)


def _reference_backward(grad_out, query, key, value, out, logsumexp, q_segment_ids=None,
                        kv_segment_ids=None, is_causal=False, scale=None, window_left=None,
                        window_right=None):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (query, key, value)]
        o, _ = _reference_forward(*leaves, q_segment_ids, kv_segment_ids, is_causal, scale,
                                  window_left, window_right)
        return tuple(torch.autograd.grad(o, leaves, grad_out))


_lib.impl("splash_sdpa_forward", _reference_forward, "CPU")
_lib.impl("splash_sdpa_backward", _reference_backward, "CPU")


@torch.library.register_fake("tpu::splash_sdpa_forward")
def _fake_forward(query, key, value, q_segment_ids=None, kv_segment_ids=None, is_causal=False,
                  scale=None, window_left=None, window_right=None):
    _check(query, key, value, q_segment_ids, kv_segment_ids)
    out = query.new_empty(query.shape[:-1] + value.shape[-1:])
    return out, query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("tpu::splash_sdpa_backward")
def _fake_backward(grad_out, query, key, value, out, logsumexp, q_segment_ids=None,
                   kv_segment_ids=None, is_causal=False, scale=None, window_left=None,
                   window_right=None):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, q_seg, kv_seg, is_causal, scale, wl, wr = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, q_seg, kv_seg)
    ctx.static = (is_causal, scale, wl, wr)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, q_seg, kv_seg = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 9
    dq, dk, dv = _bwd(grad_out.contiguous(), query, key, value, out, lse, q_seg, kv_seg,
                      *ctx.static)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("tpu::splash_sdpa_forward", _backward,
                                setup_context=_setup_context)

register(_fwd, reads_precision=True)(_lowering.splash_sdpa_forward)
register(_bwd, reads_precision=True)(_lowering.splash_sdpa_backward)
# the gradients are laid out like their inputs (the fake kernel's empty_like), in eager too
registry.get(_bwd).meta["eager_layout"] = lambda args, kwargs, res: tuple(
    _lowering._like_layout(g, a) for g, a in zip(res, args[1:4]))


def _bind_if_late() -> None:
    """The device binds the table when it registers; a module imported after that binds its
    own lowerings."""
    from ..device import registration
    from ..eager import kernels
    from ..lowering import registry

    if registration._done[0]:
        for op in (_fwd, _bwd):
            kernels.bind_lowering(registry.get(op))


_bind_if_late()


def splash_sdpa(query, key, value, *, is_causal: bool = False, scale: float | None = None,
                q_segment_ids=None, kv_segment_ids=None, window=None):
    """Scaled dot-product attention with a described mask (see the module docstring)."""
    wl, wr = (None, None) if window is None else window
    out, _ = _fwd(query, key, value, q_segment_ids, kv_segment_ids, is_causal, scale, wl, wr)
    return out
