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
from jax import lax

from .registry import aten, register


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


def _attend(q, k, v, bias, is_causal, scale, dropout_p=0.0, rng=None):
    """out, the float32 logsumexp of the scores, and the dropout seed (0 without dropout)."""
    acc = _acc(q.dtype)
    hq = q.shape[-3] if q.ndim >= 3 else None
    ke, ve = (_expand_kv(k, hq), _expand_kv(v, hq)) if hq is not None else (k, v)
    s = _scores(q, ke, bias, is_causal, _scale_of(q, scale), acc)
    # softmax as exp(s - max) / sum, not exp(s - logsumexp): the rounding of the logsumexp
    # (several ulps through log and exp) would reach every probability
    # initial: no keys at all (SGLang's dummy extend has zero-length requests) gives zeros
    mx = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    mx = jnp.where(jnp.isfinite(mx), mx, 0)  # fully masked rows
    e = jnp.exp(s - mx)
    tot = jnp.sum(e, axis=-1, keepdims=True)
    lse = jnp.log(tot[..., 0]) + mx[..., 0]
    p = jnp.where(tot > 0, e / jnp.where(tot > 0, tot, 1), 0)
    if dropout_p > 0:
        rkey = jax.random.key_data(rng).reshape(-1)[:2].astype(jnp.uint32)
        rkey = jax.random.wrap_key_data(rkey, impl="threefry2x32")
        p = jnp.where(_keep_mask(rkey, dropout_p, p.shape), p / (1.0 - dropout_p), 0)
        seed = _pack_key(rkey)
    else:
        seed = jnp.zeros((), jnp.int64)
    out = jnp.einsum("...ls,...se->...le", p, ve.astype(acc), precision=_prec(acc)).astype(q.dtype)
    return out, lse.astype(jnp.float32), seed


@register(aten._scaled_dot_product_fused_attention_overrideable.default, random=True)
def sdpa_fused(rng, query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None):
    out, lse, seed = _attend(query, key, value, attn_bias, is_causal, scale, dropout_p, rng)
    L, S = query.shape[-2], key.shape[-2]
    return (out, lse, None, None, L, S, seed, jnp.zeros((), jnp.int64), None)


def _check_cpu_flash(query, dropout_p, attn_mask):
    # PyTorch's CPU flash kernel accepts neither; the op is called directly only by code
    # written against that kernel, so it gets the same errors
    if dropout_p > 0:
        raise RuntimeError("scaled_dot_product_attention_flash_attention: Currently do not "
                           "support dropout > 0")
    if attn_mask is not None and attn_mask.dtype != query.dtype:
        raise RuntimeError("scaled_dot_product_attention_flash_attention: Attention mask is the "
                           "same data type as query")


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                       scale=None):
    _check_cpu_flash(query, dropout_p, attn_mask)
    out, lse, _ = _attend(query, key, value, attn_mask, is_causal, scale)
    return out, lse


def _sum_to(x, shape):
    shape = tuple(shape)
    if x.shape == shape:
        return x
    lead = x.ndim - len(shape)
    if lead:
        x = jnp.sum(x, axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _attend_backward(grad_out, q, k, v, out, bias, logsumexp, dropout_p, is_causal, seed, scale):
    """Gradients of q, k, v and of a float bias (None for a bool mask or no bias)."""
    acc = _acc(q.dtype)
    hq = q.shape[-3] if q.ndim >= 3 else None
    hk = k.shape[-3] if k.ndim >= 3 else None
    ke, ve = (_expand_kv(k, hq), _expand_kv(v, hq)) if hq is not None else (k, v)
    sc = _scale_of(q, scale)
    s = _scores(q, ke, bias, is_causal, sc, acc)
    p = _probs(s, logsumexp.astype(acc))
    do = grad_out.astype(acc)
    if dropout_p > 0:
        keep = _keep_mask(_unpack_key(seed), dropout_p, p.shape)
        pd = jnp.where(keep, p / (1.0 - dropout_p), 0)
    else:
        keep = None
        pd = p
    dv = jnp.einsum("...ls,...le->...se", pd, do, precision=_prec(acc))
    dpd = jnp.einsum("...le,...se->...ls", do, ve.astype(acc), precision=_prec(acc))
    dp = jnp.where(keep, dpd / (1.0 - dropout_p), 0) if keep is not None else dpd
    # sum_s dP*P equals rowsum(dO * O) (flash attention's D): fewer roundings than from dP
    D = jnp.sum(do * out.astype(acc), axis=-1, keepdims=True)
    ds = p * (dp - D)
    dq = jnp.einsum("...ls,...se->...le", ds, ke.astype(acc), precision=_prec(acc)) * sc
    dk = jnp.einsum("...ls,...le->...se", ds, q.astype(acc), precision=_prec(acc)) * sc
    if hk is not None:
        dk, dv = _fold_kv_grad(dk, hk), _fold_kv_grad(dv, v.shape[-3])
    dq, dk, dv = _sum_to(dq, q.shape), _sum_to(dk, k.shape), _sum_to(dv, v.shape)
    gb = None
    if bias is not None and bias.dtype != jnp.bool_:
        gb = _sum_to(ds, bias.shape).astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), gb


@register(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def sdpa_fused_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                        philox_offset, *, scale=None):
    grads = _attend_backward(grad_out, query, key, value, out, attn_bias, logsumexp, dropout_p,
                             is_causal, philox_seed, scale)
    return tuple(g if want else None for g, want in zip(grads, grad_input_mask))


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_flash_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                is_causal, *, attn_mask=None, scale=None):
    _check_cpu_flash(query, dropout_p, attn_mask)
    return _attend_backward(grad_out, query, key, value, out, attn_mask, logsumexp, 0.0, is_causal,
                            None, scale)[:3]


# ---------------------------------------------------------------- nn.MultiheadAttention /
# nn.TransformerEncoderLayer inference fast paths (eval, no grad, batch_first)

def _linear(x, w, b):
    acc = _acc(x.dtype)
    y = jnp.einsum("...i,oi->...o", x.astype(acc), w.astype(acc), precision=_prec(acc))
    return (y + b.astype(acc)) if b is not None else y


def _mha_mask(mask, mask_type, B, H, L, S):
    """PyTorch's native MHA converts any mask to bool (True = masked out)."""
    if mask is None:
        return None
    m = mask if mask.dtype == jnp.bool_ else (mask != 0)
    if mask_type == 1 or (mask_type is None and m.ndim == 2 and m.shape == (B, S) and (L, S) != (B, S)):
        return m.reshape(B, 1, 1, S)
    return m


def _native_mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                proj_bias, mask, need_weights, average_attn_weights, mask_type):
    acc = _acc(query.dtype)
    B, L, D = query.shape
    S = key.shape[1]
    dh = embed_dim // num_head
    wq, wk, wv = jnp.split(qkv_weight, 3, axis=0)
    bq, bk, bv = jnp.split(qkv_bias, 3, axis=0) if qkv_bias is not None else (None, None, None)
    q = _linear(query, wq, bq).reshape(B, L, num_head, dh).transpose(0, 2, 1, 3) / math.sqrt(dh)
    k = _linear(key, wk, bk).reshape(B, S, num_head, dh).transpose(0, 2, 1, 3)
    v = _linear(value, wv, bv).reshape(B, S, num_head, dh).transpose(0, 2, 1, 3)
    s = jnp.einsum("bhld,bhsd->bhls", q, k, precision=_prec(acc))
    m = _mha_mask(mask, mask_type, B, num_head, L, S)
    if m is not None:
        s = jnp.where(m, -jnp.inf, s)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = _probs(s, lse)  # fully masked rows: zeros
    o = jnp.einsum("bhls,bhsd->bhld", p, v, precision=_prec(acc))
    o = o.transpose(0, 2, 1, 3).reshape(B, L, embed_dim)
    out = _linear(o, proj_weight, proj_bias).astype(query.dtype)
    if not need_weights:
        return out, None
    w = jnp.mean(p, axis=1) if average_attn_weights else p
    return out, w.astype(query.dtype)


@register(aten._native_multi_head_attention.default)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                                proj_weight, proj_bias, mask=None, need_weights=True,
                                average_attn_weights=True, mask_type=None):
    return _native_mha(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                       proj_bias, mask, need_weights, average_attn_weights, mask_type)


def _layer_norm(x, w, b, eps):
    acc = _acc(x.dtype)
    xf = x.astype(acc)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + eps)
    if w is not None:
        y = y * w.astype(acc)
    if b is not None:
        y = y + b.astype(acc)
    return y.astype(x.dtype)


@register(aten._transformer_encoder_layer_fwd.default)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                  proj_bias, use_gelu, norm_first, eps, norm_weight_1, norm_bias_1,
                                  norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                                  ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    x = src
    if norm_first:
        x = _layer_norm(x, norm_weight_1, norm_bias_1, eps)
    x = _native_mha(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                    mask, False, True, mask_type)[0]
    x = x + src
    if not norm_first:
        x = _layer_norm(x, norm_weight_1, norm_bias_1, eps)
    res = x
    if norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    h = _linear(x, ffn_weight_1, ffn_bias_1)
    h = jax.nn.gelu(h, approximate=False) if use_gelu else jnp.maximum(h, 0)
    x = (_linear(h.astype(src.dtype), ffn_weight_2, ffn_bias_2).astype(src.dtype)) + res
    if not norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    return x
