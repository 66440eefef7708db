"""Blockwise (flash-style) attention in pure JAX: memory O(L*d + block^2) per head.

The forward walks query blocks (outer loop) and, for each, the key blocks it can see (inner
loop, bounds traced, so a causal query block stops at the diagonal) with an online softmax: a
running row max ``m``, row sum ``l`` and unnormalised output ``acc``, rescaled by
``exp(m_old - m_new)`` when a block raises the max. It returns the output and the logsumexp.
The backward walks the same tiles, recomputes each tile's probabilities from the saved
logsumexp (``p = exp(s - lse)``) and uses flash attention's ``D = rowsum(dO * O)``; the query
block's gradient is accumulated in the loop, the key and value gradients in full-size carried
buffers (O(S*d)) updated in place block by block. Nothing of size L x S exists unless the
caller's own mask has that size.

Shapes are normalised by the caller: queries ``(B, Hk, G, L, E)`` (G query heads share a key
head: grouped-query attention without repeating keys), keys ``(B, Hk, S, E)``, values
``(B, Hk, S, Ev)``. ``tile(s, i, j)`` applies masks and biases to the scores of query block i
and key block j (entries to drop become -inf); ``kv_range(i)`` gives the key blocks query
block i visits. Rows every key of which is masked give zeros and a logsumexp of -inf, as
PyTorch's safe softmax.

Dropout: each tile's keep-mask is drawn from ``fold_in(key, i * nk + j)``, so the backward
redraws exactly the forward's mask tile by tile (block sizes are a function of the shapes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(x, axis, n):
    extra = n - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _prec(acc):
    return lax.Precision.HIGHEST if acc in (jnp.float32, jnp.float64) else None


def _dot_qk(qb, kb, acc):
    return jnp.einsum("bhgqe,bhke->bhgqk", qb, kb, precision=_prec(acc),
                      preferred_element_type=acc)


def _keep(key, i, j, nk, dropout_p, shape):
    return jax.random.bernoulli(jax.random.fold_in(key, i * nk + j), 1.0 - dropout_p, shape)


def forward(q, k, v, *, scale, bq, bk, tile, kv_range, acc, dropout_p=0.0, key=None):
    """-> (out like q with v's last dim, logsumexp float32 (B, Hk, G, L))."""
    B, Hk, G, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    nq, nk = cdiv(L, bq), cdiv(S, bk)
    qp = _pad_to(q, 3, nq * bq)
    kp, vp = _pad_to(k, 2, nk * bk), _pad_to(v, 2, nk * bk)
    neg = jnp.asarray(-jnp.inf, acc)

    def q_block(i, carry):
        out, lse = carry
        qb = lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=3).astype(acc)

        def kv_block(j, st):
            m, l, a = st
            kb = lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=2).astype(acc)
            vb = lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=2).astype(acc)
            s = tile(_dot_qk(qb, kb, acc) * scale, i, j)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == neg, 0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + jnp.sum(p, axis=-1)
            if dropout_p > 0:
                p = jnp.where(_keep(key, i, j, nk, dropout_p, p.shape), p, 0)
            a = alpha[..., None] * a + jnp.einsum("bhgqk,bhkd->bhgqd", p, vb,
                                                  precision=_prec(acc))
            return m_new, l, a

        st0 = (jnp.full((B, Hk, G, bq), neg, acc), jnp.zeros((B, Hk, G, bq), acc),
               jnp.zeros((B, Hk, G, bq, Ev), acc))
        lo, hi = kv_range(i)
        m, l, a = lax.fori_loop(lo, hi, kv_block, st0)
        live = l > 0
        inv = jnp.where(live, 1 / jnp.where(live, l, 1), 0)
        if dropout_p > 0:
            inv = inv / (1.0 - dropout_p)
        o = (a * inv[..., None]).astype(out.dtype)
        m_safe = jnp.where(m == neg, 0, m)
        lse_b = jnp.where(live, jnp.log(jnp.where(live, l, 1)) + m_safe, -jnp.inf)
        out = lax.dynamic_update_slice_in_dim(out, o, i * bq, axis=3)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_b.astype(jnp.float32), i * bq, axis=3)
        return out, lse

    out0 = jnp.zeros((B, Hk, G, nq * bq, Ev), q.dtype)
    lse0 = jnp.zeros((B, Hk, G, nq * bq), jnp.float32)
    out, lse = lax.fori_loop(0, nq, q_block, (out0, lse0))
    return out[..., :L, :], lse[..., :L]


def backward(do, q, k, v, out, lse, *, scale, bq, bk, tile, kv_range, acc, dropout_p=0.0,
             key=None, bias_grad=None):
    """-> (dq, dk, dv[, dbias]) in acc precision.

    ``bias_grad``: ``(init, add)`` to also accumulate the gradient of an additive bias:
    ``init`` is its zero buffer and ``add(buf, ds, i, j)`` adds a tile's score gradient.
    """
    B, Hk, G, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    nq, nk = cdiv(L, bq), cdiv(S, bk)
    Lp = nq * bq
    # flash attention's D: rowsum(dO * O) = sum_j P_ij dP_ij
    D = jnp.sum(do.astype(acc) * out.astype(acc), axis=-1)
    lse = lse.astype(acc)
    lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # masked rows: p = exp(-inf) = 0
    qp, dop = _pad_to(q, 3, Lp), _pad_to(do, 3, Lp)
    Dp, lsep = _pad_to(D, 3, Lp), _pad_to(lse_safe, 3, Lp)
    kp, vp = _pad_to(k, 2, nk * bk), _pad_to(v, 2, nk * bk)

    def q_block(i, carry):
        dq, dk, dv, db = carry
        qb = lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=3).astype(acc)
        dob = lax.dynamic_slice_in_dim(dop, i * bq, bq, axis=3).astype(acc)
        Db = lax.dynamic_slice_in_dim(Dp, i * bq, bq, axis=3)
        lb = lax.dynamic_slice_in_dim(lsep, i * bq, bq, axis=3)

        def kv_block(j, st):
            dqb, dk, dv, db = st
            kb = lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=2).astype(acc)
            vb = lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=2).astype(acc)
            s = tile(_dot_qk(qb, kb, acc) * scale, i, j)
            p = jnp.exp(s - lb[..., None])
            if dropout_p > 0:
                keep = _keep(key, i, j, nk, dropout_p, p.shape)
                pd = jnp.where(keep, p / (1.0 - dropout_p), 0)
            else:
                pd = p
            dvj = jnp.einsum("bhgqk,bhgqd->bhkd", pd, dob, precision=_prec(acc))
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", dob, vb, precision=_prec(acc))
            if dropout_p > 0:
                dp = jnp.where(keep, dp / (1.0 - dropout_p), 0)
            ds = p * (dp - Db[..., None])
            dqb = dqb + jnp.einsum("bhgqk,bhke->bhgqe", ds, kb, precision=_prec(acc))
            dkj = jnp.einsum("bhgqk,bhgqe->bhke", ds, qb, precision=_prec(acc))
            dk = lax.dynamic_update_slice_in_dim(
                dk, lax.dynamic_slice_in_dim(dk, j * bk, bk, axis=2) + dkj, j * bk, axis=2)
            dv = lax.dynamic_update_slice_in_dim(
                dv, lax.dynamic_slice_in_dim(dv, j * bk, bk, axis=2) + dvj, j * bk, axis=2)
            if bias_grad is not None:
                db = bias_grad[1](db, ds, i, j)
            return dqb, dk, dv, db

        lo, hi = kv_range(i)
        dqb, dk, dv, db = lax.fori_loop(lo, hi, kv_block,
                                        (jnp.zeros((B, Hk, G, bq, E), acc), dk, dv, db))
        dq = lax.dynamic_update_slice_in_dim(dq, dqb * scale, i * bq, axis=3)
        return dq, dk, dv, db

    init = (jnp.zeros((B, Hk, G, Lp, E), acc), jnp.zeros((B, Hk, nk * bk, E), acc),
            jnp.zeros((B, Hk, nk * bk, Ev), acc),
            bias_grad[0] if bias_grad is not None else jnp.zeros((), acc))
    dq, dk, dv, db = lax.fori_loop(0, nq, q_block, init)
    res = (dq[..., :L, :], dk[..., :S, :] * scale, dv[..., :S, :])
    return res + (db,) if bias_grad is not None else res
