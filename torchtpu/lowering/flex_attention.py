"""FlexAttention's higher-order ops (``flex_attention``, ``flex_attention_backward``) as pure JAX.

``torch.compile`` of ``flex_attention`` hands the backend a ``flex_attention`` HOP node (and,
under autograd, a ``flex_attention_backward`` one) whose ``score_mod`` / ``mask_mod`` are FX
subgraphs on 0-d tensors; eager FlexAttention on "tpu" reaches the same lowerings through
``tpu::flex_attention`` ops (``ops/flex_attention.py``). Two implementations:

- Small problems (at most ``attention.DENSE_MAX_ELEMENTS`` scores): the math of PyTorch's own
  reference (``torch/_higher_order_ops/flex_attention.py``: ``math_attention``,
  ``sdpa_dense_backward``): dense scores in float32 (float64 for float64 inputs), the
  subgraphs vectorised over (batch, head, query, key) with nested ``jax.vmap`` in the order
  PyTorch's ``_vmap_for_bhqkv`` uses, masked entries -inf, a safe softmax (fully masked rows
  give zeros), ``mask_mod`` evaluated everywhere.
- Larger ones: the blockwise kernel of ``flash.py`` driven by the BlockMask's tables, as
  PyTorch's fused kernels are: for each query block only the key blocks the mask lists are
  visited (``kv_indices``: ``mask_mod`` applied; ``full_kv_indices``: no mask needed), so a
  causal mask costs about half a dense one and a document mask less; memory O(L*d + block^2)
  per head. Tables shared by every (batch, head) run in coarse tiles of several blocks
  (``_FlexPlan._coarsen``), exact per fine block. For a BlockMask made by
  ``create_block_mask`` (tables consistent with its ``mask_mod``) the two agree; a hand-made
  BlockMask whose tables leave out blocks its ``mask_mod`` allows gets the fused kernels'
  answer (those blocks are skipped).

Both return the logsumexp and max in base 2 as the HOP's contract says. Gradients of tensors
captured by ``score_mod`` (learned biases: PyTorch's joint graph scatters them with
``flex_lib::zeros_and_scatter``) are computed with ``jax.vjp`` of the forward subgraph
(one scatter-add per tile, accumulated); the scores' own gradient follows the joint graph
when no captured tensor needs one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import flash
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


def _score_fn(gm, wp):
    def f(s, b_, h_, m_, n_, *bufs):
        return jnp.asarray(run_subgraph(gm, s, b_, h_, m_, n_, *bufs)).astype(wp)

    return f


def _joint_fn(gm, wp):
    def f(s, b_, h_, m_, n_, gs, *bufs):
        return jnp.asarray(run_subgraph(gm, s, b_, h_, m_, n_, gs, *bufs)[0]).astype(wp)

    return f


def _buffers_needing_grad(joint_graph, n_bufs) -> list:
    """Positions of score_mod's captured tensors whose gradient the joint graph returns."""
    if joint_graph is None or not n_bufs:
        return []
    out = next(n for n in joint_graph.graph.nodes if n.op == "output").args[0]
    grads = list(out)[5:5 + n_bufs]
    return [k for k, g in enumerate(grads) if g is not None]


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

    score_fn = _vmap_bhqkv(_score_fn(score_gm, wp), 1, (None,) * len(score_bufs))
    mask_gm, mask_fn = _mask_fn(block_mask, mask_bufs)
    mb, mh, mm, mn = _indices(scores.shape, mask_gm, 0)
    mask = mask_fn(mb, mh, mm, mn, *mask_bufs)
    post = jnp.where(mask, score_fn(scores, b, h, m, n, *score_bufs), jnp.asarray(-jnp.inf, wp))
    return scores, post, mask


def _dense_forward(query, key, value, score_mod, block_mask, scale,
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


def _dense_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                    fw_graph, joint_graph, block_mask, scale, score_mod_other_buffers=(),
                    mask_mod_other_buffers=()):
    """-> (dq, dk, dv, grads of score_mod's captured tensors), as ``sdpa_dense_backward``."""
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

    b, h, m, n = _indices(scores.shape, joint_graph, 1)
    need = _buffers_needing_grad(joint_graph, len(score_bufs))
    buf_grads = [None] * len(score_bufs)
    if need:
        # learned biases: jax.vjp of the forward subgraph (the joint graph scatters their
        # gradients with flex_lib::zeros_and_scatter per element)
        def fwd(s, *gb):
            bufs = list(score_bufs)
            for k, g_ in zip(need, gb):
                bufs[k] = g_
            return _vmap_bhqkv(_score_fn(fw_graph, wp), 1, (None,) * len(bufs))(
                s, b, h, m, n, *bufs)

        _, pull = jax.vjp(fwd, scores, *[score_bufs[k] for k in need])
        grads = pull(grad_score_mod.astype(wp))
        grad_scores = grads[0]
        for k, g_ in zip(need, grads[1:]):
            buf_grads[k] = g_.astype(score_bufs[k].dtype)
    else:
        grad_scores = _vmap_bhqkv(_joint_fn(joint_graph, wp), 1,
                                  (0,) + (None,) * len(score_bufs))(
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
    return grad_query, grad_key, grad_value, tuple(buf_grads)


# ---------------------------------------------------------------- blockwise (flash.py)

def _nest(fn, axes):
    """vmap ``fn`` over (b, h, q, kv) as ``_vmap_for_bhqkv`` nests it (kv innermost); ``axes``
    gives each argument's axis at the (kv, q, h, b) levels."""
    for level in range(4):
        fn = jax.vmap(fn, in_axes=tuple(a[level] for a in axes))
    return fn


_ALL = (0, 0, 0, 0)
_B, _H, _Q = (None, None, None, 0), (None, None, 0, None), (None, 0, None, None)
_NONE = (None, None, None, None)


class _FlexPlan(flash.Plan):
    """The BlockMask's tables as flash.py's plan: per query block, its partial key blocks
    (mask_mod applied) then its full ones; tables broadcast over batch/heads give one key
    block per step for every head, per-batch/per-head tables one per (batch, head)."""

    def __init__(self, *, B, Hk, G, S, bq, bk, block_mask, score_gm, score_bufs, mask_bufs,
                 wp, joint=None, need=()):
        super().__init__(flash.cdiv(S, bk))
        self.B, self.Hk, self.G, self.Hq, self.S = B, Hk, G, Hk * G, S
        self.bq, self.bk, self.wp = bq, bk, wp
        self.score_gm, self.mask_gm = score_gm, block_mask[-1]
        self.score_bufs, self.mask_bufs = tuple(score_bufs), tuple(mask_bufs)
        self.joint, self.need = joint, list(need)
        self.tables = [(block_mask[2], block_mask[3], True)]
        if block_mask[4] is not None:
            self.tables.append((block_mask[4], block_mask[5], False))
        self.fine = None
        if all(num.shape[0] == 1 and num.shape[1] == 1 for num, _, _ in self.tables):
            self._coarsen(block_mask)
        self.score_dt = placeholder_dtypes(score_gm)[1:5]
        self.mask_dt = placeholder_dtypes(self.mask_gm)[0:4]
        # whether mask_mod reads its batch / head index (if not, a tile's mask is computed once
        # for every (batch, head) and broadcast)
        ph = [n for n in self.mask_gm.graph.nodes if n.op == "placeholder"]
        self.mask_reads_bh = any(len(n.users) > 0 for n in ph[:2])
        bufs_axes = [_NONE] * len(self.score_bufs)
        self.extra_init = tuple(jnp.zeros(self.score_bufs[k].shape, jnp.promote_types(
            self.score_bufs[k].dtype, jnp.float32)) for k in self.need)
        self._axes = bufs_axes

    # -- coarse tiles over a BlockMask shared by every (batch, head)
    def _coarsen(self, block_mask):
        """Tiles of (R x C) BlockMask blocks, as large as SDPA's blockwise tiles (a 128 x 128
        tile over 8 heads is too small for XLA:CPU to run near its matmul speed; 256 x 512
        tiles ran full attention ~1.5x faster). A coarse tile is skipped when every block in
        it is empty, runs unmasked when every one is full, and otherwise shows exactly what
        the fine tables show: full blocks, partial blocks where ``mask_mod`` allows, nothing
        in empty blocks -- the same answer as visiting the fine blocks one by one."""
        from .attention import block_sizes

        fbq, fbk = self.bq, self.bk
        cbq, cbk = block_sizes(self.B * self.Hq, block_mask[-3] * self.tables[0][0].shape[2],
                               self.S)
        R, C = max(1, cbq // fbq), max(1, cbk // fbk)
        if R * C == 1 or cbq % fbq or cbk % fbk:
            return
        nqf = self.tables[0][0].shape[2]
        nkf = self.tables[0][1].shape[3] if self.tables[0][1].ndim == 4 else flash.cdiv(
            self.S, fbk)
        nkf = max(nkf, flash.cdiv(self.S, fbk))
        nqc, nkc = flash.cdiv(nqf, R), flash.cdiv(nkf, C)
        state = jnp.zeros((nqc * R, nkc * C + 1), jnp.int8)  # 0 empty, 1 partial, 2 full
        rows = jnp.arange(nqf)[:, None]
        for num, idx, masked in self.tables:
            n, ix = num[0, 0], idx[0, 0]
            live = jnp.arange(ix.shape[-1])[None, :] < n[:, None]
            cols = jnp.where(live, jnp.clip(ix, 0, nkc * C - 1), nkc * C)
            state = state.at[rows, cols].set(jnp.int8(1 if masked else 2))
        state = state[:, :nkc * C]
        tiles = state.reshape(nqc, R, nkc, C)
        full = jnp.all(tiles == 2, axis=(1, 3))
        partial = jnp.any(tiles != 0, axis=(1, 3)) & ~full
        self.fine = (state, R, C, fbq, fbk)
        self.bq, self.bk, self.nk = R * fbq, C * fbk, nkc
        self.coarse = []
        for sel, masked in ((partial, True), (full, False)):
            order = jnp.argsort(~sel, axis=1, stable=True).astype(jnp.int32)
            self.coarse.append((jnp.sum(sel, axis=1), order, masked))

    def _fine_visible(self, i, j):
        """(bq, bk): what the fine tables show inside coarse tile (i, j): 2 full, 1 partial."""
        state, R, C, fbq, fbk = self.fine
        st = jax.lax.dynamic_slice(state, (jnp.int32(i) * R, jnp.int32(j) * C), (R, C))
        return jnp.repeat(jnp.repeat(st, fbq, axis=0), fbk, axis=1)

    # -- which blocks
    def phases(self, i):
        if self.fine is not None:
            return [(0, cnt[i], (lambda t, order=order: (order[i, t], None)), masked)
                    for cnt, order, masked in self.coarse]
        out = []
        for num, idx, masked in self.tables:
            n_i = num[:, :, i]
            if num.shape[0] == 1 and num.shape[1] == 1:
                def block(t, idx=idx):
                    return jnp.clip(idx[0, 0, i, t], 0, self.nk - 1).astype(jnp.int32), None

                out.append((0, n_i[0, 0], block, masked))
                continue
            nb = jnp.broadcast_to(n_i, (self.B, self.Hq)).reshape(self.B, self.Hk, self.G)

            def block(t, idx=idx, nb=nb):
                j = jnp.broadcast_to(idx[:, :, i, t], (self.B, self.Hq))
                j = jnp.clip(j, 0, self.nk - 1).astype(jnp.int32)
                return j.reshape(self.B, self.Hk, self.G), t < nb

            out.append((0, jnp.max(nb), block, masked))
        return out

    # -- indices of a tile
    def _idx(self, i, j, dts):
        bq, bk = self.bq, self.bk
        b = jnp.arange(self.B).astype(dts[0])
        h = jnp.arange(self.Hq).astype(dts[1])
        m = (i * bq + jnp.arange(bq)).astype(dts[2])
        if jnp.ndim(j) == 0:
            n = (j * bk + jnp.arange(bk)).astype(dts[3])
            n_axes = (0, None, None, None)
        else:
            n = (j.reshape(self.B, self.Hq)[..., None] * bk + jnp.arange(bk)).astype(dts[3])
            n_axes = (0, None, 0, 0)
        return (b, h, m, n), n_axes

    def _visible(self, i, j, masked):
        (b, h, m, n), n_axes = self._idx(i, j, self.mask_dt)
        if jnp.ndim(j) == 0 and not self.mask_reads_bh:
            b, h = b[:1], h[:1]  # (1, 1, bq, bk), broadcast over (batch, head)
        vis = None
        if self.S % self.bk:
            vis = n < self.S if jnp.ndim(j) == 0 else (n < self.S)[:, :, None, :]
        if masked:
            def f(b_, h_, m_, n_, *bufs):
                return jnp.asarray(run_subgraph(self.mask_gm, b_, h_, m_, n_, *bufs), jnp.bool_)

            mm = _nest(f, [_B, _H, _Q, n_axes] + [_NONE] * len(self.mask_bufs))(
                b, h, m, n, *self.mask_bufs)
            if self.fine is not None:
                fs = self._fine_visible(i, j)
                mm = (fs == 2) | ((fs == 1) & mm)
            vis = mm if vis is None else (vis & mm)
        return vis

    def _score(self, s4, i, j, bufs):
        (b, h, m, n), n_axes = self._idx(i, j, self.score_dt)
        return _nest(_score_fn(self.score_gm, self.wp), [_ALL, _B, _H, _Q, n_axes] + self._axes)(
            s4, b, h, m, n, *bufs)

    def _shape4(self, s):
        return s.reshape(self.B, self.Hq, self.bq, self.bk)

    def scores(self, s, i, j, masked):
        post = self._score(self._shape4(s), i, j, self.score_bufs)
        vis = self._visible(i, j, masked)
        if vis is not None:
            post = jnp.where(vis, post, -jnp.inf)
        return post.reshape(s.shape)

    def scores_vjp(self, s, i, j, masked, ds, extra):
        s4, ds4 = self._shape4(s), self._shape4(ds).astype(self.wp)
        if self.need:
            def f(s_, *gb):
                bufs = list(self.score_bufs)
                for k, g_ in zip(self.need, gb):
                    bufs[k] = g_
                return self._score(s_, i, j, bufs)

            _, pull = jax.vjp(f, s4, *[self.score_bufs[k] for k in self.need])
            grads = pull(ds4)
            g = grads[0]
            extra = tuple(e + gb.astype(e.dtype) for e, gb in zip(extra, grads[1:]))
        else:
            (b, h, m, n), n_axes = self._idx(i, j, self.score_dt)
            g = _nest(_joint_fn(self.joint, self.wp),
                      [_ALL, _B, _H, _Q, n_axes, _ALL] + self._axes)(
                s4, b, h, m, n, ds4, *self.score_bufs)
        vis = self._visible(i, j, masked)
        if vis is not None:
            g = jnp.where(vis, g, 0)
        return g.reshape(s.shape), extra


def _use_blocked(query, key) -> bool:
    from .attention import DENSE_MAX_ELEMENTS

    B, H, L, _ = query.shape
    return B * H * L * key.shape[2] > DENSE_MAX_ELEMENTS


def _layout(query, key, value):
    B, Hq, L, E = query.shape
    Bkv, Hk, S, _ = key.shape
    if not (B == Bkv or (B > 1 and Bkv == 1)):
        raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={B} and Bkv={Bkv}")
    G = Hq // Hk
    k = jnp.broadcast_to(key, (B,) + key.shape[1:])
    v = jnp.broadcast_to(value, (B,) + value.shape[1:])
    return query.reshape(B, Hk, G, L, E), k, v, G


def _blocked_forward(query, key, value, score_mod, block_mask, scale, score_bufs, mask_bufs):
    B, Hq, L, E = query.shape
    qn, k, v, G = _layout(query, key, value)
    wp = _wp(query.dtype)
    plan = _FlexPlan(B=B, Hk=k.shape[1], G=G, S=k.shape[2], bq=block_mask[-3],
                     bk=block_mask[-2], block_mask=block_mask, score_gm=score_mod,
                     score_bufs=score_bufs, mask_bufs=mask_bufs, wp=wp)
    out, lse, mx = flash.forward(qn, k, v, scale=scale, bq=plan.bq, bk=plan.bk, plan=plan,
                                 acc=wp)
    shp = (B, Hq, L)
    return (out.reshape(shp + (value.shape[-1],)).astype(query.dtype),
            lse.astype(wp).reshape(shp) / LN2, mx.reshape(shp) / LN2)


def _blocked_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                      joint_graph, block_mask, scale, score_bufs, mask_bufs):
    B, Hq, L, E = query.shape
    Bkv = key.shape[0]
    qn, k, v, G = _layout(query, key, value)
    Hk = k.shape[1]
    wp = _wp(query.dtype)
    need = _buffers_needing_grad(joint_graph, len(score_bufs))
    plan = _FlexPlan(B=B, Hk=Hk, G=G, S=k.shape[2], bq=block_mask[-3], bk=block_mask[-2],
                     block_mask=block_mask, score_gm=fw_graph, score_bufs=score_bufs,
                     mask_bufs=mask_bufs, wp=wp, joint=joint_graph, need=need)
    shp = (B, Hk, G, L)
    if grad_out is None:
        grad_out = jnp.zeros_like(out)
    glse = None if grad_logsumexp is None else (grad_logsumexp / LN2).reshape(shp)
    dq, dk, dv, extra = flash.backward(
        grad_out.reshape(shp + (-1,)), qn, k, v, out.reshape(shp + (-1,)),
        (logsumexp * LN2).reshape(shp), scale=scale, bq=plan.bq, bk=plan.bk, plan=plan,
        acc=wp, grad_lse=glse)
    if Bkv != B:
        dk, dv = jnp.sum(dk, 0, keepdims=True), jnp.sum(dv, 0, keepdims=True)
    buf_grads = [None] * len(score_bufs)
    for k_, g_ in zip(need, extra):
        buf_grads[k_] = g_.astype(score_bufs[k_].dtype)
    return (dq.reshape(query.shape).astype(query.dtype), dk.astype(key.dtype),
            dv.astype(value.dtype), tuple(buf_grads))


@register_hop(_hop.flex_attention)
def flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                   score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """-> (out, logsumexp / ln 2, max / ln 2)."""
    score_bufs, mask_bufs = tuple(score_mod_other_buffers), tuple(mask_mod_other_buffers)
    if _use_blocked(query, key):
        return _blocked_forward(query, key, value, score_mod, block_mask, scale, score_bufs,
                                mask_bufs)
    return _dense_forward(query, key, value, score_mod, block_mask, scale, score_bufs,
                          mask_bufs)


@register_hop(_hop.flex_attention_backward)
def flex_attention_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                            fw_graph, joint_graph, block_mask, scale, kernel_options,
                            score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """-> (dq, dk, dv, grads of score_mod's captured tensors)."""
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"Backward pass with mixed query, key, and value dtype is not supported, "
            f"got query.dtype={query.dtype}, key.dtype={key.dtype}, "
            f"and value.dtype={value.dtype}")
    if joint_graph is None:
        raise NotImplementedError("flex_attention_backward on 'tpu' needs the joint graph")
    args = (query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
            block_mask, scale, tuple(score_mod_other_buffers), tuple(mask_mod_other_buffers))
    if _use_blocked(query, key):
        return _blocked_backward(*args)
    return _dense_backward(*args)
