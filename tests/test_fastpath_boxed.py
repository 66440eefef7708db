"""The fast path's boxed C++ kernel (eager/fastpath.cpp ``Boxed``, eager/fastpath.py
``bind_boxed``): a functional op's Kernel is registered with the dispatcher as a boxed kernel,
which keys the IValue stack itself, with the key ``Kernel_serve`` makes from the Python
arguments torch.library's PythonKernelHolder would pass (so an entry the Python executor
installs is found from the stack). ``fastpath.check_keys(True)`` makes every boxed call build
both keys and count ``eager_fastpath_key_mismatches``; the cases below cover what the holder's
conversion decides: positional arguments up to the last non-default one, keyword-only ones by
name unless default, dtypes/layouts/memory formats by the schema's type, Python scalars of
each type (and wrapped numbers), lists, Tensor[] and optional tensors."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.eager import fastpath

from dist_launch import child_env
from helpers import counter

pytestmark = pytest.mark.skipif(not fastpath.available() or not fastpath.boxed_wanted(),
                                reason="the fast path is not bound boxed")


_c = counter  # helpers.counter


@pytest.fixture(autouse=True)
def _restore():
    old = fastpath.set_enabled(True)
    mode = torch.tpu.get_eager_mode()
    torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER)
    fastpath.check_keys(True)
    yield
    fastpath.check_keys(False)
    fastpath.set_enabled(old)
    torch.tpu.set_eager_mode(mode)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to("tpu")


def test_functional_kernels_are_bound_boxed():
    bound = fastpath.boxed_bound()
    assert len(bound) > 100 and "aten::add.Tensor" in bound
    assert "fastpath.cpp" in torch._C._dispatch_dump("aten::add.Tensor")  # (the registration)
    a, b = _rand(4, 4), _rand(4, 4, seed=1)
    a + b
    h, bh, c = _c("eager_fastpath_hits"), _c("eager_fastpath_boxed_hits"), _c("eager_cache_hits")
    out = a + b
    assert _c("eager_fastpath_boxed_hits") == bh + 1
    assert _c("eager_fastpath_hits") == h + 1 and _c("eager_cache_hits") == c + 1
    assert torch.equal(out.cpu(), a.cpu() + b.cpu())
    fastpath.set_enabled(False)  # every call through the Python kernel, as before
    bh = _c("eager_fastpath_boxed_hits")
    assert torch.equal((a + b).cpu(), a.cpu() + b.cpu())
    assert _c("eager_fastpath_boxed_hits") == bh


A = lambda: _rand(6, 5)  # noqa: E731
B = lambda: _rand(6, 5, seed=1)  # noqa: E731
I = lambda: torch.tensor([0, 2, 3], device="tpu")  # noqa: E731

CASES = {
    "add": lambda: A() + B(),
    "add_alpha_int": lambda: torch.add(A(), B(), alpha=3),
    "add_alpha_float": lambda: torch.add(A(), B(), alpha=0.5),
    "add_alpha_default_given": lambda: torch.add(A(), B(), alpha=1),
    "mul_float": lambda: A() * 2.5,
    "mul_int": lambda: A() * 3,
    "mul_bool": lambda: A() * True,
    "mul_complex": lambda: A() * (1 + 2j),
    "sum_dim_keepdim": lambda: torch.sum(A(), dim=1, keepdim=True),
    "sum_dtype_kwonly": lambda: torch.sum(A(), dtype=torch.float64),
    "sum_dim_dtype": lambda: torch.sum(A(), (0,), dtype=torch.float64),
    "mean": lambda: A().mean(),
    "cat_tensor_list": lambda: torch.cat([A(), B()], 1),
    "stack_default_dim": lambda: torch.stack([A(), B()]),
    "clamp_optional_scalar": lambda: torch.clamp(A(), min=0.1),
    "clamp_max_only": lambda: torch.clamp(A(), max=0.1),
    "div_rounding_str": lambda: torch.div(A(), B(), rounding_mode="floor"),
    "layer_norm_optional_tensors": lambda: torch.nn.functional.layer_norm(A(), [5], B()[0], None),
    "index_select": lambda: torch.index_select(A(), 0, I()),
    "index_optional_tensor_list": lambda: A()[I()],
    "to_dtype_kwonly": lambda: A().to(torch.float64),
    "to_copy_memory_format": lambda: torch.ops.aten._to_copy(A(), dtype=torch.float16,
                                                             memory_format=torch.preserve_format),
    "zeros_factory": lambda: torch.zeros(3, 4, device="tpu"),
    "full_dtype_layout_device": lambda: torch.full((2, 3), 7, dtype=torch.int32, layout=torch.strided,
                                                   device="tpu"),
    "arange": lambda: torch.arange(2, 9, 2, device="tpu"),
    "view_input_transposed": lambda: A().t() + 1,
    "view_input_offset": lambda: A()[2:] * B()[2:],
    "softmax": lambda: torch.nn.functional.softmax(A(), dim=-1),
    "where": lambda: torch.where(A() > 0, A(), B()),
    "topk_two_outputs": lambda: torch.topk(A(), 2),
    "max_dim_two_outputs": lambda: torch.max(A(), 1),
    "linear": lambda: torch.nn.functional.linear(A(), B()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_boxed_key_is_the_python_key_and_hits(name):
    """The key the boxed kernel builds from the stack equals Kernel_serve's from the holder's
    arguments; the second call is a boxed hit; the result equals the Python kernel's."""
    fn = CASES[name]
    fastpath.set_enabled(False)
    ref = fn()
    fastpath.set_enabled(True)
    fn()
    fn()  # (a lowering that switches to baked-in scalars clears its entries once)
    mm, bh = _c("eager_fastpath_key_mismatches"), _c("eager_fastpath_boxed_hits")
    got = fn()
    assert _c("eager_fastpath_key_mismatches") == mm
    assert _c("eager_fastpath_boxed_hits") > bh, "no boxed hit"
    refs = ref if isinstance(ref, tuple) else (ref,)
    gots = got if isinstance(got, tuple) else (got,)
    for r, g in zip(refs, gots):
        assert r.dtype == g.dtype and r.shape == g.shape and r.stride() == g.stride()
        assert torch.equal(r.cpu(), g.cpu()) or (r.is_floating_point() and torch.equal(
            r.cpu().isnan(), g.cpu().isnan()) and torch.equal(r.cpu().nan_to_num(), g.cpu().nan_to_num()))


def test_values_are_keyed_apart():
    """Scalars that a value-blind key would merge (2 vs 2.0 vs True, 0.0 vs -0.0, alpha given
    or default) give distinct entries: each result is its own."""
    a = _rand(3, 3)
    for s in (2, 2.0, True, 0.0, -0.0, 1.5, 1 + 0j, math.nan, math.inf):
        for _ in range(2):
            got = (a * s).cpu()
        want = a.cpu() * s
        assert torch.equal(got.view(-1).view(torch.uint8 if got.dtype != torch.complex64
                                             else torch.uint8),
                           want.view(-1).view(torch.uint8)) if not got.is_complex() else \
            torch.equal(torch.view_as_real(got), torch.view_as_real(want)), s
    assert _c("eager_fastpath_key_mismatches") == 0


def test_out_and_inplace_variants_are_not_served_boxed():
    a, b = _rand(4, 4), _rand(4, 4, seed=1)
    out = torch.empty(4, 4, device="tpu")
    for _ in range(2):
        torch.add(a, b, out=out)
        c = a.clone()
        c.add_(b)
    bh = _c("eager_fastpath_boxed_hits")
    torch.add(a, b, out=out)
    c = a.clone()  # (clone is functional: a boxed hit itself)
    c.add_(b)
    assert _c("eager_fastpath_boxed_hits") == bh + 1
    assert torch.equal(out.cpu(), a.cpu() + b.cpu()) and torch.equal(c.cpu(), a.cpu() + b.cpu())


def test_parameters_and_autograd_take_the_same_path():
    """A Parameter's Python object is not an exact torch.Tensor (Kernel_serve does not key it:
    neither does the boxed kernel); under autograd the kernel sees plain tensors."""
    w = torch.nn.Parameter(_rand(4, 4))
    x = _rand(4, 4, seed=2)
    for _ in range(3):
        y = (w * x).sum()
    y.backward()
    assert torch.equal(w.grad.cpu(), x.cpu())
    assert _c("eager_fastpath_key_mismatches") == 0


def test_opinfo_subset_keys_match():
    from test_fastpath import FAST_KEYS, _opinfo_case

    mm = _c("eager_fastpath_key_mismatches")
    bh = _c("eager_fastpath_boxed_hits")
    for key in FAST_KEYS:
        try:
            _opinfo_case(key)
        except pytest.skip.Exception:
            pass
    assert _c("eager_fastpath_key_mismatches") == mm
    assert _c("eager_fastpath_boxed_hits") > bh


@pytest.mark.slow
def test_opinfo_all_keys_match():
    """Every OpInfo op test_fastpath compares (its slow set included): no key differs."""
    from test_fastpath import _opinfo_case, _opinfo_keys

    mm = _c("eager_fastpath_key_mismatches")
    for key in _opinfo_keys(1):
        try:
            _opinfo_case(key)
        except pytest.skip.Exception:
            pass
    assert _c("eager_fastpath_key_mismatches") == mm


SWITCH = r'''
import torch, torchtpu
a = torch.ones(3, device="tpu")
for _ in range(3):
    b = a + a
c = torch.tpu.metrics()["counters"]
print("RESULT", c.get("eager_fastpath_boxed_bound", 0) > 0, c.get("eager_fastpath_hits", 0) > 0,
      c.get("eager_fastpath_boxed_hits", 0), b.cpu().tolist())
'''


@pytest.mark.parametrize("value, want", [("0", "RESULT False True 0 [2.0, 2.0, 2.0]"),
                                         ("1", "RESULT True True 2 [2.0, 2.0, 2.0]")])
def test_boxed_switch(value, want):
    """TORCHTPU_FASTPATH_BOXED=0 binds the Kernels through torch.library (the holder route):
    hits are served by the Kernel, none boxed."""
    env = child_env(TORCHTPU_FASTPATH_BOXED=value)
    r = subprocess.run([sys.executable, "-c", SWITCH], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x for x in r.stdout.splitlines() if x.startswith("RESULT")] == [want], r.stdout[-2000:]


def test_fused_recording_from_the_stack():
    """Fused mode: a key recorded before is replayed by the boxed kernel (no holder, no
    Python arguments); results equal the Python recording's, keys equal Kernel_serve's."""
    a, b = _rand(8, 8), _rand(8, 8, seed=1)

    def step():
        c = torch.add(a, b, alpha=2) * 2.5
        return torch.cat([c, a], 0).sum(1, keepdim=True).cpu()

    fastpath.set_enabled(False)
    torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    ref = step()
    fastpath.set_enabled(True)
    step()
    r, br = _c("fused_fastpath_records"), _c("fused_fastpath_boxed_records")
    mm = _c("eager_fastpath_key_mismatches")
    got = step()
    assert _c("fused_fastpath_boxed_records") - br == 4
    assert _c("fused_fastpath_records") - r == 4
    assert _c("eager_fastpath_key_mismatches") == mm
    assert torch.equal(got, ref)
