"""The C++ fast path of the Strict executor (eager/fastpath.py, eager/fastpath.cpp).

Every comparison runs the same call through the Python path (``fastpath.set_enabled(False)``:
the Python kernel, the reference) and through the fast path (a first call installs the entry,
the next one is served in C++), and compares bit for bit: values (as bytes), dtypes, shapes,
strides, storage offsets, which outputs share storage with which inputs, dispatch keys,
storage properties and gradients.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.coverage import _tensors  # every tensor of nested args, in order
from torchtpu.eager import fastpath
from torchtpu.runtime import inflight

from dist_launch import child_env
from helpers import counter

pytestmark = pytest.mark.skipif(not fastpath.available(),
                                reason="the fast path is not bound (TORCHTPU_FASTPATH=0)")


_c = counter  # helpers.counter


@pytest.fixture(autouse=True)
def _restore():
    old = fastpath.set_enabled(True)
    mode = torch.tpu.get_eager_mode()
    yield
    fastpath.set_enabled(old)
    torch.tpu.set_eager_mode(mode)


# ---- comparing ----

def _bytes(t):
    c = t.detach().cpu()
    if c.is_complex():
        c = torch.view_as_real(c)
    # fresh and dense, stride 1 even for one element
    c = c.reshape(-1).clone(memory_format=torch.contiguous_format)
    return c.view(torch.uint8) if c.numel() else c


def _same(a, b, path="out"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert a.device == b.device, path
        assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset(), path
        assert a.requires_grad == b.requires_grad and a.is_inference() == b.is_inference(), path
        assert torch._C._dispatch_keys(a) == torch._C._dispatch_keys(b), path
        sa, sb = a.untyped_storage(), b.untyped_storage()
        assert sa.nbytes() == sb.nbytes() and sa.resizable() == sb.resizable(), path
        if a.device.type == "tpu":
            assert sa.data_ptr() % 512 == sb.data_ptr() % 512 == 0, path
        assert torch.equal(_bytes(a), _bytes(b)), f"{path}: values differ"
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
        return
    assert a == b or (a != a and b != b), (path, a, b)


def _sharing(ins, outs):
    """Which of ``outs`` share a storage with which earlier tensor (inputs, then outputs)."""
    seen, pattern = {}, []
    for t in _tensors(ins, []) + _tensors(outs, []):
        if t.device.type != "tpu":
            pattern.append(None)
            continue
        p = t.untyped_storage().data_ptr()
        pattern.append(seen.setdefault(p, len(pattern)))
    return pattern


def both(make, fn, hit=True):
    """fn(*make()) through the Python path, then twice through the fast path; compares
    results and storage sharing. ``hit``: the second fast call must be served in C++."""
    fastpath.set_enabled(False)
    ins = make()
    ref = fn(*ins)
    ref_share = _sharing(ins, ref)
    fastpath.set_enabled(True)
    fn(*make())
    ins = make()
    h0 = _c("eager_fastpath_hits")
    got = fn(*ins)
    if hit:
        assert _c("eager_fastpath_hits") > h0, "the fast path was not taken"
    _same(ref, got)
    assert _sharing(ins, got) == ref_share
    return got


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype).to("tpu")
    if dtype is torch.bool:
        return (torch.randn(shape, generator=g) > 0).to("tpu")
    return torch.randint(-50, 50, shape, generator=g).to(dtype).to("tpu")


# ---- the fast path is taken, and gives the Python path's results ----

def test_add_is_served_in_cpp_and_counted():
    a, b = _rand(16, 16), _rand(16, 16, seed=1)
    a + b
    h, c = _c("eager_fastpath_hits"), _c("eager_cache_hits")
    out = a + b
    assert _c("eager_fastpath_hits") == h + 1 and _c("eager_cache_hits") == c + 1
    assert torch.equal(out.cpu(), a.cpu() + b.cpu())
    fastpath.set_enabled(False)
    h = _c("eager_fastpath_hits")
    a + b
    assert _c("eager_fastpath_hits") == h  # disabled: the Python kernel ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.int32, torch.float16])
def test_elementwise_and_reductions_bitwise(dtype):
    shapes = [(), (7,), (3, 5), (2, 3, 4)]
    for shape in shapes:
        def make():
            return _rand(*shape, dtype=dtype), _rand(*shape, dtype=dtype, seed=1)

        if dtype is not torch.bool:
            both(make, lambda a, b: a + b)
            both(make, lambda a, b: a * b)
            both(make, lambda a, b: torch.maximum(a, b))
            both(make, lambda a, b: a.sum(-1) if a.dim() else a.sum())
        both(make, lambda a, b: a == b)
        both(make, lambda a, b: torch.where(a > b, a, b) if dtype is not torch.bool else a & b)


def test_python_scalars_are_keyed_by_value():
    a = _rand(4, 4)
    for s in (2.5, 3.0, -0.0, 0.0, float("nan"), float("inf"), 7, 0, 1, True, 2**40):
        # (0.0 and nan reach the program as Python numbers, not cached device scalars: the
        # executable that ran has no signature of its own for them, so no entry is made)
        hit = not (isinstance(s, float) and (s != s or s == 0))
        both(lambda: (_rand(4, 4),), lambda x, s=s: x * s, hit)
        both(lambda: (_rand(4, 4),), lambda x, s=s: x + s, hit)
        if not isinstance(s, bool):
            both(lambda: (_rand(4, 4),), lambda x, s=s: torch.add(x, x, alpha=s), hit)
    # a value never seen gives its own result, not another value's entry
    x = a * 2.5
    y = a * 4.0
    assert torch.equal(y.cpu(), a.cpu() * 4.0) and torch.equal(x.cpu(), a.cpu() * 2.5)


def test_multiple_outputs_and_int_lists():
    both(lambda: (_rand(5, 6),), lambda x: torch.max(x, dim=1))
    both(lambda: (_rand(5, 6),), lambda x: torch.sort(x, dim=0))
    both(lambda: (_rand(5, 6),), lambda x: torch.var_mean(x, dim=[0, 1], keepdim=True))
    both(lambda: (_rand(5, 6), _rand(5, 6, seed=2)), lambda a, b: torch.cat([a, b], 1))
    both(lambda: (_rand(5, 6), _rand(6, 3, seed=2)), lambda a, b: a @ b)
    both(lambda: (_rand(2, 3, 8),), lambda x: torch.nn.functional.softmax(x, -1))
    both(lambda: (_rand(2, 3, 8),), lambda x: torch.nn.functional.layer_norm(x, (8,)))


def _view_cases():
    """Inputs that are views of a storage array, one per kind of view spec (eager/views.py)."""
    base = _rand(8, 8)
    cbase = (_rand(4, 6) + 1j * _rand(4, 6, seed=5)).to(torch.complex64)
    return {
        "transpose": lambda: (base.t(),),                       # a box plan
        "rows": lambda: (base[2:],),                            # whole rows at a traced offset
        "row": lambda: (base[3],),
        "flat_run": lambda: (base.view(64)[5:21].view(4, 4),),  # a contiguous run, not rows
        "reshape": lambda: (base.view(4, 16),),                 # the whole array, reshaped
        "columns": lambda: (base[:, 2:5],),                     # a box inside the array
        "steps": lambda: (base[::3, 1::2],),                    # a strided gather
        "expand": lambda: (base[:1].expand(3, 8),),
        "bitcast": lambda: (base.view(torch.int32),),
        "conj": lambda: (cbase.conj(),),
        "neg_bit": lambda: (cbase.conj().imag,),
    }


@pytest.mark.parametrize("kind", list(_view_cases()))
def test_views_and_offsets_are_served_and_match(kind):
    make = _view_cases()[kind]
    both(make, lambda x: x * 3 if x.dtype is torch.int32 else x * 3.0)
    both(make, lambda x: x.sum(0) if not x.is_complex() else x + x)
    # a view and its base in one op
    both(lambda: make() + (make()[0].contiguous(),), lambda x, y: x + y)


def test_views_at_several_offsets_are_keyed_by_offset():
    base = _rand(16, 8)
    rows = [base[i] * 2.0 for i in range(16)]  # misses (one entry per offset)
    h = _c("eager_fastpath_hits")
    again = [base[i] * 2.0 for i in range(16)]
    assert _c("eager_fastpath_hits") == h + 16
    want = base.cpu() * 2.0
    for i in range(16):
        assert torch.equal(rows[i].cpu(), want[i]) and torch.equal(again[i].cpu(), want[i])


def test_one_key_over_arrays_of_different_shapes():
    """The same tensor metadata over storage arrays of different shapes (a (1, 64) view of a
    (1, 1, 64) array, a (1, 64) array) is a different view spec each: each gets its own entry
    and neither is served the other's program."""
    w = _rand(64, 32, seed=3)

    def make_a():
        return (_rand(1, 1, 64).view(1, 64), w)

    def make_b():
        return (_rand(1, 64, seed=1), w)

    for _ in range(3):  # alternating, as in a model whose projections read both kinds
        got_a = both(make_a, lambda x, y: x @ y)
        got_b = both(make_b, lambda x, y: x @ y)
    # (each its own input's product: the two inputs differ)
    torch.testing.assert_close(got_a.cpu(), make_a()[0].cpu() @ w.cpu())
    torch.testing.assert_close(got_b.cpu(), make_b()[0].cpu() @ w.cpu())
    # a weakly typed array behind the same tensor is not served the strong array's entry
    import jax
    import jax.numpy as jnp

    x = _rand(4, 4)
    x + 1.5
    x + 1.5
    buf = x.untyped_storage()._tpu_buffer
    buf.array = jnp.broadcast_to(jax.device_put(2.0), (4, 4))
    assert buf.array.weak_type
    f0 = _c("eager_fastpath_fallbacks")
    out = x + 1.5
    assert _c("eager_fastpath_fallbacks") == f0 + 1
    h = _c("eager_fastpath_hits")
    again = x + 1.5  # served from the weak array's own entry now
    assert _c("eager_fastpath_hits") == h + 1
    fastpath.set_enabled(False)
    ref = x + 1.5
    _same(ref, out)
    _same(ref, again)


def test_views_of_a_written_storage_read_its_new_array():
    """A hit reads the storage's array now, not the one the entry was made with, and leaves
    no reference behind: the base's next in-place write still donates, and a view result
    computed before the write keeps its values."""
    def run():
        x = _rand(16, 16)
        v = x[4:8] * 2.0
        v = x[4:8] * 2.0  # a hit on a view
        before = v.cpu()
        d0 = _c("eager_donated_writes")
        x.add_(1.0)  # the storage's array is replaced (donated: nothing else holds it)
        donated = _c("eager_donated_writes") - d0
        w = x[4:8] * 2.0  # a hit again: must read the new array
        return before, v, w, x, donated

    fastpath.set_enabled(False)
    ref = run()
    fastpath.set_enabled(True)
    run()
    got = run()
    _same(ref[1:4], got[1:4])
    assert torch.equal(ref[0], got[0]) and torch.equal(got[1].cpu(), got[0])
    assert torch.equal(got[2].cpu(), got[0] + 2.0)
    assert ref[4] == got[4] == 1


def test_view_outputs_stay_views():
    # outputs that are views of an op's result stay views (PyTorch's metadata kernels)
    both(lambda: (_rand(4, 6),), lambda x: (x + 1).t())


def test_view_ops_are_cpp_kernels_and_alias():
    """Metadata-only ops (view, as_strided, ...) run PyTorch's CPU kernel through the C++
    redispatch: real views of the same storage, the Python binding's results."""
    def run(x):
        return (x.view(4, 16), x.as_strided((4, 4), (1, 8), 3), x.view(torch.int32),
                x.unfold(1, 4, 2), torch.view_as_real(x.to(torch.complex64)))

    fastpath.set_enabled(False)
    x = _rand(8, 8)
    outs = run(x)
    for o in outs[:4]:
        assert o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    cpu = x.cpu()
    want = (cpu.view(4, 16), cpu.as_strided((4, 4), (1, 8), 3), cpu.view(torch.int32),
            cpu.unfold(1, 4, 2), torch.view_as_real(cpu.to(torch.complex64)))
    for o, w in zip(outs, want):
        assert o.stride() == w.stride() and o.storage_offset() == w.storage_offset()
        assert torch.equal(o.cpu(), w)


def test_inplace_and_donation_unchanged():
    """In-place ops take the Python path; a fast-path hit leaves no reference behind that
    would block the next write from donating its storage."""
    def run():
        x = _rand(32, 32)
        y = x * 2.0
        y = x * 2.0  # a hit
        d0 = _c("eager_donated_writes")
        x.add_(1.0)
        y.mul_(y)
        return x, y, _c("eager_donated_writes") - d0

    fastpath.set_enabled(False)
    rx, ry, rd = run()
    fastpath.set_enabled(True)
    run()
    gx, gy, gd = run()
    _same((rx, ry), (gx, gy))
    assert rd == gd and gd >= 1


def test_autograd_bitwise():
    def run():
        g = torch.Generator().manual_seed(3)
        a = torch.randn(6, 5, generator=g).to("tpu").requires_grad_()
        b = torch.randn(5, 4, generator=g).to("tpu").requires_grad_()
        out = torch.tanh(a @ b * 1.5 + 0.25).sum(0)
        out.backward(torch.ones_like(out))
        return out.detach(), a.grad, b.grad

    fastpath.set_enabled(False)
    ref = run()
    fastpath.set_enabled(True)
    run()
    h = _c("eager_fastpath_hits")
    got = run()
    assert _c("eager_fastpath_hits") > h
    _same(ref, got)


def _sdpa_inputs(L=5, S=7, hq=4, hk=4, e=8, causal=False, mask=None, grad=False):
    """HF-like attention inputs: (batch, seq, heads, dim) projections transposed to (batch,
    heads, seq, dim), so the query is not contiguous and the output is restrided like it."""
    def make():
        g = torch.Generator().manual_seed(11)
        q = torch.randn(2, L, hq, e, generator=g).to("tpu").transpose(1, 2)
        k = torch.randn(2, S, hk, e, generator=g).to("tpu").transpose(1, 2)
        v = torch.randn(2, S, hk, e, generator=g).to("tpu").transpose(1, 2)
        if grad:
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        m = None
        if mask == "bool":
            m = (torch.randn(L, S, generator=g) > -0.5).to("tpu")
        elif mask == "float":
            m = torch.randn(2, 1, L, S, generator=g).to("tpu")
        return q, k, v, m
    return make


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(mask="bool"),
                                  dict(mask="float"), dict(hq=4, hk=2), dict(L=1, S=9)])
def test_sdpa_fused_op_is_served_with_its_layout(case):
    """SDPA's fused op (HF's attention) is served in C++: its result tuple holds None and ints
    (constants of the entry) and its output is restrided like the query (eager_layout_like),
    bit for bit as the Python path's ``_like_layout`` does."""
    causal = case.pop("causal", False)
    gqa = case.get("hq", 4) != case.get("hk", 4)
    make = _sdpa_inputs(causal=causal, **case)
    F = torch.nn.functional
    out = both(make, lambda q, k, v, m: F.scaled_dot_product_attention(
        q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa))
    assert not out.is_contiguous() or case.get("L") == 1  # restrided like the query
    fused = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default
    if case.get("mask") != "bool" and not gqa:
        res = both(make, lambda q, k, v, m: fused(q, k, v, m, 0.0, causal, False, scale=0.3))
        assert res[2] is None and isinstance(res[4], int) and res[8] is None
    q, k, v, m = make()
    n = _c("eager_fastpath_misses")
    h = _c("eager_fastpath_hits")
    F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)
    assert _c("eager_fastpath_misses") == n and _c("eager_fastpath_hits") > h


def test_sdpa_backward_and_dropout():
    """The fused op's backward (restrided like q, k, v) is served bit for bit; a call that
    draws dropout never is (the generator advances on the Python path only)."""
    F = torch.nn.functional
    make = _sdpa_inputs(grad=True)

    def run(q, k, v, m):
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(torch.ones_like(out))
        return out.detach(), q.grad, k.grad, v.grad

    got = both(make, run)
    assert not got[1].is_contiguous()
    make = _sdpa_inputs()

    def drop(q, k, v, m):
        torch.manual_seed(5)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5), torch.rand(3, device="tpu")

    both(make, drop, hit=False)
    op = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default
    q, k, v, _ = make()
    op(q, k, v, None, 0.5, False, False)
    n = _c("eager_fastpath_misses")
    op(q, k, v, None, 0.5, False, False)
    assert _c("eager_fastpath_misses") == n + 1  # never installed: the Python path each time


def test_device_guard_answers_in_cpp():
    """The PrivateUse1 device guard's type and device come from C++ (PyTorch's Python backend
    guard entered the Python ``type_`` once per guarded op); streams and device contexts still
    reach the registered guard."""
    calls = [0]

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "type_":
            calls[0] += 1

    x = torch.arange(6.0)
    sys.setprofile(prof)
    try:
        t = x.to("tpu")  # enters the guard
    finally:
        sys.setprofile(None)
    assert calls[0] == 0
    assert torch.equal(t.cpu(), x) and t.device == torch.device("tpu", 0)
    s = torch.Stream(device="tpu")
    assert s.device == torch.device("tpu", 0)
    with torch.tpu.device(0):
        assert torch.zeros(2, device="tpu").device == torch.device("tpu", 0)


def test_inference_mode_outputs():
    a, b = _rand(3, 3), _rand(3, 3, seed=1)
    with torch.inference_mode():
        both(lambda: (a, b), lambda x, y: x + y)
        out = a + b
    assert out.is_inference()


def test_default_dtype_precision_and_mode_are_keyed():
    i = _rand(4, 4, dtype=torch.int64)
    both(lambda: (i,), lambda x: x / 3)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        ref = (i.cpu() / 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = i / 3
            out2 = i / 3
        assert out.dtype == ref.dtype == out2.dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert (i / 3).dtype == torch.float32
    a, b = _rand(64, 64), _rand(64, 64, seed=1)
    hi = both(lambda: (a, b), lambda x, y: x @ y)
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        m0 = _c("eager_fastpath_misses")
        lo = both(lambda: (a, b), lambda x, y: x @ y)
        assert _c("eager_fastpath_misses") > m0  # not the "highest" entry
    finally:
        torch.set_float32_matmul_precision(prev)
    _same(hi, a @ b)
    del lo
    # Fused mode records (its own entries, fused_fastpath_*): the Strict entry is not used
    with torch.tpu.set_eager_mode("fused"):
        rec = _c("fused_ops_recorded")
        h = _c("eager_fastpath_hits")
        out = a + b
        out = out * 2.0
        assert _c("fused_ops_recorded") == rec + 2 and _c("eager_fastpath_hits") == h
        val = out.cpu()
    assert torch.equal(val, (a.cpu() + b.cpu()) * 2.0)


def test_jax_matmul_precision_is_keyed():
    """Where torch's precision is "highest", JAX's default matmul precision (a context manager
    or jax.config) decides; the C++ key reads it without calling matmul_precision."""
    import jax

    a, b = _rand(32, 32), _rand(32, 32, seed=1)
    hi = both(lambda: (a, b), lambda x, y: x @ y)
    for p in ("high", "default", "bfloat16"):
        with jax.default_matmul_precision(p):
            m0 = _c("eager_fastpath_misses")
            out = both(lambda: (a, b), lambda x, y: x @ y)
            assert _c("eager_fastpath_misses") > m0  # not the "highest" entry
            del out
    _same(hi, a @ b)
    prev = jax.config.jax_default_matmul_precision
    try:
        jax.config.update("jax_default_matmul_precision", "float32")
        m0 = _c("eager_fastpath_misses")
        both(lambda: (a, b), lambda x, y: x @ y)
        assert _c("eager_fastpath_misses") > m0
    finally:
        jax.config.update("jax_default_matmul_precision", prev)
    _same(hi, a @ b)


def test_exceptions_match():
    a, c = _rand(4, 4), _rand(3, 3)
    errs = []
    for on in (False, True, True):
        fastpath.set_enabled(on)
        a + a
        with pytest.raises(RuntimeError) as e:
            a + c
        errs.append((type(e.value), str(e.value)))
    assert errs[0] == errs[1] == errs[2]
    # an entry whose input storage lost its buffer: the Python path raises its own error
    x = _rand(2, 2)
    x + x
    x + x
    st = x.untyped_storage()
    buf = st._tpu_buffer
    del st._tpu_buffer
    try:
        with pytest.raises(Exception) as e1:
            x + x
        fastpath.set_enabled(False)
        with pytest.raises(Exception) as e2:
            x + x
        assert type(e1.value) is type(e2.value) and str(e1.value) == str(e2.value)
    finally:
        st._tpu_buffer = buf


def test_factories_are_served_and_match():
    """Factories (no input tensor) are keyed by their arguments and the default dtype and
    served in C++ on a one-device platform, as the Python path makes them."""
    cases = [lambda: torch.arange(8, device="tpu"),
             lambda: torch.arange(2, 11, 3, device="tpu", dtype=torch.float32),
             lambda: torch.full((2, 3), 1.5, device="tpu"),
             lambda: torch.full((4,), 7, device="tpu"),
             lambda: torch.full((2, 2), float("-inf"), device="tpu", dtype=torch.bfloat16),
             lambda: torch.zeros(3, 5, device="tpu", dtype=torch.int32),
             lambda: torch.ones(2, 3, device="tpu")]
    for fn in cases:
        both(lambda: (), fn)
    # the value is part of the key: another end, another program and result
    a8, a9 = torch.arange(8, device="tpu"), torch.arange(9, device="tpu")
    assert a8.shape == (8,) and a9.shape == (9,)
    assert torch.equal(a9.cpu(), torch.arange(9))
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        out = torch.full((2,), 0.5, device="tpu")
        out2 = torch.full((2,), 0.5, device="tpu")
        assert out.dtype == out2.dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert torch.full((2,), 0.5, device="tpu").dtype == torch.float32
    # a fresh array per call: an in-place write into one result leaves the next alone
    x = torch.zeros(4, device="tpu")
    x.add_(1.0)
    y = torch.zeros(4, device="tpu")
    assert torch.equal(x.cpu(), torch.ones(4)) and torch.equal(y.cpu(), torch.zeros(4))


def test_checked_ops_are_served_and_raise_alike():
    """A checked op (registry ``check``: embedding's and index_select's bounds) is served in
    C++, its flag handed to the pending checks as the Python path does; a bad index raises
    the same error at the next sync on both paths."""
    w = _rand(10, 4)
    good = torch.tensor([[1, 2, 9]], device="tpu")
    both(lambda: (good, w), lambda i, t: torch.nn.functional.embedding(i, t))
    both(lambda: (w, good[0]), lambda t, i: t.index_select(0, i))
    bad = torch.tensor([[1, 12, 0]], device="tpu")
    errs = []
    for on in (False, True, True):
        fastpath.set_enabled(on)
        torch.tpu.synchronize()
        h = _c("eager_fastpath_hits")
        torch.nn.functional.embedding(bad, w)
        served = _c("eager_fastpath_hits") > h
        with pytest.raises(IndexError) as e:
            torch.tpu.synchronize()
        errs.append((type(e.value), str(e.value)))
    assert served  # the last call was a hit
    assert errs[0] == errs[1] == errs[2]


def test_stale_array_shape_or_dtype_falls_back():
    """A storage whose array changed shape or dtype behind the same tensor metadata (a
    ``.data``/``set_`` swap) is not served from the entry."""
    x = _rand(4, 4)
    y = x + 1.0
    y = x + 1.0
    buf = x.untyped_storage()._tpu_buffer
    import jax.numpy as jnp

    buf.array = jnp.arange(16, dtype=jnp.float32)  # same bytes, another shape
    f0 = _c("eager_fastpath_fallbacks")
    y = x + 1.0
    assert _c("eager_fastpath_fallbacks") == f0 + 1  # the entry was not used
    assert torch.equal(y.cpu(), torch.arange(16.).view(4, 4) + 1)
    x2 = _rand(4, 4)
    x2 + 1.0
    x2.untyped_storage()._tpu_buffer.array = jnp.zeros((4, 4), jnp.int32)  # another dtype
    f0 = _c("eager_fastpath_fallbacks")
    y = x2 + 1.0
    assert _c("eager_fastpath_fallbacks") == f0 + 1
    fastpath.set_enabled(False)
    assert torch.equal(_bytes(y), _bytes(x2 + 1.0))


def test_entries_match_by_aval_and_its_fields():
    """An entry remembers the aval objects it matched (a few per input) and compares the
    dtype, shape and weak type of any other: arrays on equal avals made apart are served; a
    weakly typed array of the same shape and dtype is not (the Python path runs, and gives
    what it gives with the fast path off)."""
    import jax

    xs = [_rand(4, 4, seed=i) for i in range(7)]
    for x in xs:  # each on an aval made apart (jax may hand back one object for equal ones)
        buf = x.untyped_storage()._tpu_buffer
        a = buf.array
        buf.array = a._rewrap_with_aval_and_sharding(
            jax.core.ShapedArray(a.shape, a.dtype, weak_type=a.weak_type), a.sharding)
    xs[0] * 2.0
    h0 = _c("eager_fastpath_hits")
    got = [x * 2.0 for _ in range(2) for x in xs]
    assert _c("eager_fastpath_hits") == h0 + 2 * len(xs)
    for y, x in zip(got, xs + xs):
        assert torch.equal(y.cpu(), x.cpu() * 2.0)
    w = _rand(4, 4, seed=9)
    import numpy as np
    from jax._src.lax.lax import _convert_element_type

    weak = _convert_element_type(jax.numpy.full((4, 4), 3.0), np.dtype("float32"), weak_type=True)
    assert weak.weak_type and weak.dtype == w.untyped_storage()._tpu_buffer.array.dtype
    w.untyped_storage()._tpu_buffer.array = weak
    h0, f0 = _c("eager_fastpath_hits"), _c("eager_fastpath_fallbacks")
    got = w * 2.0
    assert _c("eager_fastpath_hits") == h0 and _c("eager_fastpath_fallbacks") == f0 + 1
    fastpath.set_enabled(False)
    _same(w * 2.0, got)


def test_outputs_are_noted_in_flight_and_synchronize_waits():
    a, b = _rand(384, 384), _rand(384, 384, seed=1)
    (a @ b)
    h = _c("eager_fastpath_hits")
    out = a @ b @ b
    assert _c("eager_fastpath_hits") >= h + 2
    arr = out.untyped_storage()._tpu_buffer.array
    ref = inflight._last[0]()
    assert arr.is_ready() or ref is arr
    del out, arr, ref
    torch.tpu.synchronize()
    assert not inflight.pending()


def test_memory_accounting_unchanged():
    def run():
        gc.collect()  # earlier tests' cyclic garbage freed now, not while this run counts
        torch.tpu.synchronize()
        m0 = torch.tpu.memory_allocated()
        a = _rand(64, 64)
        outs = [a * float(i % 3) for i in range(6)]
        torch.tpu.synchronize()
        m1 = torch.tpu.memory_allocated()
        del outs, a
        torch.tpu.synchronize()
        return m1 - m0, torch.tpu.memory_allocated() - m0

    # each path runs once first: the first run in a process also creates the cached device
    # scalars of the traced Python numbers (kept for later calls, so counted as allocated)
    fastpath.set_enabled(False)
    run()
    ref = run()
    fastpath.set_enabled(True)
    run()
    assert run() == ref


def test_threads():
    errors = []

    def work(k):
        try:
            g = torch.Generator().manual_seed(k)
            a = torch.randn(k + 2, 5, generator=g)
            b = torch.randn(k + 2, 5, generator=g)
            ta, tb = a.to("tpu"), b.to("tpu")
            for i in range(150):
                if i % 7 == 0:
                    out, want = ta * 3.5 + tb, a * 3.5 + b
                else:
                    out, want = ta + tb, a + b
                if i % 5 == 0 and not torch.equal(out.cpu(), want):
                    errors.append((k, i))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


# ---- OpInfo: a broad subset through both paths ----

def _opinfo_keys(every):
    from torchtpu import coverage

    db = coverage.op_db()
    keys = []
    for i, (k, o) in enumerate(db.items()):
        if i % every or k in coverage.RANDOM or k in coverage.RANDOM_IF or k in coverage.UNDEFINED:
            continue
        if coverage.not_applicable(k, o) or torch.float32 not in o.supported_dtypes("cpu"):
            continue
        keys.append(k)
    return keys


def _opinfo_case(key):
    from torchtpu import coverage

    opinfo = coverage.op_db()[key]
    grad = coverage.supports_grad(opinfo)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            samples = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=grad))[:2]
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"no samples: {e}")

        def run(sample):
            inp, args, kwargs = coverage._move_sample(sample, "tpu", key)
            try:
                out = opinfo(inp, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - must fail the same way on both paths
                return ("raised", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            res = [out]
            targets = coverage._grad_targets(out)
            ins = [t for t in _tensors((inp, args, kwargs), []) if t.requires_grad]
            if targets and ins:
                go = [torch.ones_like(t) for t in targets]
                try:
                    res.append(torch.autograd.grad(targets, ins, go, allow_unused=True))
                except Exception as e:  # noqa: BLE001
                    res.append(("raised", type(e).__name__))
            return _detach(res)

        for sample in samples:
            fastpath.set_enabled(False)
            ref = run(sample)
            fastpath.set_enabled(True)
            run(sample)
            got = run(sample)
            _same(ref, got, key)


def _detach(x):
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (list, tuple)):
        return [_detach(e) for e in x]
    return x


FAST_KEYS = _opinfo_keys(15)


@pytest.mark.parametrize("key", FAST_KEYS)
def test_opinfo_both_paths(key):
    _opinfo_case(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(set(_opinfo_keys(1)) - set(FAST_KEYS)))
def test_opinfo_both_paths_all(key):
    _opinfo_case(key)


def test_opinfo_subset_hits():
    """The OpInfo comparisons above exercised the fast path (not only the Python one)."""
    h = _c("eager_fastpath_hits")
    for key in FAST_KEYS[:6]:
        _opinfo_case(key)
    assert _c("eager_fastpath_hits") > h


# ---- environment switches ----

NO_COMPILER = r'''
import torch, torchtpu
from torchtpu.eager import fastpath
a = torch.ones(3, device="tpu")
b = a + a
b = a + a
print("RESULT", fastpath.available(), torch.tpu.metrics()["counters"].get("eager_fastpath_unavailable"),
      b.cpu().tolist())
'''


def test_without_a_compiler_the_python_path_serves(tmp_path):
    env = child_env(TORCH_EXTENSIONS_DIR=str(tmp_path), CXX="/nonexistent/c++")
    r = subprocess.run([sys.executable, "-c", NO_COMPILER], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT False 1 [2.0, 2.0, 2.0]"], r.stdout[-2000:]
    # TORCHTPU_FASTPATH=0: the Python kernels themselves are bound (nothing built or counted)
    env = child_env(TORCHTPU_FASTPATH="0")
    r = subprocess.run([sys.executable, "-c", NO_COMPILER], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line == ["RESULT False None [2.0, 2.0, 2.0]"], r.stdout[-2000:]


SUITES = ["tests/test_aliased_writes.py", "tests/test_donation.py", "tests/test_views.py"]


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "1"])
def test_aliasing_donation_views_suites_on_both_paths(value):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_env(TORCHTPU_FASTPATH=value)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *SUITES], cwd=root, capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:]


def test_evicted_programs_are_not_kept_alive_by_entries():
    """program_cache bounds the loaded XLA code by dropping old executables; the fast path's
    entries for them go too (else they would keep the code mapped)."""
    from torchtpu.runtime import program_cache as pc

    a = _rand(3, 7)
    a * 5.5
    a * 5.5
    assert fastpath.entries() > 0
    with pc._live_lock:
        pc._evict_oldest(len(pc._live))
    assert fastpath.entries() == 0
    m = _c("eager_fastpath_misses")
    out = a * 5.5
    assert _c("eager_fastpath_misses") == m + 1
    assert torch.equal(out.cpu(), a.cpu() * 5.5)


def test_timing_counts_outermost_kernel_calls():
    """fastpath.timing (benchmarks/generate_ops.py's split): hits and Python-path calls are
    counted once per outermost Kernel call, the executable's call within the hit's time."""
    a = _rand(8, 8)
    a * 3.5
    fastpath.timing(True)
    try:
        for _ in range(5):
            a * 3.5
        a * 9.25  # a new key: the Python kernel runs
    finally:
        t = fastpath.timing(False)
    assert t["hits"] == 5 and t["python"] == 1
    assert 0 < t["call_ns"] <= t["hit_ns"] and t["python_ns"] > 0
    a * 3.5
    assert fastpath.timing()["hits"] == 5  # stopped


def test_zero_element_empty_runs_no_program(monkeypatch):
    """``empty`` / ``empty_strided`` of a zero-element shape on "tpu" share one array per
    shape, dtype and device (eager/factories.py: nothing to compute, no program's call;
    ``generate()`` makes a ``(batch, length, 0)`` tensor every token). In-place writes,
    ``resize_`` and ``out=`` into one such tensor leave the others alone, and ops reading them
    equal CPU's."""
    from torchtpu.runtime import program_cache

    def make():
        return [torch.empty((1, 3, 0), device="tpu"), torch.empty((1, 3, 0), device="tpu"),
                torch.empty(0, device="tpu", dtype=torch.int64),
                torch.empty_strided((2, 0), (1, 1), device="tpu")]

    make()
    calls = [0]
    orig = program_cache.Program.__call__

    def counted(self, *flat):
        calls[0] += 1
        return orig(self, *flat)

    monkeypatch.setattr(program_cache.Program, "__call__", counted)
    a, b, c, d = make()
    assert calls[0] == 0
    monkeypatch.setattr(program_cache.Program, "__call__", orig)
    assert a.shape == (1, 3, 0) and c.dtype == torch.int64 and d.shape == (2, 0)
    assert d.stride() == (1, 1)
    x = torch.arange(6, dtype=torch.float32).view(1, 3, 2)
    torch.testing.assert_close(torch.cat([a, x.to("tpu")], -1).cpu(),
                               torch.cat([torch.empty(1, 3, 0), x], -1), rtol=0, atol=0)
    a.resize_(1, 3, 2).fill_(2.0)  # in place into a: b, and a later one, stay empty
    torch.add(x.long().to("tpu"), 1, out=c)  # out= into another
    assert torch.equal(a.cpu(), torch.full((1, 3, 2), 2.0))
    assert torch.equal(c.cpu(), x.long() + 1)
    assert b.shape == (1, 3, 0) and b.cpu().shape == (1, 3, 0)
    e = torch.empty((1, 3, 0), device="tpu")
    assert e.shape == (1, 3, 0) and e.cpu().numel() == 0
    out = torch.empty(0, device="tpu")
    torch.mul(x.to("tpu"), 3, out=out)
    assert torch.equal(out.cpu(), x * 3)
    assert torch.empty(0, device="tpu").shape == (0,)
    b.copy_(torch.empty(1, 3, 0))
    assert b.cpu().shape == (1, 3, 0)
