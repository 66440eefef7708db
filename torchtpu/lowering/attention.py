"""Attention lowerings: the fused scaled-dot-product attention op and its backward.

``F.scaled_dot_product_attention`` on "tpu" reaches
``_scaled_dot_product_fused_attention_overrideable`` (see eager/kernels.py: PyTorch chooses the
SDPA backend through a C++ DispatchStub that a Python backend cannot register, so a small
routing kernel sends SDPA here). Three implementations sit behind the op, chosen from static
facts only (platform, shapes, dtype, mask, dropout, matmul precision), the same way in the
forward and the backward:
- at most ``DENSE_MAX_ELEMENTS`` score elements: one dense XLA program (scores, mask, softmax,
  dropout, value product; the backward recomputes the probabilities from the logsumexp);
- above it, on TPU/GPU where a kernel JAX ships applies (``attention_kernels.choose``): Pallas
  splash attention (TPU) or the Pallas/Triton flash kernel (GPU);
- otherwise the blockwise online-softmax kernel of ``flash.py`` on any PJRT device: memory
  O(L*d + block^2) per head, causal key blocks beyond the diagonal skipped.

Dropout: the op is ``random`` when ``dropout_p > 0`` (``_draws_dropout``); the key's two 32-bit
words are returned packed in ``philox_seed`` (int64), so the backward regenerates exactly the same
keep-mask (per tile in the blockwise kernel). Without dropout (every inference call) it draws
nothing, as CUDA's kernels advance the philox offset only when dropout is on: the generator's
state is unchanged and the key argument is ``None``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..runtime import devices as _devices
from . import attention_kernels, flash
from .registry import aten, matmul_precision, register


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


# ---------------------------------------------------------------- blockwise path (flash.py)

# Scores of at most this many elements in all (batch x heads x L x S) are computed densely:
# one fused program, exact, and faster than a loop at small sizes. Above it, the blockwise
# kernel keeps memory O(L*d + block^2) per head.
DENSE_MAX_ELEMENTS = 1 << 22
# elements of one (batch x heads x query block x key block) tile of the blockwise kernel
# (8 heads: 256 x 512 tiles; fwd+bwd 1.4-1.5x faster than 2^19 at 4k-16k tokens on XLA:CPU,
# +5 MiB of XLA temp memory; 2^21 measured no faster)
TILE_ELEMENTS = 1 << 20
MIN_BLOCK, MAX_BLOCK = 128, 512


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_sizes(bh: int, L: int, S: int) -> tuple[int, int]:
    """(query block, key block): powers of two, at most MAX_BLOCK, no larger than the
    sequence (rounded up to a power of two), halved while a tile over every (batch, head)
    exceeds TILE_ELEMENTS (down to MIN_BLOCK)."""
    bq = min(MAX_BLOCK, _pow2_at_least(L))
    bk = min(MAX_BLOCK, _pow2_at_least(S))
    while bh * bq * bk > TILE_ELEMENTS and max(bq, bk) > MIN_BLOCK:
        if bq >= bk:
            bq //= 2
        else:
            bk //= 2
    return bq, bk


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


class _Layout:
    """How the op's shapes map onto flash.py's (B, Hk, G, L, E) layout, and back."""

    def __init__(self, q, k, v, bias):
        self.lead = q.shape[:-3]
        self.hq, self.L, self.E = q.shape[-3:]
        self.hk, self.S = k.shape[-3], k.shape[-2]
        self.ev = v.shape[-1]
        self.B = _prod(self.lead)
        self.G = self.hq // self.hk
        self.bias_shape = None if bias is None else bias.shape
        self.bq, self.bk = block_sizes(self.B * self.hq, self.L, self.S)

    def qkv(self, q, k, v):
        return (q.reshape(self.B, self.hk, self.G, self.L, self.E),
                k.reshape(self.B, self.hk, self.S, self.E),
                v.reshape(self.B, self.hk, self.S, self.ev))

    def q_like(self, x, last):
        return x.reshape(self.lead + (self.hq, self.L) + ((last,) if last else ()))

    # bias: right-aligned to (..., Hq, L, S); normalised to (B1, h1, g1, l1, s1), each dim 1
    # or full, padded along full L / S dims to whole blocks
    def bias_dims(self):
        nd = len(self.lead) + 3
        shp = (1,) * (nd - len(self.bias_shape)) + tuple(self.bias_shape)
        lead = shp[:-3]
        lead_full = not all(n == 1 for n in lead)
        return shp, lead_full

    def norm_bias(self, bias):
        shp, lead_full = self.bias_dims()
        b = bias.reshape(shp)
        if lead_full:
            b = jnp.broadcast_to(b, self.lead + shp[-3:])
        hb, lb, sb = shp[-3:]
        h1, g1 = (self.hk, self.G) if hb == self.hq and self.hq > 1 else (1, 1)
        b = b.reshape((self.B if lead_full else 1, h1, g1, lb, sb))
        if lb > 1:
            b = flash._pad_to(b, 3, flash.cdiv(self.L, self.bq) * self.bq)
        if sb > 1:
            b = flash._pad_to(b, 4, flash.cdiv(self.S, self.bk) * self.bk)
        return b

    def bias_grad_back(self, g):
        """(B1, h1, g1, l1, s1) padded gradient -> the bias's own shape."""
        shp, lead_full = self.bias_dims()
        g = g[..., :shp[-2], :shp[-1]]
        g = g.reshape((self.lead if lead_full else shp[:-3]) + shp[-3:])
        return _sum_to(g, self.bias_shape)


def _blocked_fits(q, k, v, bias) -> bool:
    """Shapes the blockwise kernel covers (else the dense path)."""
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        return False
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1]:
        return False
    hq, hk = q.shape[-3], k.shape[-3]
    if hk == 0 or hq % hk:
        return False
    if bias is not None:
        if bias.ndim > q.ndim:
            return False
        shp = (1,) * (q.ndim - bias.ndim) + tuple(bias.shape)
        full = q.shape[:-1] + (k.shape[-2],)
        if any(b not in (1, n) for b, n in zip(shp, full)):
            return False
    return True


def use_blocked(q, k, v, bias) -> bool:
    """The blockwise kernel when the dense scores would exceed DENSE_MAX_ELEMENTS."""
    n = _prod(q.shape[:-1]) * k.shape[-2]
    return n > DENSE_MAX_ELEMENTS and _blocked_fits(q, k, v, bias)


class SdpaPlan(flash.Plan):
    """flash.py's plan for SDPA and splash_sdpa: one key block per step for every head,
    ``-inf`` where a key is hidden: past the end (padding), after the query (causal), outside
    ``window = (left, right)`` (keys i - left .. i + right), in another segment
    (``seg = (q ids (B, Lp), kv ids (B, Sp))``) or masked by the bias; key blocks wholly
    hidden by causality or the window are not visited. ``bias_grad``: accumulate the
    gradient of the additive bias (``extra``)."""

    def __init__(self, lay, bias_n=None, is_causal=False, window=None, seg=None,
                 bias_grad=False, acc=jnp.float32):
        super().__init__(flash.cdiv(lay.S, lay.bk))
        self.lay, self.bias_n, self.is_causal = lay, bias_n, is_causal
        self.window, self.seg = window, seg
        self.lb = self.sb = False
        if bias_n is not None:
            self.lb, self.sb = bias_n.shape[3] > 1, bias_n.shape[4] > 1
        self.bias_grad = bias_grad
        if bias_grad:
            self.extra_init = jnp.zeros(bias_n.shape, acc)

    def phases(self, i):
        lay, nk = self.lay, self.nk
        bq, bk = lay.bq, lay.bk
        left, right = self.window if self.window is not None else (None, None)
        lo, hi = 0, nk
        if left is not None:
            lo = jnp.maximum(0, (i * bq - left) // bk)
        last = (i + 1) * bq - 1  # the block's last query row
        reach = last if self.is_causal else None
        if right is not None:
            reach = last + right if reach is None else jnp.minimum(reach, last + right)
        if reach is not None:
            hi = jnp.maximum(lo, jnp.clip(reach // bk + 1, 0, nk))
        return [(lo, hi, lambda t: (t, None), True)]

    def _bias_tile(self, i, j):
        bt = self.bias_n
        if self.lb:
            bt = lax.dynamic_slice_in_dim(bt, i * self.lay.bq, self.lay.bq, axis=3)
        if self.sb:
            bt = lax.dynamic_slice_in_dim(bt, j * self.lay.bk, self.lay.bk, axis=4)
        return bt

    def scores(self, s, i, j, masked):
        lay = self.lay
        S, bq, bk = lay.S, lay.bq, lay.bk
        ok = None

        def both(a, b):
            return b if a is None else (a & b)

        if self.is_causal or S % bk or self.window is not None:
            rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
            cols = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            if self.is_causal:
                ok = cols <= rows
            if S % bk:
                ok = both(ok, cols < S)
            if self.window is not None:
                left, right = self.window
                if left is not None:
                    ok = both(ok, cols >= rows - left)
                if right is not None:
                    ok = both(ok, cols <= rows + right)
        if self.seg is not None:
            sq = lax.dynamic_slice_in_dim(self.seg[0], i * bq, bq, axis=1)
            skv = lax.dynamic_slice_in_dim(self.seg[1], j * bk, bk, axis=1)
            ok = both(ok, (sq[:, :, None] == skv[:, None, :])[:, None, None])
        if self.bias_n is not None:
            bt = self._bias_tile(i, j)
            if bt.dtype == jnp.bool_:
                ok = both(ok, bt)
            else:
                s = s + bt.astype(s.dtype)
        return s if ok is None else jnp.where(ok, s, -jnp.inf)

    def scores_vjp(self, s, i, j, masked, ds, extra):
        if not self.bias_grad:
            return ds, extra
        # the bias's gradient is the scores' (hidden entries have p = 0, so ds = 0 there),
        # summed over the dims the bias broadcasts
        b1, h1, g1 = self.bias_n.shape[:3]
        red = tuple(a for a, n in enumerate((b1, h1, g1)) if n == 1) + \
            ((3,) if not self.lb else ()) + ((4,) if not self.sb else ())
        t = jnp.sum(ds, axis=red, keepdims=True) if red else ds
        at = (0, 0, 0, i * self.lay.bq if self.lb else 0, j * self.lay.bk if self.sb else 0)
        cur = lax.dynamic_slice(extra, at, t.shape)
        return ds, lax.dynamic_update_slice(extra, cur + t, at)


def _blocked_forward(q, k, v, bias, is_causal, scale, dropout_p, rkey):
    lay = _Layout(q, k, v, bias)
    acc = _acc(q.dtype)
    bias_n = None if bias is None else lay.norm_bias(bias)
    qn, kn, vn = lay.qkv(q, k, v)
    out, lse, _ = flash.forward(qn, kn, vn, scale=_scale_of(q, scale), bq=lay.bq, bk=lay.bk,
                                plan=SdpaPlan(lay, bias_n, is_causal), acc=acc,
                                dropout_p=dropout_p, key=rkey)
    return lay.q_like(out, lay.ev), lay.q_like(lse, None)


def _blocked_backward(grad_out, q, k, v, out, bias, lse, dropout_p, is_causal, rkey, scale,
                      want_bias_grad):
    lay = _Layout(q, k, v, bias)
    acc = _acc(q.dtype)
    bias_n = None if bias is None else lay.norm_bias(bias)
    qn, kn, vn = lay.qkv(q, k, v)
    B, hk, G = lay.B, lay.hk, lay.G
    don = grad_out.reshape(B, hk, G, lay.L, lay.ev)
    outn = out.reshape(B, hk, G, lay.L, lay.ev)
    lsen = lse.reshape(B, hk, G, lay.L)
    plan = SdpaPlan(lay, bias_n, is_causal, bias_grad=want_bias_grad, acc=acc)
    dq, dk, dv, db = flash.backward(don, qn, kn, vn, outn, lsen, scale=_scale_of(q, scale),
                                    bq=lay.bq, bk=lay.bk, plan=plan, acc=acc,
                                    dropout_p=dropout_p, key=rkey)
    dq = lay.q_like(dq, lay.E).astype(q.dtype)
    dk = dk.reshape(k.shape).astype(k.dtype)
    dv = dv.reshape(v.shape).astype(v.dtype)
    gb = lay.bias_grad_back(db).astype(bias.dtype) if want_bias_grad else None
    return dq, dk, dv, gb


def _dropout_key(rng):
    rkey = jax.random.key_data(rng).reshape(-1)[:2].astype(jnp.uint32)
    return jax.random.wrap_key_data(rkey, impl="threefry2x32")


def pallas_kernel(q, k, v, bias, dropout_p) -> str | None:
    """The kernel JAX ships for this platform, shape and dtype, if one applies (see
    attention_kernels.choose); only for shapes the blockwise path would take."""
    L, E = q.shape[-2:]
    S, Ev = v.shape[-2:]
    return attention_kernels.choose(_devices.platform(), q.dtype, L, S, E, Ev,
                                    has_mask=bias is not None, dropout_p=dropout_p,
                                    precision=matmul_precision())


def _pallas_forward(kernel, q, k, v, is_causal, scale):
    lay = _Layout(q, k, v, None)
    qn, kn, vn = lay.qkv(q, k, v)
    sc = _scale_of(q, scale)
    interp = attention_kernels.INTERPRET
    if kernel == "splash":
        out, lse = attention_kernels.splash_forward(qn, kn, vn, scale=sc, causal=is_causal,
                                                    interpret=interp)
    else:
        out, lse = attention_kernels.gpu_forward(qn, kn, vn, scale=sc, causal=is_causal,
                                                 interpret=interp)
    return lay.q_like(out, lay.ev), lay.q_like(lse, None)


def _pallas_backward(kernel, grad_out, q, k, v, out, lse, is_causal, scale):
    lay = _Layout(q, k, v, None)
    qn, kn, vn = lay.qkv(q, k, v)
    shp = (lay.B, lay.hk, lay.G, lay.L)
    don, outn, lsen = grad_out.reshape(shp + (lay.ev,)), out.reshape(shp + (lay.ev,)), \
        lse.reshape(shp)
    fn = attention_kernels.splash_backward if kernel == "splash" else \
        attention_kernels.gpu_backward
    dq, dk, dv = fn(don, qn, kn, vn, outn, lsen, scale=_scale_of(q, scale), causal=is_causal,
                    interpret=attention_kernels.INTERPRET)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None


def attend(q, k, v, bias, is_causal, scale, dropout_p=0.0, rng=None):
    """(out, float32 logsumexp, dropout seed): the dense program, the kernel JAX ships for
    this platform, or the blockwise kernel."""
    if not use_blocked(q, k, v, bias):
        return _attend(q, k, v, bias, is_causal, scale, dropout_p, rng)
    kernel = pallas_kernel(q, k, v, bias, dropout_p)
    if kernel is not None:
        out, lse = _pallas_forward(kernel, q, k, v, is_causal, scale)
        return out, lse, jnp.zeros((), jnp.int64)
    rkey = _dropout_key(rng) if dropout_p > 0 else None
    out, lse = _blocked_forward(q, k, v, bias, is_causal, scale, dropout_p, rkey)
    seed = _pack_key(rkey) if dropout_p > 0 else jnp.zeros((), jnp.int64)
    return out, lse, seed


def attend_backward(grad_out, q, k, v, out, bias, logsumexp, dropout_p, is_causal, seed,
                    scale, want_bias_grad=True):
    """Gradients of q, k, v and of a float bias, through the forward's path."""
    if not use_blocked(q, k, v, bias):
        return _attend_backward(grad_out, q, k, v, out, bias, logsumexp, dropout_p, is_causal,
                                seed, scale)
    kernel = pallas_kernel(q, k, v, bias, dropout_p)
    if kernel is not None:
        return _pallas_backward(kernel, grad_out, q, k, v, out, logsumexp, is_causal, scale)
    rkey = _unpack_key(seed) if dropout_p > 0 else None
    want = want_bias_grad and bias is not None and bias.dtype != jnp.bool_
    return _blocked_backward(grad_out, q, k, v, out, bias, logsumexp, dropout_p, is_causal,
                             rkey, scale, want)


# ---------------------------------------------------------------- torch.tpu.ops.splash_sdpa
# (the op is defined in torchtpu/ops/attention.py; these are its lowerings)

def _splash_window(window_left, window_right):
    return None if window_left is None and window_right is None else (window_left,
                                                                       window_right)


def _splash_checks(q, k, v, q_seg, kv_seg):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise RuntimeError("splash_sdpa: expected 4-D query, key and value (batch, heads, "
                           f"length, head dim), got {q.ndim}-D, {k.ndim}-D and {v.ndim}-D")
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError("splash_sdpa: expected query, key and value to have the same dtype")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise RuntimeError(f"splash_sdpa: incompatible shapes {tuple(q.shape)}, "
                           f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise RuntimeError(f"splash_sdpa: {q.shape[1]} query heads are not a multiple of "
                           f"{k.shape[1]} key heads")
    if (q_seg is None) != (kv_seg is None):
        raise RuntimeError("splash_sdpa: give both q_segment_ids and kv_segment_ids or neither")
    if q_seg is not None and (q_seg.shape != q.shape[:1] + q.shape[2:3]
                              or kv_seg.shape != k.shape[:1] + k.shape[2:3]):
        raise RuntimeError("splash_sdpa: segment ids must have shapes (batch, query length) "
                           "and (batch, key length)")


def _splash_plan(q, k, v, q_seg, window):
    """The kernel: splash on TPU, the GPU kernel for plain causal/full attention, else None
    (flash.py)."""
    kernel = attention_kernels.choose(_devices.platform(), q.dtype, q.shape[2], k.shape[2],
                                      q.shape[3], v.shape[3], has_mask=False, dropout_p=0.0,
                                      precision=matmul_precision())
    if kernel == "pallas_gpu" and (q_seg is not None or window is not None):
        return None
    return kernel


def _splash_segments(lay, q_seg, kv_seg):
    if q_seg is None:
        return None
    return (flash._pad_to(q_seg.astype(jnp.int32), 1, flash.cdiv(lay.L, lay.bq) * lay.bq),
            flash._pad_to(kv_seg.astype(jnp.int32), 1, flash.cdiv(lay.S, lay.bk) * lay.bk))


def splash_sdpa_forward(query, key, value, q_segment_ids=None, kv_segment_ids=None,
                        is_causal=False, scale=None, window_left=None, window_right=None):
    """-> (out, float32 logsumexp (B, Hq, L))."""
    _splash_checks(query, key, value, q_segment_ids, kv_segment_ids)
    window = _splash_window(window_left, window_right)
    lay = _Layout(query, key, value, None)
    qn, kn, vn = lay.qkv(query, key, value)
    sc = _scale_of(query, scale)
    kernel = _splash_plan(query, key, value, q_segment_ids, window)
    interp = attention_kernels.INTERPRET
    if kernel == "splash":
        out, lse = attention_kernels.splash_forward(qn, kn, vn, scale=sc, causal=is_causal,
                                                    window=window, seg_q=q_segment_ids,
                                                    seg_kv=kv_segment_ids, interpret=interp)
    elif kernel == "pallas_gpu":
        out, lse = attention_kernels.gpu_forward(qn, kn, vn, scale=sc, causal=is_causal,
                                                 interpret=interp)
    else:
        seg = _splash_segments(lay, q_segment_ids, kv_segment_ids)
        out, lse, _ = flash.forward(qn, kn, vn, scale=sc, bq=lay.bq, bk=lay.bk,
                                    plan=SdpaPlan(lay, None, is_causal, window, seg),
                                    acc=_acc(query.dtype))
    return lay.q_like(out, lay.ev), lay.q_like(lse, None)


def splash_sdpa_backward(grad_out, query, key, value, out, logsumexp, q_segment_ids=None,
                         kv_segment_ids=None, is_causal=False, scale=None, window_left=None,
                         window_right=None):
    """-> (grad query, grad key, grad value)."""
    window = _splash_window(window_left, window_right)
    lay = _Layout(query, key, value, None)
    qn, kn, vn = lay.qkv(query, key, value)
    shp = (lay.B, lay.hk, lay.G, lay.L)
    don, outn = grad_out.reshape(shp + (lay.ev,)), out.reshape(shp + (lay.ev,))
    lsen = logsumexp.reshape(shp)
    sc = _scale_of(query, scale)
    kernel = _splash_plan(query, key, value, q_segment_ids, window)
    interp = attention_kernels.INTERPRET
    if kernel == "splash":
        dq, dk, dv = attention_kernels.splash_backward(
            don, qn, kn, vn, outn, lsen, scale=sc, causal=is_causal, window=window,
            seg_q=q_segment_ids, seg_kv=kv_segment_ids, interpret=interp)
    elif kernel == "pallas_gpu":
        dq, dk, dv = attention_kernels.gpu_backward(don, qn, kn, vn, outn, lsen, scale=sc,
                                                    causal=is_causal, interpret=interp)
    else:
        seg = _splash_segments(lay, q_segment_ids, kv_segment_ids)
        dq, dk, dv, _ = flash.backward(don, qn, kn, vn, outn, lsen, scale=sc, bq=lay.bq,
                                       bk=lay.bk, plan=SdpaPlan(lay, None, is_causal, window,
                                                                seg),
                                       acc=_acc(query.dtype))
    return (dq.reshape(query.shape).astype(query.dtype), dk.reshape(key.shape).astype(key.dtype),
            dv.reshape(value.shape).astype(value.dtype))


def _draws_dropout(args, kwargs):
    """The fused op's ``random`` predicate: it draws a key only for ``dropout_p > 0``."""
    p = kwargs["dropout_p"] if "dropout_p" in kwargs else args[4] if len(args) > 4 else 0.0
    return not isinstance(p, (int, float)) or p > 0


@register(aten._scaled_dot_product_fused_attention_overrideable.default, random=_draws_dropout,
          reads_precision=True)
def sdpa_fused(rng, query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None):
    out, lse, seed = attend(query, key, value, attn_bias, is_causal, scale, dropout_p, rng)
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


@register(aten._scaled_dot_product_flash_attention_for_cpu.default, reads_precision=True)
def sdpa_flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                       scale=None):
    _check_cpu_flash(query, dropout_p, attn_mask)
    out, lse, _ = attend(query, key, value, attn_mask, is_causal, scale)
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


@register(aten._scaled_dot_product_fused_attention_overrideable_backward.default,
          reads_precision=True)
def sdpa_fused_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp,
                        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
                        philox_offset, *, scale=None):
    grads = attend_backward(grad_out, query, key, value, out, attn_bias, logsumexp, dropout_p,
                            is_causal, philox_seed, scale, want_bias_grad=grad_input_mask[3])
    return tuple(g if want else None for g, want in zip(grads, grad_input_mask))


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, reads_precision=True)
def sdpa_flash_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                is_causal, *, attn_mask=None, scale=None):
    _check_cpu_flash(query, dropout_p, attn_mask)
    return attend_backward(grad_out, query, key, value, out, attn_mask, logsumexp, 0.0, is_causal,
                           None, scale, want_bias_grad=False)[:3]


def layout_order(ndim, like):
    """The dimension order ``_like_layout`` gives an ``ndim``-dim result laid out like tensor
    ``like`` (``t.permute(order).contiguous().permute(inverse)``), or None: it stays contiguous.
    Read from ``like``'s metadata only, so the C++ fast path keeps it as a constant of an entry
    (eager/fastpath.py) and restrides a hit's output the same way."""
    if like is None or like.is_contiguous() or ndim != like.dim():
        return None
    return tuple(sorted(range(like.dim()), key=lambda d: (-like.stride(d), d)))


def _like_layout(t, like):
    """``t`` (contiguous) with ``like``'s stride order, as PyTorch's kernels allocate
    attention outputs (``alloc_with_matching_layout``) and gradients (``empty_like``)."""
    order = None if t is None else layout_order(t.dim(), like)
    if order is None:
        return t
    inverse = [order.index(d) for d in range(len(order))]
    return t.permute(order).contiguous().permute(inverse)


def _fwd_layout(args, kwargs, res):
    return (_like_layout(res[0], args[0]),) + tuple(res[1:])


def _bwd_layout(args, kwargs, res):
    return tuple(_like_layout(g, a) for g, a in zip(res, args[1:5]))


# registry meta ``eager_layout_like``: result i of an ``eager_layout`` op is ``_like_layout``
# of positional argument ``like[i]`` (None or past the end: as returned), which the C++ fast
# path reproduces; an ``eager_layout`` without it always runs in Python
for _op, _fn, _like in ((aten._scaled_dot_product_fused_attention_overrideable.default,
                         _fwd_layout, (0,)),
                        (aten._scaled_dot_product_fused_attention_overrideable_backward.default,
                         _bwd_layout, (1, 2, 3, 4))):
    from .registry import LOWERINGS as _L

    _L[_op].meta["eager_layout"] = _fn
    _L[_op].meta["eager_layout_like"] = _like


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
