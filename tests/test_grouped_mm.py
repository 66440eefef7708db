"""Grouped matmul for mixture-of-experts on "tpu": ``torch._grouped_mm`` (aten, what TorchTitan's
MoE calls) and ``torch.tpu.ops.ragged_dot`` (a ``tpu::`` custom op), lowered in
torchtpu/lowering/grouped_mm.py.

References: PyTorch's own CPU ``_grouped_mm`` (a per-group ``mm`` loop; its autograd formulas)
and a per-group float64 loop written here. Every kernel the lowering can choose (megablox's
Pallas ``gmm``/``tgmm`` for TPU, run in Pallas interpret mode here; XLA's ragged dot for GPU;
the tiled loop used on CPU) is run on tiny shapes against the loop, in every layout."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

from torchtpu.lowering import grouped_mm as G

STRICT = torch.tpu.EagerMode.DEFER_NEVER
FUSED = torch.tpu.EagerMode.DEFER_AND_FUSE


def _offs(sizes):
    return torch.tensor(np.cumsum(sizes), dtype=torch.int32)


def _layout_inputs(layout, dtype, sizes, seed=0):
    """(a, b, offs) for one _grouped_mm layout; sizes along the grouped dim."""
    g = torch.Generator().manual_seed(seed)
    ng, total = len(sizes), int(sum(sizes))
    m, k, n = 8, 16, 24

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    offs = _offs(sizes)
    if layout == "2d3d":
        return r(total, k), r(ng, n, k).transpose(-2, -1), offs  # B_t as TorchTitan passes it
    if layout == "3d2d":
        return r(ng, m, k), r(k, total), offs
    if layout == "2d2d":
        return r(m, total), r(total, n), offs
    return r(ng, m, k), r(ng, k, n), None


def _grouped_mm_run(layout, dtype, device, mode=STRICT, compiled=False, sizes=(8, 0, 24)):
    """Forward and backward of _grouped_mm on ``device``: (out, grad a, grad b)."""
    a, b, offs = _layout_inputs(layout, dtype, sizes)
    a = a.to(device).requires_grad_()
    bl = b.to(device).detach().requires_grad_()
    offs = offs.to(device) if offs is not None else None

    def f(a, b, offs):
        return torch._grouped_mm(a, b, offs=offs)

    if compiled:
        f = torch.compile(f, backend="tpu", fullgraph=True)
    with torch.tpu.set_eager_mode(mode):
        out = f(a, bl, offs)
        gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
        out.backward(gout.to(device))
        return out.detach().cpu(), a.grad.cpu(), bl.grad.cpu()


LAYOUTS = ["2d3d", "3d2d", "2d2d", "3d3d"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_mm_every_layout_forward_backward_matches_cpu(layout, dtype):
    """All four layouts (the backward of 2d x 3d is 2d x 3d and 2d x 2d), an empty group;
    float32 within rounding of CPU's, bfloat16 (one rounding of a float32 sum, as CPU's mm)
    equal to CPU's at bfloat16 resolution."""
    want = _grouped_mm_run(layout, dtype, "cpu")
    got = _grouped_mm_run(layout, dtype, "tpu")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape
        torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("how", ["fused", "compiled"])
def test_grouped_mm_fused_and_compiled_match_cpu(how):
    """TorchTitan's call (2d x 3d, bfloat16, B_t a transposed view) in Fused eager and in a
    compiled graph."""
    want = _grouped_mm_run("2d3d", torch.bfloat16, "cpu")
    before = torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0)
    got = _grouped_mm_run("2d3d", torch.bfloat16, "tpu", mode=FUSED if how == "fused" else STRICT,
                          compiled=how == "compiled")
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1.6e-2, atol=1e-2)
    assert torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_mm_compiled_takes_every_dtype_eager_takes(layout, dtype):
    """Eager "tpu" (like CPU) takes float32 and float16; PyTorch's meta kernel asks for bfloat16
    (CUDA's limit) whatever the device, so the same call compiled failed in Dynamo's fake run
    (transformers' MoE layers compile it on "tpu" in float32). "tpu"'s fake kernel follows CPU's
    checks; other devices keep PyTorch's."""
    torch._dynamo.reset()  # one code object compiled for every case: keep under the limit
    want = _grouped_mm_run(layout, torch.float32, "cpu")
    got = _grouped_mm_run(layout, dtype, "tpu", compiled=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for x, y in zip(got, want):
        assert x.dtype == dtype and x.shape == y.shape
        torch.testing.assert_close(x.float(), y, **tol)
    a, b, offs = _layout_inputs("2d3d", torch.float32, (8, 0, 24))
    with pytest.raises(RuntimeError, match="BF16"):  # the meta device: PyTorch's kernel
        torch._grouped_mm(a.to("meta"), b.to("meta"), offs=offs.to("meta"))


def test_grouped_mm_rows_past_the_last_offset_are_zero_and_large_offsets_clamp():
    """CPU leaves rows past offs[-1] unwritten (garbage); here they are 0. Offsets past the
    grouped size are clamped as CPU's slices clamp them."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 16, generator=g), torch.randn(3, 16, 24, generator=g)
    offs = torch.tensor([8, 8, 32], dtype=torch.int32)
    out = torch._grouped_mm(x.to("tpu"), w.to("tpu"), offs.to("tpu")).cpu()
    torch.testing.assert_close(out[:32], torch._grouped_mm(x, w, offs)[:32], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[32:], torch.zeros(8, 24))
    big = torch.tensor([8, 30, 50], dtype=torch.int32)
    torch.testing.assert_close(torch._grouped_mm(x.to("tpu"), w.to("tpu"), big.to("tpu")).cpu(),
                               torch._grouped_mm(x, w, big), rtol=1e-5, atol=1e-5)


def test_grouped_mm_decreasing_offsets_raise_at_sync():
    x, w = torch.randn(16, 8, device="tpu"), torch.randn(2, 8, 8, device="tpu")
    y = torch._grouped_mm(x, w, torch.tensor([12, 4], dtype=torch.int32, device="tpu"))
    with pytest.raises(RuntimeError, match="offs must be non-negative and non-decreasing"):
        y.cpu()
    # a valid call afterwards is unaffected
    y = torch._grouped_mm(x, w, torch.tensor([4, 16], dtype=torch.int32, device="tpu"))
    torch.testing.assert_close(y.cpu(), torch._grouped_mm(
        x.cpu(), w.cpu(), torch.tensor([4, 16], dtype=torch.int32)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", range(6))
def test_grouped_mm_argument_errors_match_cpu(case):
    o = torch.tensor([4, 8], dtype=torch.int32)
    args = [
        (torch.randn(8, 8), torch.randn(2, 8, 8, dtype=torch.bfloat16), o),
        (torch.randn(8, 8).double(), torch.randn(2, 8, 8).double(), o),
        (torch.randn(8, 8), torch.randn(2, 8, 8), o.long()),
        (torch.randn(8, 8), torch.randn(2, 8, 8), None),
        (torch.randn(8, 8), torch.randn(3, 8, 8), o),
        (torch.randn(8, 8), torch.randn(2, 4, 8), o),
    ][case]
    with pytest.raises(RuntimeError) as cpu:
        torch._grouped_mm(*args)
    tpu_args = [t.to("tpu") if t is not None else None for t in args]
    with pytest.raises(RuntimeError) as tpu:
        torch._grouped_mm(*tpu_args)
    assert str(cpu.value).splitlines()[0] in str(tpu.value)


# ---------------------------------------------------------------- every kernel, tiny shapes

def _loop_ref(layout, a, b, sizes):
    """Per-group float64 loop, the layout table of lowering/grouped_mm.py."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    if layout == "2d3d":
        out = np.zeros((a.shape[0], b.shape[2]))
        for i, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[i]
    elif layout == "3d2d":
        out = np.zeros((a.shape[1], b.shape[1]))
        for i, (s, e) in enumerate(zip(starts, ends)):
            out[:, s:e] = a[i] @ b[:, s:e]
    else:
        out = np.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    return out


KERNEL_CASES = [  # (layout, total along the grouped dim, sizes, k, n)
    ("2d3d", 37, [5, 0, 20, 9], 16, 24),       # rows past the groups, an empty group
    ("2d3d", 300, [100, 1, 0, 150, 20], 40, 136),  # irregular k/n tiles, several row tiles
    ("3d2d", 40, [8, 0, 32], 16, 24),
    ("2d2d", 37, [5, 0, 20, 9], 24, 16),       # positions past the groups are ignored
    ("2d2d", 300, [0, 0, 299, 1, 0], 40, 136),
]


def _kernel_inputs(layout, total, sizes, k, n, dtype):
    rng = np.random.default_rng(len(sizes) * total)
    g = len(sizes)
    if layout == "2d3d":
        a, b = rng.standard_normal((total, k)), rng.standard_normal((g, k, n))
    elif layout == "3d2d":
        a, b = rng.standard_normal((g, n, k)), rng.standard_normal((k, total))
    else:
        a, b = rng.standard_normal((n, total)), rng.standard_normal((total, k))
    return a.astype(dtype), b.astype(dtype)


# float32: every case; bfloat16: a 2d x 3d and a 2d x 2d case by default, the rest --runslow
KERNEL_PARAMS = [
    pytest.param(kernel, dtype, case, id=f"{case}-{dtype}-{kernel}",
                 marks=[pytest.mark.slow] if dtype == "bfloat16" and case not in (0, 3) else [])
    for case in range(len(KERNEL_CASES)) for dtype in ("float32", "bfloat16")
    for kernel in ("megablox", "xla", "tiled")]


@pytest.mark.parametrize("kernel,dtype,case", KERNEL_PARAMS)
def test_every_kernel_matches_the_per_group_loop(kernel, dtype, case):
    """The aten lowering itself, traced with each kernel forced (megablox in Pallas interpret
    mode: the TPU path is executed here), against the float64 loop."""
    import ml_dtypes

    layout, total, sizes, k, n = KERNEL_CASES[case]
    npdt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    a, b = _kernel_inputs(layout, total, sizes, k, n, npdt)
    offs = np.cumsum(sizes).astype(np.int32)
    with G.kernel(kernel, interpret=True):
        got = jax.jit(lambda a, b, o: G.grouped_mm(a, b, o))(a, b, offs)
    assert got.dtype == a.dtype
    want = _loop_ref(layout, a, b, sizes)
    # bfloat16: one rounding of a float32 sum
    tol = 2e-5 if dtype == "float32" else 8e-3
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol,
                               atol=tol * max(1.0, float(np.abs(want).max())))


def test_kernel_choice_follows_the_platform(monkeypatch):
    from torchtpu.runtime import devices

    import ml_dtypes

    for plat, want in (("tpu", "megablox"), ("gpu", "xla"), ("cpu", "tiled")):
        monkeypatch.setattr(devices, "platform", lambda p=plat: p)
        assert G.kernel_for(ml_dtypes.bfloat16) == (want, False)
    monkeypatch.setattr(devices, "platform", lambda: "tpu")
    assert G.kernel_for(np.float16) == ("xla", False)  # megablox takes float32/bfloat16
    # true float32 (the default) keeps XLA's ragged dot, which takes the precision
    assert G.kernel_for(np.float32) == ("xla", False)
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert G.kernel_for(np.float32) == ("megablox", False)
    finally:
        torch.set_float32_matmul_precision(prev)


def test_tiled_kernel_many_groups_and_tiles():
    """The CPU kernel over many loop steps: 64 groups of random sizes (zeros included)."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(0, 40, 64)
    sizes[rng.integers(0, 64, 10)] = 0
    m = int(sizes.sum()) + 7
    for layout in ("2d3d", "2d2d"):
        a, b = _kernel_inputs(layout, m, list(sizes), 24, 16, np.float32)
        got = jax.jit(G.grouped_mm)(a, b, np.cumsum(sizes).astype(np.int32))
        np.testing.assert_allclose(np.asarray(got), _loop_ref(layout, a, b, sizes),
                                   rtol=2e-5, atol=2e-4)


# ---------------------------------------------------------------- torch.tpu.ops.ragged_dot

def _ragged_inputs(dtype=torch.float32, sizes=(8, 0, 24)):
    g = torch.Generator().manual_seed(11)
    lhs = torch.randn(40, 16, generator=g).to(dtype)
    rhs = torch.randn(len(sizes), 16, 24, generator=g).to(dtype)
    return lhs, rhs, torch.tensor(sizes)


def _ragged_run(device, dtype=torch.float32, mode=STRICT, compiled=False, pref=None):
    lhs, rhs, gs = _ragged_inputs(dtype)
    lhs, rhs = lhs.to(device).requires_grad_(), rhs.to(device).requires_grad_()
    f = torch.tpu.ops.ragged_dot
    if compiled:
        f = torch.compile(f, backend="tpu", fullgraph=True)
    with torch.tpu.set_eager_mode(mode):
        out = f(lhs, rhs, gs.to(device), preferred_element_type=pref)
        gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
        out.backward(gout.to(device))
        return out.detach().cpu(), lhs.grad.cpu(), rhs.grad.cpu()


def _ragged_ref(dtype=torch.float32, pref=None):
    """An independent loop with PyTorch's autograd (float32 accumulation)."""
    lhs, rhs, gs = _ragged_inputs(dtype)
    lhs, rhs = lhs.requires_grad_(), rhs.requires_grad_()
    parts, s = [], 0
    for i, n in enumerate(gs.tolist()):
        parts.append(lhs[s:s + n].float() @ rhs[i].float())
        s += n
    parts.append(torch.zeros(lhs.shape[0] - s, rhs.shape[2]))
    out = torch.cat(parts).to(pref or dtype)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    out.backward(gout)
    return out.detach(), lhs.grad, rhs.grad


@pytest.mark.parametrize("how", ["strict", "fused", "compiled"])
def test_ragged_dot_matches_loop_forward_backward(how):
    want = _ragged_ref()
    before = dict(torch.tpu.metrics()["counters"])
    got = _ragged_run("tpu", mode=FUSED if how == "fused" else STRICT, compiled=how == "compiled")
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    after = torch.tpu.metrics()["counters"]
    for k in ("cpu_fallbacks", "compile_cpu_fallbacks"):
        assert after.get(k, 0) == before.get(k, 0)
    # the CPU kernel (CPU tensors) agrees too
    for x, y in zip(_ragged_run("cpu"), want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_ragged_dot_bfloat16_and_preferred_element_type():
    for pref in (None, torch.float32):
        got = _ragged_run("tpu", torch.bfloat16, pref=pref)
        want = _ragged_run("cpu", torch.bfloat16, pref=pref)
        assert got[0].dtype == (pref or torch.bfloat16)
        assert got[1].dtype == got[2].dtype == torch.bfloat16
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1.6e-2, atol=1e-2)


def test_ragged_dot_fake_kernel_and_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.tpu.ragged_dot(torch.empty(10, 4), torch.empty(3, 4, 6),
                                       torch.empty(3, dtype=torch.int64),
                                       preferred_element_type=torch.bfloat16)
    assert out.shape == (10, 6) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="do not match"):
        torch.tpu.ops.ragged_dot(torch.randn(10, 4, device="tpu"), torch.randn(3, 5, 6,
                                 device="tpu"), torch.tensor([1, 2, 3], device="tpu"))
    y = torch.tpu.ops.ragged_dot(torch.randn(10, 4, device="tpu"), torch.randn(3, 4, 6,
                                 device="tpu"), torch.tensor([4, 4, 4], device="tpu"))
    with pytest.raises(RuntimeError, match="group_sizes must be non-negative and sum"):
        y.cpu()


def test_assert_async_is_a_device_check():
    """torch._assert_async (TorchTitan's RoPE asserts its positions with it each forward) runs
    on the device and raises at the next sync, as CUDA's device-side assert; no CPU fallback."""
    before = torch.tpu.metrics()["counters"].get("cpu_fallbacks", 0)
    x = torch.tensor([1.0, 2.0], device="tpu")
    torch._assert_async(torch.all(x < 3), "fine")
    torch._assert_async(torch.tensor(1, device="tpu"))
    torch.tpu.synchronize()
    torch._assert_async(torch.all(x < 2), "positions out of range")
    with pytest.raises(RuntimeError, match="Expected Tensor with single nonzero value"):
        torch.tpu.synchronize()
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(x)
    assert torch.tpu.metrics()["counters"].get("cpu_fallbacks", 0) == before


# ---------------------------------------------------------------- a second process

SCRIPT = r"""
import json, torch
x = torch.randn(40, 16).to("tpu"); w = torch.randn(3, 16, 24).to("tpu")
y = torch.tpu.ops.ragged_dot(x, w, torch.tensor([8, 0, 24], device="tpu"))
z = torch._grouped_mm(x.bfloat16(), w.bfloat16(), torch.tensor([8, 8, 40], dtype=torch.int32,
                                                                   device="tpu"))
s = (y.sum() + z.float().sum()).item()
xg, wg = x.clone().requires_grad_(), w.bfloat16().requires_grad_()
f = torch.compile(lambda x, w, gs: torch.tpu.ops.ragged_dot(x, w, gs).square().sum(),
                  backend="tpu")
f(xg, w, torch.tensor([8, 0, 24], device="tpu")).backward()
g = torch.compile(lambda a, b, o: torch._grouped_mm(a, b, offs=o).float().sum(), backend="tpu")
g(xg.detach().bfloat16(), wg, torch.tensor([8, 8, 40], dtype=torch.int32, device="tpu")).backward()
s2 = xg.grad.sum().item() + wg.grad.float().sum().item()
c = torch.tpu.metrics()["counters"]
print(json.dumps({"s": s, "s2": s2, "compiles": c.get("eager_xla_compiles", 0),
                  "hits": c.get("eager_disk_cache_hits", 0),
                  "graph_compiles": c.get("xla_compiles", 0),
                  "aot_hits": c.get("aot_cache_hits", 0)}))
"""


def test_second_process_loads_the_grouped_programs_from_the_cache(tmp_path):
    """The custom op exists in a fresh process (defined at import), and its programs and
    _grouped_mm's, eager and compiled (forward and backward graphs, through AOTAutogradCache),
    come back from TORCHTPU_CACHE_DIR: the second process compiles nothing."""
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", "import torch; torch.manual_seed(0)\n" + SCRIPT],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[0]["s"] == runs[1]["s"] and runs[0]["s2"] == runs[1]["s2"]
    assert runs[0]["compiles"] > 0 and runs[0]["graph_compiles"] == 4
    assert runs[1]["compiles"] == 0 and runs[1]["hits"] == runs[0]["compiles"]
    assert runs[1]["graph_compiles"] == 0 and runs[1]["aot_hits"] == 2
