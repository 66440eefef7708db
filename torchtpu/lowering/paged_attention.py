"""Paged (ragged) attention over a paged KV cache, and the KV-cache write: pure JAX.

These are the lowerings behind ``torch.tpu.ops.ragged_paged_attention`` and
``torch.tpu.ops.kv_cache_update_`` (``torchtpu/ops/paged_attention.py`` defines the torch ops
and registers these functions in the table). They follow the layout of the Pallas kernel that
JAX ships (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``), so the same arrays feed
either:

- ``kv_pages``: ``[num_pages, page_size, 2 * num_kv_heads, head_dim]``, keys and values
  interleaved along the head axis (``kv_pages[..., 0::2, :]`` are the keys);
- ``q``: ``[num_tokens, num_q_heads, head_dim]``, the queries of every sequence, concatenated;
- ``cu_q_lens``: int32 ``[max_seqs + 1]``, where each sequence's queries start;
- ``kv_lens``: int32 ``[max_seqs]``, each sequence's length in the cache *including* the new
  tokens (query i of a sequence sits at position ``kv_len - q_len + i``, causal);
- ``page_indices``: int32 ``[max_seqs, pages_per_seq]``, each sequence's pages in order;
- ``num_seqs``: int32 ``[1]``, how many of the ``max_seqs`` rows are real.

Tokens past ``cu_q_lens[num_seqs]`` (padding up to a compiled bucket) get zeros.

``impl`` picks the implementation (a static argument, part of every cache key):
- ``"xla"``: the portable lowering below, for every PJRT device. It walks the KV positions in
  blocks of pages (a ``while_loop`` bounded by the longest sequence in the batch, not by the
  cache size), gathers each token's pages of the block and keeps an online softmax, so its
  memory is O(tokens x block) and its time does not grow with the number of pages in the
  cache;
- ``"pallas_tpu"``: JAX's Pallas TPU kernel (needs head counts the kernel can tile);
- ``"pallas_gpu"``: JAX's Pallas GPU decode kernel (``pallas.ops.gpu.paged_attention``)
  where every sequence has one query (a decode step), the portable path otherwise (chosen on
  the device with ``lax.cond``);
- ``"cpu"``: torchtpu's C++ kernel for XLA:CPU (``runtime/cpu_paged_attention.cc``, an XLA
  FFI custom call): each token reads its pages in place with an online softmax, where the
  portable path gathers and reorders them (the decode step's largest cost on XLA:CPU). The
  portable path is its reference; float32 and bfloat16 (other dtypes, a non-positive sliding
  window or a zero soft cap take the portable path);
- ``"auto"``: the Pallas kernel of the platform the arrays live on where it applies, on the CPU
  ``"cpu"`` when the kernel can be built and is not switched off
  (``TORCHTPU_CPU_ATTENTION_KERNEL=0``), else ``"xla"``.
``interpret=True`` runs a Pallas path in interpret mode (CPU tests of the TPU/GPU paths).
"""
from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..runtime import cpu_kernels
from . import registry

_NEG = -0.7 * float(np.finfo(np.float32).max)  # JAX's kernels' DEFAULT_MASK_VALUE
IMPLS = ("auto", "xla", "pallas_tpu", "pallas_gpu", "cpu")


def _precision(dtype):
    if dtype != jnp.float32:
        return None
    p = registry.matmul_precision()
    return {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH}.get(p)


def _block_pages(pages_per_seq: int, page_size: int, positions: int = 128) -> int:
    """Pages per step of the portable loop: about ``positions`` KV positions."""
    return max(1, min(pages_per_seq, -(-positions // page_size)))


# KV positions per work item of the per-token (decode) path: each token gathers its own pages,
# so a larger item wastes more past each sequence's end (XLA:CPU, 32 decode tokens of
# 100..260 positions: 128 -> 32 positions per block took the attention from ~7.9 to ~3.2 ms
# of CPU time; 16, 32 and 64 cost the same with the work list).
TOKEN_BLOCK = 32
# Work items a step of the per-token loop takes: 8 items of 32 positions are 256 KiB of
# gathered keys and values (float32, 2 KV heads of 64), which stay in cache for the matrix
# products that read them; T = 32 items a step (1 MiB) cost ~22% more CPU for 32 decode
# tokens of 33..248 positions on XLA:CPU (2.25 -> 1.75 ms a layer, load 10; 16 items: 2.11).
TOKEN_ITEMS = 8


def _gather_heads(kv_pages, pidx, heads):
    """``kv_pages[pidx[..., j], :, heads[h], :]`` laid out ``[..., H, bp * page, D]`` (the
    layout the attention's matrix products take, so no transpose follows): one gather whose
    slices are (page, head) rows of D, for the keys (even heads) or the values (odd)."""
    P, page, _, D = kv_pages.shape
    bp = pidx.shape[-1]
    lead = pidx.shape[:-1]
    H = heads.shape[0]
    pg = jnp.broadcast_to(jnp.clip(pidx, 0, P - 1)[..., None, :], lead + (H, bp))
    hh = jnp.broadcast_to(heads[:, None], lead + (H, bp))
    n = len(lead) + 2
    dn = lax.GatherDimensionNumbers(offset_dims=(n, n + 1), collapsed_slice_dims=(0, 2),
                                    start_index_map=(0, 2))
    out = lax.gather(kv_pages, jnp.stack([pg, hh], -1), dn, (1, page, 1, D),
                     mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return out.reshape(lead + (H, bp * page, D))


def token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens):
    """(sequence of each token, its position in its sequence, real-token mask)."""
    max_seqs = kv_lens.shape[0]
    n = num_seqs.reshape(-1)[0].astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    end = cu[jnp.clip(n, 0, max_seqs)]
    cu = jnp.where(jnp.arange(max_seqs + 1) <= n, cu, end)  # rows past num_seqs: empty
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    valid = t < end
    q_len = cu[seq + 1] - cu[seq]
    pos = kv_lens.astype(jnp.int32)[seq] - q_len + (t - cu[seq])
    return seq, pos, valid


def _key_mask(b, L, pos, valid, sliding_window):
    """[T, L]: which keys of key block ``b`` (L tokens) each query token at ``pos`` attends."""
    j = b * L + jnp.arange(L, dtype=jnp.int32)
    ok = (j[None, :] <= pos[:, None]) & valid[:, None]
    if sliding_window is not None:
        ok = ok & (j[None, :] > pos[:, None] - sliding_window)
    return ok


def _run_blocks(body, start_blk, nblk, valid, shape, Hq):
    """The online-softmax loop over key blocks [start_blk, nblk) and its normalisation:
    ``body(b, (m, l, acc))`` adds block ``b``; rows of invalid tokens are zeros."""
    T, Hkv, G, D = shape
    m0 = jnp.full((T, Hkv, G), _NEG, jnp.float32)
    l0 = jnp.zeros((T, Hkv, G), jnp.float32)
    a0 = jnp.zeros((T, Hkv, G, D), jnp.float32)
    _, l, acc = lax.fori_loop(start_blk, nblk, body, (m0, l0, a0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.where(valid[:, None, None, None], out, 0.0).reshape(T, Hq, D)


def _per_token_attention(q, kv_pages, rows, pos, valid, sm_scale, sliding_window, soft_cap,
                         bp, nblk_max):
    """Attention of tokens that may belong to different sequences (a block of decode tokens),
    each token walking only its own key blocks. The (token, key block) pairs the tokens need
    form a work list, token-major, taken ``TOKEN_ITEMS`` a step (fixed shapes); an item's pages
    are gathered whole (contiguous rows of the cache: keys and values together), its partial
    softmax (max, sum, weighted values) computed, and the partials merged into each token's
    running state (scatter max / add). So a step's gathers hold the keys the tokens attend to,
    rounded up to ``bp`` pages per token, not ``T`` x the longest sequence of the block."""
    T, Hq, D = q.shape
    _, page, H2, _ = kv_pages.shape
    Hkv = H2 // 2
    G = Hq // Hkv
    L = bp * page
    prec = _precision(q.dtype)
    qf = q.reshape(T, Hkv, G, D)
    flat = kv_pages.reshape(kv_pages.shape[0], page * H2 * D)  # a page per row
    last_blk = jnp.where(valid, pos // L, -1)
    first_blk = jnp.zeros_like(last_blk)
    if sliding_window is not None:  # blocks wholly left of the token's window are skipped
        first_blk = jnp.clip((pos - sliding_window + 1) // L, 0, None)
    nb = jnp.clip(last_blk - first_blk + 1, 0, nblk_max).astype(jnp.int32)
    ends = jnp.cumsum(nb)
    starts = ends - nb
    total = ends[-1]
    W = min(T, TOKEN_ITEMS)

    def body(c, carry):
        m, l, acc = carry
        i = c * W + jnp.arange(W, dtype=jnp.int32)  # this step's items
        live = i < total
        tok = jnp.clip(jnp.searchsorted(ends, i, side="right", method="compare_all"),
                       0, T - 1).astype(jnp.int32)
        blk = first_blk[tok] + i - starts[tok]
        pidx = jnp.take_along_axis(rows[tok], blk[:, None] * bp + jnp.arange(bp)[None, :],
                                   axis=1, mode="clip")  # [W, bp]
        kv = jnp.take(flat, pidx, axis=0, mode="clip").reshape(W, L, Hkv, 2, D)
        k, v = kv[..., 0, :], kv[..., 1, :]  # [W, L, Hkv, D]
        sc = jnp.einsum("ckgd,clkd->ckgl", qf[tok], k, preferred_element_type=jnp.float32,
                        precision=prec) * sm_scale
        if soft_cap is not None:
            sc = soft_cap * jnp.tanh(sc / soft_cap)
        j = blk[:, None] * L + jnp.arange(L, dtype=jnp.int32)[None, :]
        ptok = pos[tok][:, None]
        ok = (j <= ptok) & live[:, None]
        if sliding_window is not None:
            ok = ok & (j > ptok - sliding_window)
        ok = ok[:, None, None, :]
        sc = jnp.where(ok, sc, _NEG)
        mi = sc.max(-1)  # [W, Hkv, G]
        p = jnp.where(ok, jnp.exp(sc - mi[..., None]), 0.0)
        ai = jnp.einsum("ckgl,clkd->ckgd", p.astype(v.dtype) if v.dtype != jnp.float32 else p,
                        v, preferred_element_type=jnp.float32, precision=prec)
        dst = jnp.where(live, tok, T)  # items past the list: dropped
        m_new = m.at[dst].max(mi, mode="drop")
        alpha = jnp.exp(m - m_new)
        beta = jnp.exp(mi - m_new[tok])
        l = (l * alpha).at[dst].add(p.sum(-1) * beta, mode="drop")
        acc = (acc * alpha[..., None]).at[dst].add(ai * beta[..., None], mode="drop")
        return m_new, l, acc

    m0 = jnp.full((T, Hkv, G), _NEG, jnp.float32)
    l0 = jnp.zeros((T, Hkv, G), jnp.float32)
    a0 = jnp.zeros((T, Hkv, G, D), jnp.float32)
    _, l, acc = lax.fori_loop(0, (total + W - 1) // W, body, (m0, l0, a0))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.where(valid[:, None, None, None], out, 0.0).reshape(T, Hq, D)


def _one_sequence_attention(q, kv_pages, row, pos, valid, sm_scale, sliding_window, soft_cap,
                            bp, nblk_max):
    """Attention of tokens of one sequence (a prefill chunk): its pages are gathered once per
    block and every query attends to them in one matrix product."""
    T, Hq, D = q.shape
    _, page, H2, _ = kv_pages.shape
    Hkv = H2 // 2
    G = Hq // Hkv
    L = bp * page
    prec = _precision(q.dtype)
    qf = q.reshape(T, Hkv, G, D)
    last = jnp.max(jnp.where(valid, pos, -1))
    nblk = jnp.clip(last // L + 1, 0, nblk_max)
    start_blk = jnp.zeros((), jnp.int32)
    if sliding_window is not None:
        first = jnp.min(jnp.where(valid, pos - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        start_blk = jnp.clip(first // L, 0, nblk)

    heads = 2 * jnp.arange(Hkv, dtype=jnp.int32)

    def body(b, carry):
        m, l, acc = carry
        pidx = lax.dynamic_slice_in_dim(row, b * bp, bp)  # [bp]
        k = _gather_heads(kv_pages, pidx, heads)  # [Hkv, L, D]
        v = _gather_heads(kv_pages, pidx, heads + 1)
        sc = jnp.einsum("tkgd,kld->tkgl", qf, k, preferred_element_type=jnp.float32,
                        precision=prec) * sm_scale
        ok = _key_mask(b, L, pos, valid, sliding_window)
        return _online_step(m, l, acc, sc, ok[:, None, None, :], v, soft_cap, prec,
                            "tkgl,kld->tkgd")

    return _run_blocks(body, start_blk, nblk, valid, (T, Hkv, G, D), Hq)


def _online_step(m, l, acc, sc, ok, v, soft_cap, prec, pv_spec):
    if soft_cap is not None:
        sc = soft_cap * jnp.tanh(sc / soft_cap)
    sc = jnp.where(ok, sc, _NEG)
    m_new = jnp.maximum(m, sc.max(-1))
    p = jnp.where(ok, jnp.exp(sc - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(-1)
    pv = jnp.einsum(pv_spec, p.astype(v.dtype) if v.dtype != jnp.float32 else p, v,
                    preferred_element_type=jnp.float32, precision=prec)
    return m_new, l, acc * alpha[..., None] + pv


Q_BLOCK = 32  # queries per block of the portable path


def ragged_paged_attention_xla(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale=1.0, sliding_window=None, soft_cap=None):
    """The portable path: queries in blocks of ``Q_BLOCK``; a block whose tokens all belong to
    one sequence (prefill chunks) attends to that sequence's pages with matrix products, any
    other block (decode tokens of many sequences) gathers each token's pages (chosen on the
    device with ``lax.cond``). KV positions are walked in blocks (~128 positions for a
    sequence's block, ``TOKEN_BLOCK`` for per-token gathers) up to the block's last position:
    time and memory do not grow with the cache."""
    T, Hq, D = q.shape
    _, page, H2, _ = kv_pages.shape
    _, pps = page_indices.shape
    bp = _block_pages(pps, page)
    bp_tok = _block_pages(pps, page, TOKEN_BLOCK)
    width = -(-pps // math.lcm(bp, bp_tok)) * math.lcm(bp, bp_tok)
    pidx_all = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, width - pps)))
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, num_seqs, T)
    Bq = min(Q_BLOCK, T)
    nq = -(-T // Bq)
    pad = nq * Bq - T
    if pad:
        q = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
        seq = jnp.pad(seq, (0, pad))
        pos = jnp.pad(pos, (0, pad))
        valid = jnp.pad(valid, (0, pad))
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    by_seq = dict(kw, bp=bp, nblk_max=width // bp)
    tok = dict(kw, bp=bp_tok, nblk_max=width // bp_tok)

    def block(j):
        sl = lambda x: lax.dynamic_slice_in_dim(x, j * Bq, Bq)  # noqa: E731
        qb, sb, pb, vb = sl(q), sl(seq), sl(pos), sl(valid)
        s0 = sb[0]
        one = jnp.all(jnp.where(vb, sb == s0, True))
        return lax.cond(
            jnp.any(vb),
            lambda: lax.cond(
                one,
                lambda: _one_sequence_attention(qb, kv_pages, pidx_all[s0], pb, vb, **by_seq),
                lambda: _per_token_attention(qb, kv_pages, pidx_all[sb], pb, vb, **tok)),
            lambda: jnp.zeros((Bq, Hq, D), jnp.float32))

    out = lax.map(block, jnp.arange(nq))
    return out.reshape(nq * Bq, Hq, D)[:T].astype(q.dtype)


def dense_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0,
                    sliding_window=None, soft_cap=None):
    """Per-sequence dense attention on concrete (numpy) inputs: the tests' reference."""
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv_pages, np.float64)
    T, Hq, D = q.shape
    Hkv = kv.shape[2] // 2
    G = Hq // Hkv
    out = np.zeros_like(q)
    cu = np.asarray(cu_q_lens)
    for s in range(int(np.asarray(num_seqs).reshape(-1)[0])):
        a, b = int(cu[s]), int(cu[s + 1])
        kvl = int(np.asarray(kv_lens)[s])
        pages = np.asarray(page_indices)[s]
        seqkv = kv[pages].reshape(-1, 2 * Hkv, D)[:kvl]
        k, v = seqkv[:, 0::2], seqkv[:, 1::2]
        k = np.repeat(k, G, axis=1)
        v = np.repeat(v, G, axis=1)
        qs = q[a:b]
        sc = np.einsum("qhd,khd->hqk", qs, k) * sm_scale
        if soft_cap is not None:
            sc = soft_cap * np.tanh(sc / soft_cap)
        qpos = kvl - (b - a) + np.arange(b - a)
        kpos = np.arange(kvl)
        mask = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > qpos[:, None] - sliding_window
        sc = np.where(mask[None], sc, -np.inf)
        sc = sc - sc.max(-1, keepdims=True)
        p = np.exp(sc)
        p /= p.sum(-1, keepdims=True)
        out[a:b] = np.einsum("hqk,khd->qhd", p, v)
    return out


# ---- Pallas paths ----

def _pallas_tpu_applies(q, kv_pages) -> bool:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as _k

    try:
        _k.get_min_heads_per_blk(q.shape[1], kv_pages.shape[2], q.dtype, kv_pages.dtype)
    except (ValueError, AssertionError):
        return False
    # its softmax statistics are 128 lanes wide and broadcast over head_dim
    return q.shape[1] % (kv_pages.shape[2] // 2) == 0 and q.shape[2] % 128 == 0


@contextlib.contextmanager
def _interpret_mode(params):
    """Every ``pallas_call`` traced inside runs in interpret mode (``params``: True for Pallas'
    discharge interpreter, or a ``pltpu.InterpretParams``)."""
    from jax._src import config as _config

    prev = _config.pallas_tpu_interpret_mode_context_manager.swap_local(params)
    try:
        yield
    finally:
        _config.pallas_tpu_interpret_mode_context_manager.set_local(prev)


def ragged_paged_attention_pallas_tpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      *, sm_scale=1.0, sliding_window=None, soft_cap=None,
                                      interpret=False):
    """JAX's Pallas TPU kernel; padding tokens zeroed as the portable path does."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as _k

    T = q.shape[0]
    args = (q, kv_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
            cu_q_lens.astype(jnp.int32), num_seqs.reshape(1).astype(jnp.int32))
    kw = dict(sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap)
    # the kernel's index arithmetic mixes int32 refs with Python ints: 32-bit mode only
    with jax.enable_x64(False):
        if interpret:
            from jax.experimental.pallas import tpu as pltpu

            # small blocks: interpret mode simulates every DMA; tiny test shapes need them
            kw.update(num_kv_pages_per_block=1, num_queries_per_block=min(8, T))
            from torchtpu.lowering import pallas_interpret

            with _interpret_mode(pltpu.InterpretParams()):
                out = pallas_interpret.call(_k.ragged_paged_attention, *args, **kw)
        else:
            out = _k.ragged_paged_attention(*args, **kw)
    _, _, valid = token_layout(cu_q_lens, kv_lens, num_seqs, T)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def ragged_paged_attention_pallas_gpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      *, sm_scale=1.0, sliding_window=None, soft_cap=None,
                                      interpret=False):
    """JAX's Pallas GPU paged decode kernel when every sequence has one query token (checked
    on the device), the portable path otherwise. The kernel wants a head-major cache, so only
    the pages the batch references are gathered and transposed (O(batch x context), the
    attention's own order), never the whole cache."""
    if sliding_window is not None:
        return ragged_paged_attention_xla(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap)
    from jax.experimental.pallas.ops.gpu import paged_attention as _g

    T, Hq, D = q.shape
    _, page, H2, _ = kv_pages.shape
    Hkv = H2 // 2
    S, pps = page_indices.shape
    n = num_seqs.reshape(-1)[0].astype(jnp.int32)
    live = jnp.arange(S) < n
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    decode = jnp.all(jnp.where(live, q_lens == 1, True)) & (n <= T)

    def dec(_):
        B = min(S, T)
        kv = jnp.take(kv_pages, page_indices[:B].astype(jnp.int32), axis=0, mode="clip")
        kv = kv.reshape(B * pps, page, Hkv, 2, D)  # [pages, page, kv head, k|v, D]
        k_pages = jnp.transpose(kv[..., 0, :], (2, 0, 1, 3))
        v_pages = jnp.transpose(kv[..., 1, :], (2, 0, 1, 3))
        tables = jnp.arange(B * pps, dtype=jnp.int32).reshape(B, pps)
        lens = jnp.where(live[:B], kv_lens[:B], 0).astype(jnp.int32)
        # row b of q is sequence b's token (decode: cu_q_lens[b] == b)
        qs = (q[:B].astype(jnp.float32) * sm_scale).astype(q.dtype)
        ppcb = max(1, min(pps, 8))
        while pps % ppcb:
            ppcb -= 1
        with jax.enable_x64(False):
            out = _g.paged_attention(qs, k_pages, v_pages, tables, lens,
                                     block_h=16, pages_per_compute_block=ppcb,
                                     k_splits=1, interpret=interpret,
                                     attn_logits_soft_cap=soft_cap)
        out = jnp.where((lens > 0)[:, None, None], out, 0).astype(q.dtype)
        return jnp.zeros_like(q).at[:B].set(out)

    def ragged(_):
        return ragged_paged_attention_xla(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale, soft_cap=soft_cap)

    return lax.cond(decode, dec, ragged, None)


def ragged_paged_attention_cpu(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale=1.0, sliding_window=None, soft_cap=None):
    """The C++ kernel (an FFI custom call, XLA:CPU only) where it applies, else the portable
    path. Raises if the kernel cannot be built in this process."""
    if q.dtype not in (jnp.float32, jnp.bfloat16) or kv_pages.dtype != q.dtype or \
            (sliding_window is not None and sliding_window <= 0) or \
            (soft_cap is not None and soft_cap == 0):
        return ragged_paged_attention_xla(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale,
                                          sliding_window=sliding_window, soft_cap=soft_cap)
    cpu_kernels.prepare("paged_attention")
    call = jax.ffi.ffi_call(cpu_kernels.target("paged_attention"),
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = lambda x: x.astype(jnp.int32)  # noqa: E731
    out = call(q, kv_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens),
               i32(num_seqs.reshape(1)), sm_scale=np.float32(sm_scale),
               sliding_window=np.int32(sliding_window or 0),
               soft_cap=np.float32(abs(soft_cap or 0.0)))  # c * tanh(x / c) is even in c
    return out.astype(q.dtype)


def _platform_of(x) -> str:
    sh = getattr(x, "sharding", None)
    if sh is not None:
        try:
            return next(iter(sh.device_set)).platform
        except Exception:  # noqa: BLE001 - a tracer under jit: the default backend decides
            pass
    from ..runtime import devices

    return devices.platform()


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                           sm_scale=1.0, sliding_window=None, soft_cap=None, impl="auto",
                           interpret=False):
    if impl not in IMPLS:
        raise ValueError(f"ragged_paged_attention: impl must be one of {IMPLS}, got {impl!r}")
    if q.ndim != 3 or kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or \
            q.shape[2] != kv_pages.shape[3] or q.shape[1] % (kv_pages.shape[2] // 2):
        raise ValueError(
            "ragged_paged_attention: expected q [tokens, q_heads, head_dim] and kv_pages "
            "[pages, page_size, 2 * kv_heads, head_dim] with q_heads a multiple of kv_heads, "
            f"got q {tuple(q.shape)} and kv_pages {tuple(kv_pages.shape)}")
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if impl == "auto":
        plat = _platform_of(kv_pages)
        if plat == "tpu" and _pallas_tpu_applies(q, kv_pages):
            impl = "pallas_tpu"
        elif plat in ("gpu", "cuda", "rocm"):
            impl = "pallas_gpu"
        elif plat == "cpu" and cpu_kernels.available("paged_attention"):
            impl = "cpu"
        else:
            impl = "xla"
    if impl == "pallas_tpu":
        return ragged_paged_attention_pallas_tpu(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                                 num_seqs, interpret=interpret, **kw)
    if impl == "pallas_gpu":
        return ragged_paged_attention_pallas_gpu(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                                 num_seqs, interpret=interpret, **kw)
    if impl == "cpu":
        return ragged_paged_attention_cpu(q, kv_pages, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, **kw)
    return ragged_paged_attention_xla(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      **kw)


def kv_cache_update(kv_pages, key, value, slot_mapping):
    """``kv_pages`` with token t's key and value written at slot ``slot_mapping[t]`` (page
    ``slot // page_size``, row ``slot % page_size``); a negative slot writes nothing (padding).
    Under donation XLA updates the cache in place: the cost is the tokens written."""
    P, page, H2, D = kv_pages.shape
    T = key.shape[0]
    kv = jnp.stack([key, value], axis=2).reshape(T, H2, D).astype(kv_pages.dtype)
    slots = slot_mapping.astype(jnp.int32)
    slots = jnp.where(slots >= 0, slots, P * page)  # out of range: dropped
    # scattered at (page, row) into the 4-D cache itself: through a flattened [slots, H2, D]
    # view, a page size of 1 (SGLang's default) leaves XLA a reshape whose size-1 dimension
    # it may lay out differently, and it then copies the whole cache on every write
    return kv_pages.at[slots // page, slots % page].set(kv, mode="drop", unique_indices=False)


def kv_cache_update_check(kv_pages, key, value, slot_mapping):
    """Inputs valid: every slot below the cache's (negative ones are padding)."""
    P, page = kv_pages.shape[:2]
    return jnp.all(slot_mapping < P * page)

