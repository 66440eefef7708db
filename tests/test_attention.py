"""Attention at lengths that take the blockwise (flash-style) lowering, against PyTorch on CPU.

``F.scaled_dot_product_attention`` on "tpu" reaches the fused op; above
``attention.DENSE_MAX_ELEMENTS`` score elements its lowering is the online-softmax kernel of
``lowering/flash.py`` (forward and backward, tiles of query x key blocks). The shapes here are
chosen to cross that threshold with ragged lengths (padding of the last blocks), and every case
compares the output and the gradients with CPU's. The memory claim is checked on the compiled
program itself: XLA's buffer assignment for a 16k-token forward+backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchtpu.lowering import attention

SDPA = F.scaled_dot_product_attention
TOL = dict(rtol=2e-5, atol=2e-5)


def _r(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _compare(fn, *inputs, grad_of=None):
    """fn on CPU and on tpu: outputs and the gradients of every float input (or ``grad_of``)."""
    grad_of = range(len(inputs)) if grad_of is None else grad_of
    res = {}
    for dev in ("cpu", "tpu"):
        xs = [x.to(dev) for x in inputs]
        for i in grad_of:
            xs[i].requires_grad_()
        out = fn(*xs)
        w = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dev)
        grads = torch.autograd.grad((out * w).sum(), [xs[i] for i in grad_of])
        res[dev] = [out.detach().cpu()] + [g.cpu() for g in grads]
    for got, want in zip(res["tpu"], res["cpu"]):
        torch.testing.assert_close(got, want, **TOL)


B, H, L, S, E = 1, 2, 1500, 2900, 16  # 8.7M scores: blockwise; neither length a whole block
Q, K, V = _r(B, H, L, E, seed=1), _r(B, H, S, E, seed=2), _r(B, H, S, E, seed=3)
QS = _r(B, H, S, E, seed=4)  # self-attention length (causal)


def test_shapes_take_the_blockwise_path():
    for q in (Q, QS):
        assert attention.use_blocked(np.zeros(q.shape), np.zeros(K.shape), np.zeros(V.shape),
                                     None)
    small = np.zeros((2, 4, 64, 16))
    assert not attention.use_blocked(small, small, small, None)


CASES = {
    "plain": (lambda q, k, v: SDPA(q, k, v), (Q, K, V)),
    "causal_self": (lambda q, k, v: SDPA(q, k, v, is_causal=True), (QS, K, V)),
    "causal_scale_rect": (lambda q, k, v: SDPA(q, k, v, is_causal=True, scale=0.2), (Q, K, V)),
    "gqa_causal": (lambda q, k, v: SDPA(q, k, v, is_causal=True, enable_gqa=True),
                   (_r(B, 4, S, E, seed=5), K, V)),
    "3d": (lambda q, k, v: SDPA(q, k, v, is_causal=True), (QS[0], K[0], V[0])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_sdpa_matches_cpu(case):
    fn, inputs = CASES[case]
    _compare(fn, *inputs)


def test_blockwise_bool_mask_with_fully_masked_rows():
    # a sliding-window mask as a (L, S) bool tensor, and rows that see nothing (zeros on
    # CPU's fused path too)
    i = torch.arange(L).view(-1, 1) * 2
    j = torch.arange(S).view(1, -1)
    m = (j <= i) & (j > i - 300)
    m[7] = False
    m[1200:1210] = False
    _compare(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m), Q, K, V, m, grad_of=(0, 1, 2))


def test_blockwise_additive_masks_and_their_gradients():
    # a per-batch key-padding bias (B, 1, 1, S) and a per-head (H, L, S) bias, both learned
    _compare(lambda q, k, v, b: SDPA(q, k, v, attn_mask=b), Q, K, V, _r(B, 1, 1, S, seed=6))
    _compare(lambda q, k, v, b: SDPA(q, k, v, attn_mask=b), Q, K, V, _r(H, L, S, seed=7))


def test_blockwise_dropout_backward_redraws_the_forward_mask():
    # out = dropout(P) @ v with v = I: out is the dropped, rescaled attention matrix itself, and
    # the gradient of <out, g> w.r.t. v must be out^T g: true only if the backward redraws the
    # forward's keep-mask tile by tile
    n, p = 2100, 0.3
    q, k = _r(1, 2, n, 8, seed=8).to("tpu"), _r(1, 2, n, 8, seed=9).to("tpu")
    assert attention.use_blocked(np.zeros(q.shape), np.zeros(k.shape),
                                 np.zeros((1, 2, n, n)), None)
    v = torch.eye(n).expand(1, 2, n, n).contiguous().to("tpu").requires_grad_()
    torch.manual_seed(0)
    a = SDPA(q, k, v, dropout_p=p, is_causal=True)
    g = _r(1, 2, n, n, seed=10)
    (gv,) = torch.autograd.grad(a, v, g.to("tpu"))
    a = a.detach().cpu()
    torch.testing.assert_close(gv.cpu(), a.transpose(-1, -2) @ g, rtol=1e-4, atol=1e-4)
    kept = a[0, 0].tril() != 0
    frac = kept.sum().item() / (n * (n + 1) / 2)
    assert abs(frac - (1 - p)) < 0.01, frac
    # rows sum to 1 / (1 - p) in expectation; the kept entries are P / (1 - p)
    torch.manual_seed(0)
    torch.testing.assert_close(SDPA(q, k, v, dropout_p=p, is_causal=True).cpu(), a)


def _program_bytes(L, fn):
    q = jax.ShapeDtypeStruct((1, 8, L, 64), jnp.float32)
    c = jax.jit(fn).lower(q, q, q, q).compile()
    m = c.memory_analysis()
    return m.temp_size_in_bytes


def test_blockwise_program_memory_grows_with_length_not_its_square():
    """XLA's own buffer assignment for forward+backward at 16k tokens, 8 heads, head dim 64:
    the dense program would need ~8 GiB of temporaries (two 16k x 16k float32 matrices per head);
    the blockwise one needs a few tiles and O(L*d) buffers."""

    def fwd_bwd(q, k, v, do):
        out, lse, seed = attention.attend(q, k, v, None, True, None)
        return attention.attend_backward(do, q, k, v, out, None, lse, 0.0, True, seed, None)

    t16 = _program_bytes(16384, fwd_bwd)
    t8 = _program_bytes(8192, fwd_bwd)
    assert t16 < 160 * 2 ** 20, t16
    assert t16 < 2.5 * t8, (t8, t16)  # linear, not quadratic
