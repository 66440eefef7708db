"""The attention kernels JAX ships, in the layout of ``flash.py``, forward and backward.

- TPU: Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``), its
  multi-query form vmapped over (batch, key head), so grouped-query attention shares keys
  without repeating them; causal, local-window and segment-id (document) masks.
- GPU: the Pallas/Triton flash attention kernel (``jax.experimental.pallas.ops.gpu.attention``),
  keys repeated to the query heads; causal and segment-id masks.

Both take the forward's logsumexp back in the backward (splash's ``_splash_attention_bwd``,
the GPU kernel's ``_mha_backward``), so a backward does not recompute the forward, and both
run in Pallas interpret mode on any platform (``interpret=True``), which is how the tests run
them on XLA:CPU against ``flash.py``.

``choose`` decides, from the platform, shapes, dtype and features, whether a kernel applies:
each masks with a large finite value, which equals PyTorch's -inf semantics only when no row
is fully masked (so no additive or boolean masks, whose rows may be empty); neither does
dropout; and each multiplies float32 inputs at the MXU's / tensor cores' reduced default
precision, so float32 takes them only when the matmul precision asks for less than "highest".
Everything else runs ``flash.py`` (compiled by XLA for the same device).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

LN2 = math.log(2.0)
# Run the Pallas kernels in interpret mode (tests on XLA:CPU set it; never needed on TPU/GPU)
INTERPRET = False
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def choose(platform: str, dtype, L: int, S: int, E: int, Ev: int, *, has_mask: bool,
           dropout_p: float, precision: str) -> str | None:
    """"splash" (TPU), "pallas_gpu", or None (flash.py)."""
    if has_mask or dropout_p > 0 or E != Ev:
        return None
    dt = np.dtype(dtype)
    half = dt in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
    if not (half or (dt == np.dtype(jnp.float32) and precision != "highest")):
        return None
    if platform == "tpu":
        if dt == np.dtype(jnp.float16) or L % 128 or S % 128:
            return None
        return "splash"
    if platform in GPU_PLATFORMS:
        # the fused backward needs as many query as key blocks
        if L != S or L % 64 or E > 256:
            return None
        return "pallas_gpu"
    return None


# ---------------------------------------------------------------- TPU: splash attention

def _splash_block(n: int) -> int:
    for b in (512, 256, 128):
        if n % b == 0:
            return b
    raise ValueError(f"splash attention needs lengths divisible by 128, got {n}")


@functools.lru_cache(maxsize=64)
def _splash_kernel(G: int, L: int, S: int, causal: bool, window, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if window is not None:
        left, right = window
        one = sm.LocalMask((L, S), (left, 0 if causal else right), offset=0)
    elif causal:
        one = sm.CausalMask((L, S))
    else:
        one = sm.FullMask((L, S))
    bq, bk = _splash_block(L), _splash_block(S)
    bs = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                       block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    mask = sm.MultiHeadMask([one] * G)
    return sk.make_splash_mqa(mask, head_shards=1, q_seq_shards=1, block_sizes=bs,
                              save_residuals=True, interpret=interpret)


def _segments(seg_q, seg_kv):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    if seg_q is None:
        return None
    return sk.SegmentIds(q=seg_q.astype(jnp.int32), kv=seg_kv.astype(jnp.int32))


def splash_forward(q, k, v, *, scale, causal, window=None, seg_q=None, seg_kv=None,
                   interpret=False):
    """q (B, Hk, G, L, E), k/v (B, Hk, S, E) -> (out like q, natural logsumexp (B, Hk, G, L))."""
    B, Hk, G, L, E = q.shape
    kern = _splash_kernel(G, L, k.shape[2], causal, window, interpret)
    qs = (q * jnp.asarray(scale, q.dtype)).astype(q.dtype)

    def one(qh, kh, vh, sq, skv):
        out, (lse,) = kern(qh, kh, vh, segment_ids=_segments(sq, skv))
        return out, lse

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    if seg_q is None:
        out, lse = jax.vmap(per_head, in_axes=(0, 0, 0, None, None))(qs, k, v, None, None)
    else:
        out, lse = jax.vmap(per_head)(qs, k, v, seg_q, seg_kv)
    return out.astype(q.dtype), lse.astype(jnp.float32)


def _collapse(info):
    if info is None or info.partial_mask_blocks is None:
        return info
    blocks = info.partial_mask_blocks
    return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def splash_backward(do, q, k, v, out, lse, *, scale, causal, window=None, seg_q=None,
                    seg_kv=None, interpret=False):
    """-> (dq, dk, dv), from the forward's output and logsumexp (no recomputed forward)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    B, Hk, G, L, E = q.shape
    kern = _splash_kernel(G, L, k.shape[2], causal, window, interpret)
    kw = kern.kwargs
    dq_info, dkv_info = _collapse(kern.dq_mask_info), _collapse(kern.dkv_mask_info)
    qs = (q * jnp.asarray(scale, q.dtype)).astype(q.dtype)

    def one(qh, kh, vh, oh, lh, doh, sq, skv):
        res = (qh, kh, vh, _segments(sq, skv), None, oh, lh, dq_info, dkv_info)
        grads = sk._splash_attention_bwd(False, kw["mask_value"], kw["is_mqa"],
                                         kw["block_sizes"], None, kw["mask_function"],
                                         kw["attn_logits_soft_cap"], kw["interpret"], res, doh)
        return grads[3], grads[4], grads[5]

    per_head = jax.vmap(one, in_axes=(0,) * 6 + (None, None))
    args = (qs, k, v, out, lse.astype(jnp.float32), do)
    if seg_q is None:
        dq, dk, dv = jax.vmap(per_head, in_axes=(0,) * 6 + (None, None))(*args, None, None)
    else:
        dq, dk, dv = jax.vmap(per_head)(*args, seg_q, seg_kv)
    return (dq.astype(jnp.float32) * scale).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---------------------------------------------------------------- GPU: Pallas/Triton flash

def _gpu_blocks(L: int):
    from jax.experimental.pallas.ops.gpu import attention as ga

    b = 128 if L % 128 == 0 else 64
    return ga.BlockSizes(block_q=b, block_k=b, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32,
                         block_kv_dq=32)


def _to_gpu_layout(q, k, v):
    B, Hk, G, L, E = q.shape
    qg = q.reshape(B, Hk * G, L, E).transpose(0, 2, 1, 3)
    kg = jnp.repeat(k, G, axis=1).transpose(0, 2, 1, 3)
    vg = jnp.repeat(v, G, axis=1).transpose(0, 2, 1, 3)
    return qg, kg, vg


def gpu_forward(q, k, v, *, scale, causal, seg=None, interpret=False):
    """-> (out like q, natural logsumexp (B, Hk, G, L)). ``seg``: (B, L) segment ids shared
    by queries and keys (self-attention)."""
    from jax.experimental.pallas.ops.gpu import attention as ga

    B, Hk, G, L, E = q.shape
    qg, kg, vg = _to_gpu_layout(q, k, v)
    with jax.enable_x64(False):  # the kernel's index arithmetic assumes 32-bit Python ints
        out, lse2 = ga.mha(qg, kg, vg, seg, sm_scale=float(scale), causal=causal,
                           block_sizes=_gpu_blocks(L), interpret=interpret,
                           return_residuals=True)
    out = out.transpose(0, 2, 1, 3).reshape(q.shape[:-1] + (v.shape[-1],))
    return out, (lse2 * LN2).reshape(B, Hk, G, L).astype(jnp.float32)


def gpu_backward(do, q, k, v, out, lse, *, scale, causal, seg=None, interpret=False):
    from jax.experimental.pallas.ops.gpu import attention as ga

    B, Hk, G, L, E = q.shape
    qg, kg, vg = _to_gpu_layout(q, k, v)
    og = out.reshape(B, Hk * G, L, -1).transpose(0, 2, 1, 3)
    dog = do.reshape(B, Hk * G, L, -1).transpose(0, 2, 1, 3)
    lse2 = (lse.astype(jnp.float32) / LN2).reshape(B, Hk * G, L)
    with jax.enable_x64(False):
        dq, dk, dv, _ = ga._mha_backward(float(scale), causal, _gpu_blocks(L), "triton", None,
                                         2, None, interpret, False, False,
                                         (qg, kg, vg, seg, og, lse2), dog)
    dq = dq.transpose(0, 2, 1, 3).reshape(q.shape)
    S = k.shape[2]
    dk = dk.transpose(0, 2, 1, 3).reshape(B, Hk, G, S, -1).sum(2)
    dv = dv.transpose(0, 2, 1, 3).reshape(B, Hk, G, S, -1).sum(2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
