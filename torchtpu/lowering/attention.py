"""Attention lowerings: the fused scaled-dot-product attention op and its backward.

``F.scaled_dot_product_attention`` on "tpu" reaches
``_scaled_dot_product_fused_attention_overrideable`` (see eager/kernels.py: PyTorch chooses the
SDPA backend through a C++ DispatchStub that a Python backend cannot register, so a small
routing kernel sends SDPA here). One XLA program computes scores, mask, softmax, dropout and
the value product; the backward recomputes the probabilities from the saved logsumexp.

Dropout: the op is ``random``; the key's two 32-bit words are returned packed in
``philox_seed`` (int64), so the backward regenerates exactly the same keep-mask.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .registry import register

aten = torch.ops.aten


def _acc(dtype):
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _prec(dtype):
    return lax.Precision.HIGHEST if dtype in (jnp.float32, jnp.float64) else None


def _expand_kv(x, hq):
    """Grouped-query attention: repeat key/value heads (dim -3) to the query's head count."""
    if x.ndim < 3 or x.shape[-3] == hq:
        return x
    return jnp.repeat(x, hq // x.shape[-3], axis=-3)


def _fold_kv_grad(g, hk):
    if g.ndim < 3 or g.shape[-3] == hk:
        return g
    shp = g.shape
    return jnp.sum(g.reshape(shp[:-3] + (hk, shp[-3] // hk) + shp[-2:]), axis=-3)


def _scores(q, k, bias, is_causal, scale, acc):
    s = jnp.einsum("...le,...se->...ls", q.astype(acc), k.astype(acc), precision=_prec(acc)) * scale
    L, S = s.shape[-2], s.shape[-1]
    if is_causal:
        causal = jnp.tril(jnp.ones((L, S), dtype=bool))
        s = jnp.where(causal, s, -jnp.inf)
    if bias is not None:
        if bias.dtype == jnp.bool_:
            s = jnp.where(bias, s, -jnp.inf)
        else:
            s = s + bias.astype(acc)
    return s


def _probs(s, lse):
    # fully masked rows (lse = -inf) give zeros, as PyTorch's _safe_softmax
    finite = jnp.isfinite(lse)[..., None]
    return jnp.where(finite, jnp.exp(s - jnp.where(finite, lse[..., None], 0)), 0)


def _pack_key(key):
    d = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    return (d[0].astype(jnp.int64) | (d[1].astype(jnp.int64) << 32))


def _unpack_key(seed):
    s = seed.astype(jnp.int64)
    lo = (s & 0xFFFFFFFF).astype(jnp.uint32)
    hi = ((s >> 32) & 0xFFFFFFFF).astype(jnp.uint32)
    return jax.random.wrap_key_data(jnp.stack([lo, hi]), impl="threefry2x32")


def _keep_mask(key, dropout_p, shape):
    return jax.random.bernoulli(key, 1.0 - dropout_p, shape)


def _scale_of(q, scale):
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


@register(aten._scaled_dot_product_fused_attention_overrideable.default, random=True)
def sdpa_fused(rng, query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None):
    q, k, v = query, key, value
    acc = _acc(q.dtype)
    hq = q.shape[-3] if q.ndim >= 3 else None
    ke, ve = (_expand_kv(k, hq), _expand_kv(v, hq)) if hq is not None else (k, v)
    s = _scores(q, ke, attn_bias, is_causal, _scale_of(q, scale), acc)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = _probs(s, lse)
    if dropout_p > 0:
        rkey = jax.random.key_data(rng).reshape(-1)[:2].astype(jnp.uint32)
        rkey = jax.random.wrap_key_data(rkey, impl="threefry2x32")
        p = jnp.where(_keep_mask(rkey, dropout_p, p.shape), p / (1.0 - dropout_p), 0)
        seed = _pack_key(rkey)
    else:
        seed = jnp.zeros((), jnp.int64)
    out = jnp.einsum("...ls,...se->...le", p, ve.astype(acc), precision=_prec(acc)).astype(q.dtype)
    L, S = q.shape[-2], k.shape[-2]
    return (out, lse.astype(jnp.float32), None, None, L, S, seed, jnp.zeros((), jnp.int64), None)


def _sum_to(x, shape):
    shape = tuple(shape)
    if x.shape == shape:
        return x
    lead = x.ndim - len(shape)
    if lead:
        x = jnp.sum(x, axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@register(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def sdpa_fused_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                        philox_offset, *, scale=None):
    q, k, v = query, key, value
    acc = _acc(q.dtype)
    hq = q.shape[-3] if q.ndim >= 3 else None
    hk = k.shape[-3] if k.ndim >= 3 else None
    ke, ve = (_expand_kv(k, hq), _expand_kv(v, hq)) if hq is not None else (k, v)
    sc = _scale_of(q, scale)
    s = _scores(q, ke, attn_bias, is_causal, sc, acc)
    p = _probs(s, logsumexp.astype(acc))
    do = grad_out.astype(acc)
    if dropout_p > 0:
        keep = _keep_mask(_unpack_key(philox_seed), dropout_p, p.shape)
        pd = jnp.where(keep, p / (1.0 - dropout_p), 0)
    else:
        keep = None
        pd = p
    dv = jnp.einsum("...ls,...le->...se", pd, do, precision=_prec(acc))
    dpd = jnp.einsum("...le,...se->...ls", do, ve.astype(acc), precision=_prec(acc))
    dp = jnp.where(keep, dpd / (1.0 - dropout_p), 0) if keep is not None else dpd
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True))
    dq = jnp.einsum("...ls,...se->...le", ds, ke.astype(acc), precision=_prec(acc)) * sc
    dk = jnp.einsum("...ls,...le->...se", ds, q.astype(acc), precision=_prec(acc)) * sc
    if hk is not None:
        dk, dv = _fold_kv_grad(dk, hk), _fold_kv_grad(dv, v.shape[-3])
    dq, dk, dv = _sum_to(dq, q.shape), _sum_to(dk, k.shape), _sum_to(dv, v.shape)
    gq = dq.astype(q.dtype) if grad_input_mask[0] else None
    gk = dk.astype(k.dtype) if grad_input_mask[1] else None
    gv = dv.astype(v.dtype) if grad_input_mask[2] else None
    gb = None
    if grad_input_mask[3] and attn_bias is not None and attn_bias.dtype != jnp.bool_:
        gb = _sum_to(ds, attn_bias.shape).astype(attn_bias.dtype)
    return gq, gk, gv, gb
