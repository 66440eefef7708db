"""FlexAttention's higher-order ops (``flex_attention``, ``flex_attention_backward``) as pure JAX.

``torch.compile`` of ``flex_attention`` hands the backend a ``flex_attention`` HOP node (and,
under autograd, a ``flex_attention_backward`` one) whose ``score_mod`` / ``mask_mod`` are FX
subgraphs on 0-d tensors. This is the math of PyTorch's own reference implementation
(``torch/_higher_order_ops/flex_attention.py``: ``math_attention``, ``sdpa_dense_backward``),
which eager FlexAttention runs on any device: dense scores in float32 (float64 for float64
inputs), the subgraphs vectorised over (batch, head, query, key) with nested ``jax.vmap`` in
the order PyTorch's ``_vmap_for_bhqkv`` uses, masked entries -inf, a safe softmax (fully masked
rows give zeros), the logsumexp and max returned in base 2 as the HOP's contract says. The block
mask's sparse block tables only let a fused kernel skip work: the dense math evaluates
``mask_mod`` everywhere, as the reference does. XLA fuses the score computation into one
program; nothing is blocked or tiled (memory is O(L*S) per head, like the reference).

Not supported (a clear error, never a wrong value): gradients with respect to tensors captured
by ``score_mod`` (learned biases), and subgraph ops without a lowering.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .hops import LN2, placeholder_dtypes, register_hop, run_subgraph
from .linalg import _matmul

_hop = torch.ops.higher_order

_DIMS = ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
         (0, None, None, None))


def _vmap_bhqkv(fn, n_prefix, suffix_axes=()):
    """``_vmap_for_bhqkv``: ``n_prefix`` leading arguments batched on every level, then
    (b, h, q, kv), then arguments with the given axes."""
    for d in _DIMS:
        fn = jax.vmap(fn, in_axes=(0,) * n_prefix + d + tuple(suffix_axes))
    return fn


def _indices(shape, gm, first):
    """arange over (B, H, L, S) in the dtypes of the subgraph's index inputs."""
    dts = placeholder_dtypes(gm)[first:first + 4]
    dts += [np.dtype(np.int32)] * (4 - len(dts))
    return [jnp.arange(n, dtype=dt) for n, dt in zip(shape, dts)]


def _wp(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _expand_kv(query, key, value):
    g = query.shape[1] // key.shape[1]
    bq, bkv = query.shape[0], key.shape[0]
    if not (bq == bkv or (bq > 1 and bkv == 1)):
        raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={bq} and Bkv={bkv}")
    key = jnp.broadcast_to(key, (bq,) + key.shape[1:])
    value = jnp.broadcast_to(value, (bq,) + value.shape[1:])
    return jnp.repeat(key, g, axis=1), jnp.repeat(value, g, axis=1), g


def _mask_fn(block_mask, mask_bufs):
    mask_gm = block_mask[-1]

    def f(b, h, m, n, *bufs):
        return jnp.asarray(run_subgraph(mask_gm, b, h, m, n, *bufs), jnp.bool_)

    return mask_gm, _vmap_bhqkv(f, 0, (None,) * len(mask_bufs))


def _inner(query, key, score_gm, block_mask, scale, score_bufs, mask_bufs):
    """(scores, post_mod_scores, mask) as ``_math_attention_inner`` computes them."""
    wp = _wp(query.dtype)
    scores = _matmul(query.astype(wp), jnp.swapaxes(key.astype(wp), -2, -1))
    scores = (scores * scale).astype(wp)
    b, h, m, n = _indices(scores.shape, score_gm, 1)

    def smod(s, b_, h_, m_, n_, *bufs):
        return jnp.asarray(run_subgraph(score_gm, s, b_, h_, m_, n_, *bufs)).astype(wp)

    score_fn = _vmap_bhqkv(smod, 1, (None,) * len(score_bufs))
    mask_gm, mask_fn = _mask_fn(block_mask, mask_bufs)
    mb, mh, mm, mn = _indices(scores.shape, mask_gm, 0)
    mask = mask_fn(mb, mh, mm, mn, *mask_bufs)
    post = jnp.where(mask, score_fn(scores, b, h, m, n, *score_bufs), jnp.asarray(-jnp.inf, wp))
    return scores, post, mask


@register_hop(_hop.flex_attention)
def flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                   score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """-> (out, logsumexp / ln 2, max / ln 2), as PyTorch's ``math_attention``."""
    key, value, _ = _expand_kv(query, key, value)
    _, post, _ = _inner(query, key, score_mod, block_mask, scale,
                        tuple(score_mod_other_buffers), tuple(mask_mod_other_buffers))
    masked_rows = jnp.all(post == -jnp.inf, axis=-1)
    mx = jnp.max(post, axis=-1)
    safe_mx = jnp.where(masked_rows, 0, mx)
    e = jnp.exp(post - safe_mx[..., None])
    ssum = jnp.sum(e, axis=-1)
    lse = jnp.where(masked_rows, -jnp.inf, jnp.log(ssum) + safe_mx)
    probs = jnp.where(masked_rows[..., None], 0, e / jnp.where(masked_rows, 1, ssum)[..., None])
    out = _matmul(probs.astype(query.dtype), value.astype(query.dtype))
    return out, lse / LN2, mx / LN2


@register_hop(_hop.flex_attention_backward)
def flex_attention_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                            fw_graph, joint_graph, block_mask, scale, kernel_options,
                            score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """-> (dq, dk, dv, grads of score_mod's captured tensors), as ``sdpa_dense_backward``."""
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"Backward pass with mixed query, key, and value dtype is not supported, "
            f"got query.dtype={query.dtype}, key.dtype={key.dtype}, "
            f"and value.dtype={value.dtype}")
    if joint_graph is None:
        raise NotImplementedError("flex_attention_backward on 'tpu' needs the joint graph")
    score_bufs = tuple(score_mod_other_buffers)
    mask_bufs = tuple(mask_mod_other_buffers)
    bkv, hkv = key.shape[0], key.shape[1]
    key_e, value_e, g = _expand_kv(query, key, value)
    if grad_out is None:
        grad_out = jnp.zeros_like(out)
    if grad_logsumexp is None:
        grad_logsumexp = jnp.zeros_like(logsumexp)
    logsumexp = logsumexp * LN2
    grad_logsumexp = grad_logsumexp / LN2
    scores, post, mask = _inner(query, key_e, fw_graph, block_mask, scale, score_bufs, mask_bufs)
    masked_rows = logsumexp == -jnp.inf
    sm = jnp.exp(post - logsumexp[..., None])
    sm = jnp.where(masked_rows[..., None], 0, sm)
    wp = sm.dtype
    grad_value = _matmul(jnp.swapaxes(sm.astype(query.dtype), -2, -1), grad_out)
    grad_sm = _matmul(grad_out.astype(wp), jnp.swapaxes(value_e.astype(wp), -2, -1))
    sum_scores = jnp.sum(out.astype(wp) * grad_out.astype(wp), -1, keepdims=True)
    grad_score_mod = sm * (grad_sm - sum_scores + grad_logsumexp[..., None])

    def joint(s, b_, h_, m_, n_, gs, *bufs):
        res = run_subgraph(joint_graph, s, b_, h_, m_, n_, gs, *bufs)
        if any(r is not None for r in res[5:]):
            raise NotImplementedError(
                "flex_attention on 'tpu': gradients with respect to tensors captured by "
                "score_mod are not supported by the tpu compiler yet")
        return jnp.asarray(res[0]).astype(wp)

    b, h, m, n = _indices(scores.shape, joint_graph, 1)
    grad_scores = _vmap_bhqkv(joint, 1, (0,) + (None,) * len(score_bufs))(
        scores, b, h, m, n, grad_score_mod, *score_bufs)
    grad_scores = (grad_scores * scale).astype(query.dtype)
    grad_scores = jnp.where(mask, grad_scores, jnp.zeros((), query.dtype))
    grad_query = _matmul(grad_scores, key_e)
    grad_key = _matmul(jnp.swapaxes(grad_scores, -2, -1), query)
    grad_key = jnp.sum(grad_key.reshape(grad_key.shape[0], -1, g, *grad_key.shape[-2:]), 2)
    grad_value = jnp.sum(grad_value.reshape(grad_value.shape[0], -1, g,
                                            *grad_value.shape[-2:]), 2)
    if grad_key.shape[0] != bkv:  # keys broadcast over the batch
        grad_key = jnp.sum(grad_key, 0, keepdims=True)
        grad_value = jnp.sum(grad_value, 0, keepdims=True)
    assert grad_key.shape[1] == hkv
    return grad_query, grad_key, grad_value, tuple(None for _ in score_bufs)
