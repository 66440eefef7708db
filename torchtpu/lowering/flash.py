"""Blockwise (flash-style) attention in pure JAX: memory O(L*d + block^2) per head.

The forward walks query blocks (outer loop) and, for each, the key blocks its ``plan`` lists
(inner loops, bounds traced, so a causal query block stops at the diagonal and a block-sparse
mask skips its empty blocks) with an online softmax: a running row max ``m``, row sum ``l``
and unnormalised output ``acc``, rescaled by ``exp(m_old - m_new)`` when a block raises the
max. It returns the output, the logsumexp and the row max. The backward walks the same tiles,
recomputes each tile's probabilities from the saved logsumexp (``p = exp(s - lse)``) and uses
flash attention's ``D = rowsum(dO * O)``; the query block's gradient is accumulated in the
loop, the key and value gradients in full-size carried buffers (O(S*d)) updated in place
block by block. Nothing of size L x S exists unless the caller's own mask has that size.

Layout (normalised by the caller): queries ``(B, Hk, G, L, E)`` (G query heads share a key
head: grouped-query attention without repeating keys), keys ``(B, Hk, S, E)``, values
``(B, Hk, S, Ev)``.

A ``Plan`` says which tiles exist and what their scores are:
- ``phases(i)``: for query block i, a list of ``(lo, hi, block, masked)``: key blocks
  ``block(t)`` for t in [lo, hi). ``block`` returns ``(j, valid)``: j a traced int (one key
  block for every (batch, head)) or an int array of shape (B, Hk, G) (a block per head: a
  FlexAttention BlockMask's tables), and ``valid`` None or a boolean array of that shape
  (False: this head has no t-th block; the tile counts as fully masked for it).
- ``scores(s, i, j, masked)``: the tile's raw scores ``q k^T * scale`` -> the scores the
  softmax sees (biases, score_mod; -inf where a key is hidden).
- ``scores_vjp(s, i, j, masked, ds, extra)``: the gradient of the raw scores given that of the
  softmax's scores, and ``extra`` (a pytree, e.g. a bias's gradient) updated.
- ``extra_init``: the zero value of ``extra``.

Dropout (SDPA only, scalar key blocks): each tile's keep-mask is drawn from
``fold_in(key, i * nk + j)``, so the backward redraws exactly the forward's mask tile by tile
(block sizes are a function of the shapes).
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


def _keep(key, i, j, nk, dropout_p, shape):
    return jax.random.bernoulli(jax.random.fold_in(key, i * nk + j), 1.0 - dropout_p, shape)


class Plan:
    """Dense attention over every key block (subclasses restrict and modify)."""

    extra_init = ()

    def __init__(self, nk: int):
        self.nk = nk

    def phases(self, i):
        return [(0, self.nk, lambda t: (t, None), True)]

    def scores(self, s, i, j, masked):
        return s

    def scores_vjp(self, s, i, j, masked, ds, extra):
        return ds, extra


class _Blocks:
    """Key/value blocks for a scalar block index or one per (batch, key head, group), and
    adding into key/value-gradient buffers.

    Tiles are read from the keys and values as they are laid out, (key, E) blocks, and the
    products contract them on E (``q k^T``, ``dO v^T``). Copies of K and V laid out as (E, key)
    blocks, made once outside the loops, cost O(S*d) memory each (64 MiB for K and V at 16k
    tokens x 8 heads x 64) and measured no faster on XLA:CPU. The gradient buffers hold dK^T
    and dV^T blocks (E, key), written as dO^T P and Q^T dS (products of (m, k) x (k, n)
    operands, which XLA:CPU runs without copying a tile; accumulating dK and dV in their own
    layout measured ~20% slower) and transposed once at the end.
    """

    def __init__(self, kp, vp, bk):
        B, Hk, Sp, E = kp.shape
        Ev = vp.shape[-1]
        self.bk, self.nk = bk, Sp // bk
        self.k5 = kp.reshape(B, Hk, self.nk, bk, E)
        self.v5 = vp.reshape(B, Hk, self.nk, bk, Ev)
        self.bi = jnp.arange(B)[:, None, None]
        self.hi = jnp.arange(Hk)[None, :, None]

    def _take(self, x5, j):
        if jnp.ndim(j) == 0:
            return lax.dynamic_index_in_dim(x5, j, axis=2, keepdims=False)
        return x5[self.bi, self.hi, j]  # (B, Hk, G, ...)

    def load(self, j, acc):
        """(k (.., bk, E), v (.., bk, Ev)) in acc precision."""
        return self._take(self.k5, j).astype(acc), self._take(self.v5, j).astype(acc)

    def add(self, buf5, j, blk):
        """buf5 (B, Hk, nk, X, bk) += blk: (B, Hk, X, bk) for a scalar j, else per group."""
        if jnp.ndim(j) == 0:
            cur = lax.dynamic_index_in_dim(buf5, j, axis=2, keepdims=True)
            return lax.dynamic_update_index_in_dim(buf5, cur + blk[:, :, None], j, axis=2)
        return buf5.at[self.bi, self.hi, j].add(blk)


def _mm(spec, a, b, acc):
    return jnp.einsum(spec, a, b, precision=_prec(acc), preferred_element_type=acc)


def _qk(qb, kb, acc):
    return _mm("bhgqe,bhke->bhgqk" if kb.ndim == 4 else "bhgqe,bhgke->bhgqk", qb, kb, acc)


def _pv(p, vb, acc):
    return _mm("bhgqk,bhkd->bhgqd" if vb.ndim == 4 else "bhgqk,bhgkd->bhgqd", p, vb, acc)


def _tile_scores(plan, qb, kb, i, j, valid, masked, scale, acc):
    raw = _qk(qb, kb, acc) * scale
    s = plan.scores(raw, i, j, masked)
    if valid is not None:
        s = jnp.where(valid[..., None, None], s, -jnp.inf)
    return raw, s


def forward(q, k, v, *, scale, bq, bk, plan, acc, dropout_p=0.0, key=None):
    """-> (out like q with v's last dim, logsumexp float32 (B, Hk, G, L), row max of the
    scores (acc dtype, -inf for a row with no visible key))."""
    B, Hk, G, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    nq, nk = cdiv(L, bq), cdiv(S, bk)
    qp = _pad_to(q, 3, nq * bq)
    blocks = _Blocks(_pad_to(k, 2, nk * bk), _pad_to(v, 2, nk * bk), bk)
    neg = jnp.asarray(-jnp.inf, acc)

    def q_block(i, carry):
        out, lse, mx = carry
        qb = lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=3).astype(acc)
        st = (jnp.full((B, Hk, G, bq), neg, acc), jnp.zeros((B, Hk, G, bq), acc),
              jnp.zeros((B, Hk, G, bq, Ev), acc))
        for lo, hi, block, masked in plan.phases(i):
            def kv_block(t, st, block=block, masked=masked):
                m, l, a = st
                j, valid = block(t)
                kb, vb = blocks.load(j, acc)
                _, s = _tile_scores(plan, qb, kb, i, j, valid, masked, scale, acc)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(m_new == neg, 0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                l = alpha * l + jnp.sum(p, axis=-1)
                if dropout_p > 0:
                    p = jnp.where(_keep(key, i, j, nk, dropout_p, p.shape), p, 0)
                a = alpha[..., None] * a + _pv(p, vb, acc)
                return m_new, l, a

            st = lax.fori_loop(lo, hi, kv_block, st)
        m, l, a = st
        live = l > 0
        inv = jnp.where(live, 1 / jnp.where(live, l, 1), 0)
        if dropout_p > 0:
            inv = inv / (1.0 - dropout_p)
        o = (a * inv[..., None]).astype(out.dtype)
        m_safe = jnp.where(m == neg, 0, m)
        lse_b = jnp.where(live, jnp.log(jnp.where(live, l, 1)) + m_safe, -jnp.inf)
        out = lax.dynamic_update_slice_in_dim(out, o, i * bq, axis=3)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_b.astype(jnp.float32), i * bq, axis=3)
        mx = lax.dynamic_update_slice_in_dim(mx, m, i * bq, axis=3)
        return out, lse, mx

    init = (jnp.zeros((B, Hk, G, nq * bq, Ev), q.dtype),
            jnp.zeros((B, Hk, G, nq * bq), jnp.float32), jnp.zeros((B, Hk, G, nq * bq), acc))
    out, lse, mx = lax.fori_loop(0, nq, q_block, init)
    return out[..., :L, :], lse[..., :L], mx[..., :L]


def backward(do, q, k, v, out, lse, *, scale, bq, bk, plan, acc, dropout_p=0.0, key=None,
             grad_lse=None):
    """-> (dq, dk, dv, extra) in acc precision. ``grad_lse``: the gradient of the logsumexp
    output, if it has one (FlexAttention returns it)."""
    B, Hk, G, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    nq, nk = cdiv(L, bq), cdiv(S, bk)
    Lp = nq * bq
    # flash attention's D: rowsum(dO * O) = sum_j P_ij dP_ij; a logsumexp gradient adds to
    # every score's gradient through P: ds = P * (dP - D + dlse)
    D = jnp.sum(do.astype(acc) * out.astype(acc), axis=-1)
    if grad_lse is not None:
        D = D - grad_lse.astype(acc)
    lse = lse.astype(acc)
    lse_safe = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # masked rows: p = exp(-inf) = 0
    qp, dop = _pad_to(q, 3, Lp), _pad_to(do, 3, Lp)
    Dp, lsep = _pad_to(D, 3, Lp), _pad_to(lse_safe, 3, Lp)
    blocks = _Blocks(_pad_to(k, 2, nk * bk), _pad_to(v, 2, nk * bk), bk)

    def q_block(i, carry):
        dq, dkT, dvT, extra = carry
        qb = lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=3).astype(acc)
        dob = lax.dynamic_slice_in_dim(dop, i * bq, bq, axis=3).astype(acc)
        # (g, q) are contracted together with the tile: (B, Hk, E, G, bq), once per query block
        qTb, doTb = jnp.moveaxis(qb, -1, 2), jnp.moveaxis(dob, -1, 2)
        Db = lax.dynamic_slice_in_dim(Dp, i * bq, bq, axis=3)
        lb = lax.dynamic_slice_in_dim(lsep, i * bq, bq, axis=3)
        st = (jnp.zeros((B, Hk, G, bq, E), acc), dkT, dvT, extra)
        for lo, hi, block, masked in plan.phases(i):
            def kv_block(t, st, block=block, masked=masked):
                dqb, dkT, dvT, extra = st
                j, valid = block(t)
                kb, vb = blocks.load(j, acc)
                raw, s = _tile_scores(plan, qb, kb, i, j, valid, masked, scale, acc)
                p = jnp.exp(s - lb[..., None])
                if dropout_p > 0:
                    keep = _keep(key, i, j, nk, dropout_p, p.shape)
                    pd = jnp.where(keep, p / (1.0 - dropout_p), 0)
                else:
                    pd = p
                if kb.ndim == 5:  # a key block per (batch, head, group)
                    dvTj = _mm("bhdgq,bhgqk->bhgdk", doTb, pd, acc)
                    dp = _mm("bhgqd,bhgkd->bhgqk", dob, vb, acc)
                else:
                    dvTj = _mm("bhdgq,bhgqk->bhdk", doTb, pd, acc)
                    dp = _mm("bhgqd,bhkd->bhgqk", dob, vb, acc)
                if dropout_p > 0:
                    dp = jnp.where(keep, dp / (1.0 - dropout_p), 0)
                ds = p * (dp - Db[..., None])
                ds, extra = plan.scores_vjp(raw, i, j, masked, ds, extra)
                if valid is not None:
                    ds = jnp.where(valid[..., None, None], ds, 0)
                if kb.ndim == 5:
                    dqb = dqb + _mm("bhgqk,bhgke->bhgqe", ds, kb, acc)
                    dkTj = _mm("bhegq,bhgqk->bhgek", qTb, ds, acc)
                else:
                    dqb = dqb + _mm("bhgqk,bhke->bhgqe", ds, kb, acc)
                    dkTj = _mm("bhegq,bhgqk->bhek", qTb, ds, acc)
                return dqb, blocks.add(dkT, j, dkTj), blocks.add(dvT, j, dvTj), extra

            st = lax.fori_loop(lo, hi, kv_block, st)
        dqb, dkT, dvT, extra = st
        dq = lax.dynamic_update_slice_in_dim(dq, dqb * scale, i * bq, axis=3)
        return dq, dkT, dvT, extra

    init = (jnp.zeros((B, Hk, G, Lp, E), acc), jnp.zeros((B, Hk, nk, E, bk), acc),
            jnp.zeros((B, Hk, nk, Ev, bk), acc), plan.extra_init)
    dq, dkT, dvT, extra = lax.fori_loop(0, nq, q_block, init)
    dk = jnp.swapaxes(dkT, -1, -2).reshape(B, Hk, nk * bk, E)[:, :, :S] * scale
    dv = jnp.swapaxes(dvT, -1, -2).reshape(B, Hk, nk * bk, Ev)[:, :, :S]
    return dq[..., :L, :], dk, dv, extra
