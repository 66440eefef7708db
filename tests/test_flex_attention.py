"""FlexAttention on "tpu": eager (PyTorch's math implementation, admitted by the device
allowlist patch in torchtpu/integrations/flex_attention.py) and torch.compile (the
flex_attention / flex_attention_backward HOP lowerings, torchtpu/lowering/flex_attention.py),
against an independent CPU reference written with plain PyTorch ops (and CPU FlexAttention
itself for the forward), float32 tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

B, H, L, E = 2, 2, 128, 16
TOL = dict(rtol=1e-5, atol=1e-5)


def causal(b, h, q, kv):
    return q >= kv


def rel_bias(score, b, h, q, kv):
    return score + 0.01 * (q - kv) - 0.1 * h


def inputs(seed=0, hkv=H):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g)
    k = torch.randn(B, hkv, L, E, generator=g)
    v = torch.randn(B, hkv, L, E, generator=g)
    return q, k, v


def reference(q, k, v, doc=None):
    """causal (and same-document) attention with rel_bias, plain PyTorch on CPU."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) / E ** 0.5
    i = torch.arange(L)
    hh = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    s = s + 0.01 * (i.view(-1, 1) - i.view(1, -1)) - 0.1 * hh
    mask = i.view(-1, 1) >= i.view(1, -1)
    if doc is not None:
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def _run(fn, q, k, v, bm, grad=True):
    qt, kt, vt = (x.to("tpu").requires_grad_(grad) for x in (q, k, v))
    out, aux = fn(qt, kt, vt, score_mod=rel_bias, block_mask=bm,
                  enable_gqa=k.shape[1] != q.shape[1], return_aux=AuxRequest(lse=True))
    if not grad:
        return out.cpu(), aux.lse.cpu(), None
    (out.square().sum() + aux.lse.sum()).backward()
    return out.cpu(), aux.lse.cpu(), [t.grad.cpu() for t in (qt, kt, vt)]


def _check(res, q, k, v, doc=None):
    out, lse, grads = res
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, ref_lse = reference(qr, kr, vr, doc)
    torch.testing.assert_close(out, ref.detach(), **TOL)
    torch.testing.assert_close(lse, ref_lse.detach(), **TOL)
    if grads is not None:
        (ref.square().sum() + ref_lse.sum()).backward()
        for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_allowlist_admits_tpu_only():
    # PyTorch's own checks stay for every other device
    q = torch.randn(1, 1, 8, 4, device="meta")
    with pytest.raises(ValueError, match="only supported on CUDA, CPU"):
        fa._validate_device(q, q, q)
    t = torch.randn(1, 1, 8, 4, device="tpu")
    assert fa._validate_device(t, t, t) is None


def test_flex_attention_eager_and_compiled_match_cpu():
    """Causal block mask + score_mod, forward (and CPU FlexAttention's own forward), logsumexp
    and gradients, eager and torch.compile(backend="tpu")."""
    torch._dynamo.reset()
    q, k, v = inputs()
    bm = create_block_mask(causal, B, None, L, L, device="tpu")
    bm_cpu = create_block_mask(causal, B, None, L, L, device="cpu")
    with torch.no_grad():  # CPU FlexAttention itself (inference only on CPU)
        cpu_out = flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm_cpu)
    eager = _run(flex_attention, q, k, v, bm)
    torch.testing.assert_close(eager[0], cpu_out, **TOL)
    _check(eager, q, k, v)

    before = torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0)
    compiled_fn = torch.compile(flex_attention, backend="tpu")
    comp = _run(compiled_fn, q, k, v, bm)
    _check(comp, q, k, v)
    assert torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0) == before


@pytest.mark.parametrize("score_mod", [None, "rel_bias"])
def test_eager_flex_attention_without_a_block_mask(score_mod):
    """The tutorial call, ``flex_attention(q, k, v)`` (optionally with a score_mod) and no
    block mask, eagerly on "tpu": its default mask_mod came as a Dynamo graph of one
    ``new_ones`` method call and raised "FX node kind call_method in a subgraph"."""
    mod = rel_bias if score_mod else None
    q, k, v = inputs(seed=4)
    qt, kt, vt = (x.to("tpu").requires_grad_() for x in (q, k, v))
    out = flex_attention(qt, kt, vt, score_mod=mod)
    out.square().sum().backward()
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    s = qr @ kr.transpose(-2, -1) / E ** 0.5
    if mod is not None:
        i = torch.arange(L)
        s = s + 0.01 * (i.view(-1, 1) - i.view(1, -1)) - 0.1 * torch.arange(H).view(1, -1, 1, 1)
    ref = torch.softmax(s, -1) @ vr
    ref.square().sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL)
    for got, want in zip((qt, kt, vt), (qr, kr, vr)):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_flex_attention_gqa_and_captured_mask_match_cpu():
    """GQA through the compiled path; a mask_mod reading a captured tensor (document ids, as
    TorchTitan's block-causal mask), compiled and eager."""
    torch._dynamo.reset()
    bm = create_block_mask(causal, B, None, L, L, device="tpu")
    compiled_fn = torch.compile(flex_attention, backend="tpu")
    qg, kg, vg = inputs(1, hkv=1)  # grouped-query attention: 2 query heads per key head
    _check(_run(compiled_fn, qg, kg, vg, bm), qg, kg, vg)

    q, k, v = inputs()
    doc = torch.cat([torch.zeros(B, 100, dtype=torch.long), torch.ones(B, L - 100,
                                                                       dtype=torch.long)], 1)
    doc[1, :30] = 2
    doc_t = doc.to("tpu")

    def doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_t[b, q_idx] == doc_t[b, kv_idx])

    bm_doc = create_block_mask(doc_causal, B, None, L, L, device="tpu")
    _check(_run(compiled_fn, q, k, v, bm_doc), q, k, v, doc)
    _check(_run(flex_attention, q, k, v, bm_doc, grad=False), q, k, v, doc)


@pytest.mark.parametrize("compiled", [False, True])
def test_learned_score_mod_bias_gets_its_gradient(compiled):
    """A score_mod reading a learned tensor (PyTorch's joint graph scatters its gradient with
    flex_lib::zeros_and_scatter): the tpu lowerings differentiate the forward subgraph."""
    torch._dynamo.reset()
    q, k, v = inputs()
    bias = torch.linspace(-1, 1, L)
    res = {}
    for dev in ("cpu", "tpu"):
        qt, kt, vt, bt = (x.to(dev, copy=True).requires_grad_() for x in (q, k, v, bias))

        def learned(score, b, h, q_idx, kv_idx):
            return score + bt[kv_idx] * (h + 1)

        if dev == "cpu":  # the same math, plain PyTorch
            s = qt @ kt.transpose(-2, -1) / E ** 0.5 + bt * torch.arange(1, H + 1).view(
                1, -1, 1, 1)
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).tril().logical_not(),
                              float("-inf"))
            out = torch.softmax(s, -1) @ vt
        else:
            bm = create_block_mask(causal, B, None, L, L, device=dev)
            f = torch.compile(flex_attention, backend="tpu") if compiled else flex_attention
            out = f(qt, kt, vt, score_mod=learned, block_mask=bm)
        out.square().sum().backward()
        res[dev] = [out.detach().cpu()] + [t.grad.cpu() for t in (qt, kt, vt, bt)]
    for got, want in zip(res["tpu"], res["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------- blockwise, block-sparse lowering

LB = 2048  # B * H * LB * LB scores exceed the dense threshold: the blockwise kernel


def _big(seed=0, b=1, hq=2, hkv=2, n=LB):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, E, generator=g), torch.randn(b, hkv, n, E, generator=g),
            torch.randn(b, hkv, n, E, generator=g))


def _dense_reference(q, k, v, mask, score=None):
    """softmax((q k^T / sqrt(E)) [+ score_mod]) v with a dense boolean mask, and logsumexp."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) / E ** 0.5
    if score is not None:
        s = score(s)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _big_check(fn, q, k, v, mask, score=None, grad=True):
    qt, kt, vt = (x.to("tpu").requires_grad_(grad) for x in (q, k, v))
    out, aux = fn(qt, kt, vt, return_aux=AuxRequest(lse=True))
    qr, kr, vr = (x.clone().requires_grad_(grad) for x in (q, k, v))
    ref, ref_lse = _dense_reference(qr, kr, vr, mask, score)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), **TOL)
    torch.testing.assert_close(aux.lse.detach().cpu(), ref_lse.detach(), **TOL)
    if grad:
        (out.square().sum() + aux.lse.sum()).backward()
        (ref.square().sum() + ref_lse.sum()).backward()
        for got, want in zip((qt, kt, vt), (qr, kr, vr)):
            torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["strict", pytest.param("fused", marks=pytest.mark.slow),
                                  "compiled"])
def test_blockwise_causal_flex_matches_cpu(mode):
    torch._dynamo.reset()
    q, k, v = _big()
    bm = create_block_mask(causal, 1, None, LB, LB, device="tpu")
    f = torch.compile(flex_attention, backend="tpu") if mode == "compiled" else flex_attention
    i = torch.arange(LB)
    hh = torch.arange(2).view(1, -1, 1, 1)

    def score(s):
        return s + 0.01 * (i.view(-1, 1) - i.view(1, -1)) - 0.1 * hh

    mode_ctx = torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "fused"
                                        else torch.tpu.eager_mode)
    with mode_ctx:
        _big_check(lambda q_, k_, v_, **kw: f(q_, k_, v_, score_mod=rel_bias, block_mask=bm,
                                              **kw), q, k, v, i.view(-1, 1) >= i.view(1, -1),
                   score)


def test_blockwise_document_mask_with_gqa_and_sliding_window():
    """Per-batch tables (packed documents differ between the two sequences), grouped-query
    heads, and a sliding window: the per-(batch, head) block gathers of flash.py."""
    torch._dynamo.reset()
    q, k, v = _big(1, b=2, hq=4, hkv=2, n=1536)
    n = 1536
    doc = torch.zeros(2, n, dtype=torch.long)
    doc[0, 500:] = 1
    doc[1, 100:900] = 1
    doc[1, 900:] = 2
    doc_t = doc.to("tpu")

    def doc_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 300) & (doc_t[b, q_idx] == doc_t[b, kv_idx])

    bm = create_block_mask(doc_window, 2, None, n, n, device="tpu")
    f = torch.compile(flex_attention, backend="tpu")
    i = torch.arange(n)
    mask = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < 300)
    mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    _big_check(lambda q_, k_, v_, **kw: f(q_, k_, v_, block_mask=bm, enable_gqa=True, **kw),
               q, k, v, mask)


def _hand_block_mask(rows, mask_mod, n):
    """A BlockMask of 128-blocks whose query block r lists the (partial) key blocks rows[r]."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = len(rows)
    num = torch.tensor([len(r) for r in rows], dtype=torch.int32).view(1, 1, nb)
    idx = torch.zeros(1, 1, nb, nb, dtype=torch.int32)
    for r, cols in enumerate(rows):
        idx[0, 0, r, :len(cols)] = torch.tensor(cols, dtype=torch.int32)
    return BlockMask.from_kv_blocks(num.to("tpu"), idx.to("tpu"), BLOCK_SIZE=128,
                                    mask_mod=mask_mod, seq_lengths=(n, n))


def test_blockwise_flex_visits_only_the_blocks_its_tables_list():
    """The fused-kernel semantics: a BlockMask whose tables leave out a block its mask_mod
    allows skips that block (so a causal mask does about half the work of a dense one)."""
    torch._dynamo.reset()
    q, k, v = _big(2)
    nb = LB // 128
    # every query block sees key blocks 0..i except block 1 (for query blocks past 1)
    rows = []
    for i in range(nb):
        rows.append([j for j in range(i + 1) if not (j == 1 and i > 1)])
    bm = _hand_block_mask(rows, causal, LB)
    f = torch.compile(flex_attention, backend="tpu")
    i = torch.arange(LB)
    mask = i.view(-1, 1) >= i.view(1, -1)
    skipped = (i.view(1, -1) // 128 == 1) & (i.view(-1, 1) // 128 > 1)
    _big_check(lambda q_, k_, v_, **kw: f(q_, k_, v_, block_mask=bm, **kw), q, k, v,
               mask & ~skipped, grad=False)


def test_eager_flex_on_tpu_runs_the_lowering_not_the_dense_math(monkeypatch):
    """Eager flex_attention reaches the HOPs' PrivateUse1 implementations: the
    tpu::flex_attention ops (forward and backward), not PyTorch's dense math."""
    from torchtpu.ops import flex_attention as ops

    torch._dynamo.reset()
    calls = []
    for name in ("_fwd", "_bwd"):
        op = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, op=op, **k: calls.append(op) or op(*a, **k))
    q, k, v = (x.to("tpu").requires_grad_() for x in inputs())
    bm = create_block_mask(causal, B, None, L, L, device="tpu")
    flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm).sum().backward()
    assert calls == [torch.ops.tpu.flex_attention.default,
                     torch.ops.tpu.flex_attention_backward.default]


def test_blockwise_coarse_tiles_over_a_shared_block_mask():
    """A BlockMask shared by every (batch, head) runs in tiles of several of its blocks
    (lowering/flex_attention.py ``_coarsen``): full, partial and empty blocks mixed inside one
    tile (a sliding window within packed documents), a length that is no multiple of the
    block size, and a hand-made table leaving out blocks mask_mod allows."""
    torch._dynamo.reset()
    n = 1600  # 12.5 blocks of 128: padded fine and coarse tiles
    q, k, v = _big(3, n=n)
    doc = torch.zeros(n, dtype=torch.long)
    doc[700:] = 1
    doc[1300:] = 2
    doc_t = doc.to("tpu")

    def doc_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 400) & (doc_t[q_idx] == doc_t[kv_idx])

    bm = create_block_mask(doc_window, 1, None, n, n, device="tpu")
    f = torch.compile(flex_attention, backend="tpu")
    i = torch.arange(n)
    mask = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < 400)
    mask = mask & (doc.view(-1, 1) == doc.view(1, -1))
    _big_check(lambda q_, k_, v_, **kw: f(q_, k_, v_, block_mask=bm, **kw), q, k, v, mask)
    # the same mask with full blocks listed as partial, and block 2 left out for rows past 3
    nb = -(-n // 128)
    keep = [[j for j in range(nb) if mask[r * 128:(r + 1) * 128, j * 128:(j + 1) * 128].any()
             and not (j == 2 and r > 3)] for r in range(nb)]
    hand = _hand_block_mask(keep, doc_window, n)
    skipped = (i.view(1, -1) // 128 == 2) & (i.view(-1, 1) // 128 > 3)
    torch._dynamo.reset()
    _big_check(lambda q_, k_, v_, **kw: f(q_, k_, v_, block_mask=hand, **kw), q, k, v,
               mask & ~skipped)
