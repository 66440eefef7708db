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


@pytest.mark.slow
def test_flex_attention_hop_lowering_unsupported_is_an_error():
    """A score_mod with a learned captured tensor needs its gradient: a clear error, never a
    silently missing gradient."""
    torch._dynamo.reset()
    q, k, v = (x.to("tpu").requires_grad_() for x in inputs())
    bias = torch.zeros(L, device="tpu", requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    bm = create_block_mask(causal, B, None, L, L, device="tpu")
    f = torch.compile(flex_attention, backend="tpu")
    with pytest.raises(Exception, match="score_mod"):
        out = f(q, k, v, score_mod=learned, block_mask=bm)
        out.sum().backward()
