"""Attention at lengths that take the blockwise (flash-style) lowering, against PyTorch on CPU.

``F.scaled_dot_product_attention`` on "tpu" reaches the fused op; above
``attention.DENSE_MAX_ELEMENTS`` score elements its lowering is the online-softmax kernel of
``lowering/flash.py`` (forward and backward, tiles of query x key blocks). The shapes here are
chosen to cross that threshold with ragged lengths (padding of the last blocks), and every case
compares the output and the gradients with CPU's. The memory claim is checked on the compiled
program itself: XLA's buffer assignment for a 16k-token forward+backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchtpu.lowering import attention

SDPA = F.scaled_dot_product_attention
TOL = dict(rtol=2e-5, atol=2e-5)


def _r(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _compare(fn, *inputs, grad_of=None):
    """fn on CPU and on tpu: outputs and the gradients of every float input (or ``grad_of``)."""
    grad_of = range(len(inputs)) if grad_of is None else grad_of
    res = {}
    for dev in ("cpu", "tpu"):
        xs = [x.to(dev) for x in inputs]
        for i in grad_of:
            xs[i].requires_grad_()
        out = fn(*xs)
        w = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dev)
        grads = torch.autograd.grad((out * w).sum(), [xs[i] for i in grad_of])
        res[dev] = [out.detach().cpu()] + [g.cpu() for g in grads]
    for got, want in zip(res["tpu"], res["cpu"]):
        torch.testing.assert_close(got, want, **TOL)


B, H, L, S, E = 1, 2, 1500, 2900, 16  # 8.7M scores: blockwise; neither length a whole block
Q, K, V = _r(B, H, L, E, seed=1), _r(B, H, S, E, seed=2), _r(B, H, S, E, seed=3)
QS = _r(B, H, S, E, seed=4)  # self-attention length (causal)


def test_shapes_take_the_blockwise_path():
    for q in (Q, QS):
        assert attention.use_blocked(np.zeros(q.shape), np.zeros(K.shape), np.zeros(V.shape),
                                     None)
    small = np.zeros((2, 4, 64, 16))
    assert not attention.use_blocked(small, small, small, None)


CASES = {
    "plain": (lambda q, k, v: SDPA(q, k, v), (Q, K, V)),
    "causal_self": (lambda q, k, v: SDPA(q, k, v, is_causal=True), (QS, K, V)),
    "causal_scale_rect": (lambda q, k, v: SDPA(q, k, v, is_causal=True, scale=0.2), (Q, K, V)),
    "gqa_causal": (lambda q, k, v: SDPA(q, k, v, is_causal=True, enable_gqa=True),
                   (_r(B, 4, S, E, seed=5), K, V)),
    "3d": (lambda q, k, v: SDPA(q, k, v, is_causal=True), (QS[0], K[0], V[0])),
}


_SLOW_CASES = {"plain", "causal_scale_rect", "3d"}  # the default run keeps causal and GQA


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW_CASES
                                  else c for c in sorted(CASES)])
def test_blockwise_sdpa_matches_cpu(case):
    fn, inputs = CASES[case]
    _compare(fn, *inputs)


def test_blockwise_bool_mask_with_fully_masked_rows():
    # a sliding-window mask as a (L, S) bool tensor, and rows that see nothing (zeros on
    # CPU's fused path too)
    i = torch.arange(L).view(-1, 1) * 2
    j = torch.arange(S).view(1, -1)
    m = (j <= i) & (j > i - 300)
    m[7] = False
    m[1200:1210] = False
    _compare(lambda q, k, v, m: SDPA(q, k, v, attn_mask=m), Q, K, V, m, grad_of=(0, 1, 2))


def test_blockwise_additive_masks_and_their_gradients():
    # a per-batch key-padding bias (B, 1, 1, S) and a per-head (H, L, S) bias, both learned
    _compare(lambda q, k, v, b: SDPA(q, k, v, attn_mask=b), Q, K, V, _r(B, 1, 1, S, seed=6))
    _compare(lambda q, k, v, b: SDPA(q, k, v, attn_mask=b), Q, K, V, _r(H, L, S, seed=7))


def test_blockwise_dropout_backward_redraws_the_forward_mask():
    # out = dropout(P) @ v with v = I: out is the dropped, rescaled attention matrix itself, and
    # the gradient of <out, g> w.r.t. v must be out^T g: true only if the backward redraws the
    # forward's keep-mask tile by tile
    n, p = 2100, 0.3
    q, k = _r(1, 2, n, 8, seed=8).to("tpu"), _r(1, 2, n, 8, seed=9).to("tpu")
    assert attention.use_blocked(np.zeros(q.shape), np.zeros(k.shape),
                                 np.zeros((1, 2, n, n)), None)
    v = torch.eye(n).expand(1, 2, n, n).contiguous().to("tpu").requires_grad_()
    torch.manual_seed(0)
    a = SDPA(q, k, v, dropout_p=p, is_causal=True)
    g = _r(1, 2, n, n, seed=10)
    (gv,) = torch.autograd.grad(a, v, g.to("tpu"))
    a = a.detach().cpu()
    torch.testing.assert_close(gv.cpu(), a.transpose(-1, -2) @ g, rtol=1e-4, atol=1e-4)
    kept = a[0, 0].tril() != 0
    frac = kept.sum().item() / (n * (n + 1) / 2)
    assert abs(frac - (1 - p)) < 0.01, frac
    # rows sum to 1 / (1 - p) in expectation; the kept entries are P / (1 - p)
    torch.manual_seed(0)
    torch.testing.assert_close(SDPA(q, k, v, dropout_p=p, is_causal=True).cpu(), a)


def _program_bytes(L, fn):
    q = jax.ShapeDtypeStruct((1, 8, L, 64), jnp.float32)
    c = jax.jit(fn).lower(q, q, q, q).compile()
    m = c.memory_analysis()
    return m.temp_size_in_bytes


def test_blockwise_program_memory_grows_with_length_not_its_square():
    """XLA's own buffer assignment for forward+backward at 16k tokens, 8 heads, head dim 64:
    the dense program would need ~8 GiB of temporaries (two 16k x 16k float32 matrices per head);
    the blockwise one needs a few tiles and O(L*d) buffers."""

    def fwd_bwd(q, k, v, do):
        out, lse, seed = attention.attend(q, k, v, None, True, None)
        return attention.attend_backward(do, q, k, v, out, None, lse, 0.0, True, seed, None)

    t16 = _program_bytes(16384, fwd_bwd)
    t8 = _program_bytes(8192, fwd_bwd)
    assert t16 < 160 * 2 ** 20, t16
    assert t16 < 2.5 * t8, (t8, t16)  # linear, not quadratic


# ------------------------------------------------------------- the kernels JAX ships

def _flash_reference(q, k, v, do, scale, causal, bq=64, bk=64):
    from torchtpu.lowering import flash

    S = k.shape[2]

    class Causal(flash.Plan):
        def phases(self, i):
            hi = jnp.minimum(S // bk, i * bq // bk + 1) if causal else S // bk
            return [(0, hi, lambda t: (t, None), True)]

        def scores(self, s, i, j, masked):
            if not causal:
                return s
            rows = i * bq + jnp.arange(bq)[:, None]
            cols = j * bk + jnp.arange(bk)[None, :]
            return jnp.where(cols <= rows, s, -jnp.inf)

    plan = Causal(S // bk)
    out, lse, _ = flash.forward(q, k, v, scale=scale, bq=bq, bk=bk, plan=plan, acc=jnp.float32)
    grads = flash.backward(do, q, k, v, out, lse, scale=scale, bq=bq, bk=bk, plan=plan,
                           acc=jnp.float32)
    return (out, lse) + tuple(grads[:3])


@pytest.mark.parametrize("kernel", ["splash", "pallas_gpu"])
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pallas_kernels_in_interpret_mode_match_the_blockwise_lowering(kernel, causal):
    """The TPU splash kernel and the GPU Pallas/Triton kernel, wired as the op uses them
    (grouped-query layout, scale, the forward's logsumexp handed to the backward), run in
    Pallas interpret mode on tiny shapes against flash.py."""
    from torchtpu.lowering import attention_kernels as K

    g = np.random.default_rng(0)
    B, Hk, G, n, E = 1, 2, 2, 256, 64
    q, do = (jnp.asarray(g.standard_normal((B, Hk, G, n, E)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(g.standard_normal((B, Hk, n, E)), jnp.float32) for _ in range(2))
    fw, bw = (K.splash_forward, K.splash_backward) if kernel == "splash" else \
        (K.gpu_forward, K.gpu_backward)
    out, lse = fw(q, k, v, scale=0.125, causal=causal, interpret=True)
    grads = bw(do, q, k, v, out, lse, scale=0.125, causal=causal, interpret=True)
    want = _flash_reference(q, k, v, do, 0.125, causal)
    for got, ref in zip((out, lse) + tuple(grads), want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_kernel_choice_by_platform_shape_dtype_and_features():
    from torchtpu.lowering.attention_kernels import choose

    bf16, f32 = jnp.bfloat16, jnp.float32
    kw = dict(has_mask=False, dropout_p=0.0, precision="highest")
    assert choose("tpu", bf16, 4096, 4096, 128, 128, **kw) == "splash"
    assert choose("gpu", bf16, 4096, 4096, 128, 128, **kw) == "pallas_gpu"
    assert choose("cpu", bf16, 4096, 4096, 128, 128, **kw) is None
    # float32 at "highest" keeps true float32 products (flash.py); lower precision may use them
    assert choose("tpu", f32, 4096, 4096, 128, 128, **kw) is None
    assert choose("tpu", f32, 4096, 4096, 128, 128, has_mask=False, dropout_p=0.0,
                  precision="default") == "splash"
    # masks (rows may be empty: -inf semantics), dropout, ragged lengths: flash.py
    assert choose("tpu", bf16, 4096, 4096, 128, 128, has_mask=True, dropout_p=0.0,
                  precision="highest") is None
    assert choose("tpu", bf16, 4096, 4096, 128, 128, has_mask=False, dropout_p=0.1,
                  precision="highest") is None
    assert choose("tpu", bf16, 4000, 4096, 128, 128, **kw) is None
    assert choose("gpu", bf16, 2048, 4096, 128, 128, **kw) is None  # fused bwd: L == S


def test_sdpa_op_routes_to_the_platform_kernel(monkeypatch):
    """The op's lowering on a TPU takes splash for a bf16 causal self-attention above the dense
    threshold (forward and backward); here the platform is pretended and the kernel
    interpreted, and the result checked against the blockwise kernel."""
    from torchtpu.lowering import attention_kernels as K

    g = np.random.default_rng(1)
    shape = (1, 2, 1536, 64)
    q, k, v, do = (jnp.asarray(g.standard_normal(shape), jnp.bfloat16) for _ in range(4))
    ref_out, ref_lse, seed = attention.attend(q, k, v, None, True, None)
    ref = attention.attend_backward(do, q, k, v, ref_out, None, ref_lse, 0.0, True, seed, None)
    monkeypatch.setattr(attention._devices, "platform", lambda: "tpu")
    monkeypatch.setattr(K, "INTERPRET", True)
    assert attention.pallas_kernel(q, k, v, None, 0.0) == "splash"
    out, lse, seed = attention.attend(q, k, v, None, True, None)
    got = attention.attend_backward(do, q, k, v, out, None, lse, 0.0, True, seed, None)
    for a, b in zip((out, lse) + tuple(got[:3]), (ref_out, ref_lse) + tuple(ref[:3])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------- torch.tpu.ops.splash_sdpa

def _splash_inputs(B=2, Hq=4, Hk=2, n=700, E=16, seed=20):
    q, k, v = _r(B, Hq, n, E, seed=seed), _r(B, Hk, n, E, seed=seed + 1), \
        _r(B, Hk, n, E, seed=seed + 2)
    seg = torch.zeros(B, n, dtype=torch.long)
    seg[0, 300:] = 1
    seg[1, 100:450] = 1
    seg[1, 450:] = 2
    return q, k, v, seg


def test_splash_sdpa_cpu_reference_is_sdpa_with_the_described_mask():
    from torchtpu.ops.attention import splash_sdpa, visible

    q, k, v, seg = _splash_inputs()
    got = splash_sdpa(q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg,
                      window=(64, None), scale=0.3)
    m = visible(700, 700, "cpu", seg, seg, True, 64, None)
    want = SDPA(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("mode", ["strict", pytest.param("fused", marks=pytest.mark.slow),
                                  "compiled"])
def test_splash_sdpa_on_tpu_matches_cpu(mode):
    """Causal, document (segment ids) and window masks with GQA, forward and backward, in
    every executor; no CPU fallback anywhere."""
    from torchtpu.ops.attention import splash_sdpa

    q, k, v, seg = _splash_inputs()

    def fn(q, k, v, seg):
        return splash_sdpa(q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg,
                           window=(200, None))

    res = {}
    before = dict(torch.tpu.metrics()["counters"])
    for dev in ("cpu", "tpu"):
        xs = [x.to(dev).requires_grad_() for x in (q, k, v)]
        f = fn
        if dev == "tpu" and mode == "compiled":
            torch._dynamo.reset()
            f = torch.compile(fn, backend="tpu")
        ctx = torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) \
            if dev == "tpu" and mode == "fused" else torch.tpu.set_eager_mode(
                torch.tpu.eager_mode)
        with ctx:
            out = f(*xs, seg.to(dev))
            w = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dev)
            grads = torch.autograd.grad((out * w).sum(), xs)
            res[dev] = [out.detach().cpu()] + [g.cpu() for g in grads]
    after = torch.tpu.metrics()["counters"]
    for name in ("cpu_fallbacks", "compile_cpu_fallbacks"):
        assert after.get(name, 0) == before.get(name, 0), name
    for got, want in zip(res["tpu"], res["cpu"]):
        torch.testing.assert_close(got, want, **TOL)


def test_splash_sdpa_errors_name_the_op():
    from torchtpu.ops.attention import splash_sdpa

    q = torch.randn(1, 3, 8, 4, device="tpu")
    k = torch.randn(1, 2, 8, 4, device="tpu")
    with pytest.raises(RuntimeError, match="splash_sdpa: 3 query heads"):
        splash_sdpa(q, k, k)
    with pytest.raises(RuntimeError, match="splash_sdpa: give both"):
        splash_sdpa(k, k, k, q_segment_ids=torch.zeros(1, 8, device="tpu"))


@pytest.mark.parametrize("platform", ["tpu", pytest.param("gpu", marks=pytest.mark.slow)])
def test_splash_sdpa_lowering_takes_the_platform_kernel(platform, monkeypatch):
    """On TPU the op's lowering is the splash kernel with the segment-id and window masks (on
    GPU the Pallas kernel for plain causal attention): pretended platform, interpret mode,
    against the blockwise lowering."""
    from torchtpu.lowering import attention_kernels as K

    g = np.random.default_rng(2)
    B, n = 2, 256
    q = jnp.asarray(g.standard_normal((B, 4, n, 64)), jnp.bfloat16)
    k, v, do = (jnp.asarray(g.standard_normal((B, 2, n, 64)), jnp.bfloat16) for _ in range(3))
    do = jnp.asarray(g.standard_normal((B, 4, n, 64)), jnp.bfloat16)
    seg = jnp.asarray(np.repeat([[0, 1], [0, 0]], n // 2, axis=1))
    kw = dict(is_causal=True)
    if platform == "tpu":
        kw.update(q_segment_ids=seg, kv_segment_ids=seg, window_left=100)

    def run():
        out, lse = attention.splash_sdpa_forward(q, k, v, **kw)
        return (out, lse) + attention.splash_sdpa_backward(do, q, k, v, out, lse, **kw)

    want = run()
    monkeypatch.setattr(attention._devices, "platform", lambda: platform)
    monkeypatch.setattr(K, "INTERPRET", True)
    assert attention._splash_plan(q, k, v, kw.get("q_segment_ids"),
                                  (100, None) if platform == "tpu" else None) == \
        ("splash" if platform == "tpu" else "pallas_gpu")
    for a, b in zip(run(), want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------- twice: the compile cache

TWICE = r"""
import json, torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torchtpu.ops.attention import splash_sdpa
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 2100, 16, generator=g).to("tpu").requires_grad_()
           for _ in range(3))
out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
out.sum().backward()
seg = (torch.arange(2100) // 700).view(1, -1).to("tpu")
o2 = splash_sdpa(q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
o2.sum().backward()
bm = create_block_mask(lambda b, h, i, j: i >= j, 1, None, 2100, 2100, device="tpu")
o3 = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - 0.01 * (i - j), block_mask=bm)
o3.sum().backward()
o4 = torch.compile(flex_attention, backend="tpu")(q, k, v, block_mask=bm)
o4.sum().backward()
c = torch.tpu.metrics()["counters"]
print(json.dumps({"out": [float(t.detach().sum().cpu()) for t in (out, o2, o3, o4)],
                  "grad": float(q.grad.sum().cpu()),
                  "counters": {k: v for k, v in c.items() if "compile" in k}}))
"""


@pytest.mark.slow
def test_second_process_loads_every_attention_program(tmp_path):
    """SDPA's blockwise lowering, splash_sdpa, eager FlexAttention (its subgraphs traced and
    filed by their code) and compiled FlexAttention: a second process with the same cache
    folder compiles nothing and gets the same numbers."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for _ in range(2):
        p = subprocess.Popen([sys.executable, "-c", TWICE], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        assert p.returncode == 0, err[-3000:]
        runs.append(json.loads(out.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["counters"].get("eager_xla_compiles", 0) > 0
    w = warm["counters"]
    assert w.get("eager_xla_compiles", 0) == 0 and w.get("eager_compiles", 0) == 0, w
    assert w.get("fused_xla_compiles", 0) == 0 and w.get("xla_compiles", 0) == 0, w
    assert warm["out"] == cold["out"] and warm["grad"] == cold["grad"]
