"""Python scalars that change every step do not recompile (Strict, Debug, Fused).

A Python number passed where the schema has a Tensor (a wrapped number: ``x * lr``,
``w - lr / bc * g``) and the ``scalar_args`` of a lowering (``add``'s ``alpha``, the foreach
step sizes) enter the program as traced 0-d values; their kind (int or float) stays in the key,
and so do the ints 0 and 1. Values, dtypes and errors are compared with PyTorch CPU.
"""
from __future__ import annotations

import pytest
import torch

MODES = {
    "strict": torch.tpu.EagerMode.DEFER_NEVER,
    "debug": torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    "fused": torch.tpu.EagerMode.DEFER_AND_FUSE,
}


def _compiles():
    c = torch.tpu.metrics()["counters"]
    return c.get("eager_compiles", 0) + c.get("fused_graph_compiles", 0)


def _schedule_loop(device, steps=20):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 32, generator=g).to(device)
    w = torch.randn(32, 32, generator=g).to(device)
    counts = []
    for s in range(1, steps + 1):
        lr = 0.1 * (1 - s / 40)
        bc = 1 - 0.9 ** s
        w = w - lr / bc * (x @ w) * 1e-3
        w.sum().item()
        counts.append(_compiles())
    return w.cpu(), counts


@pytest.mark.parametrize("mode", list(MODES))
def test_changing_python_floats_compile_nothing_after_the_first_step(mode):
    exp, _ = _schedule_loop("cpu")
    with torch.tpu.set_eager_mode(MODES[mode]):
        got, counts = _schedule_loop("tpu")
    assert counts[-1] == counts[0], f"compiles per step: {counts}"
    # 20 chained 32x32 float32 matmuls: XLA's and CPU's accumulation orders differ (a lost or
    # stale scalar would differ by whole percent)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def _hand_sgd(device, steps=6):
    g = torch.Generator().manual_seed(1)
    p = torch.randn(64, generator=g).to(device)
    grads = [torch.randn(64, generator=g).to(device) for _ in range(steps)]
    counts = []
    for s, grad in enumerate(grads):
        lr = 0.5 / (s + 1)
        p.add_(grad, alpha=-lr)               # scalar_args alpha
        p.mul_(1 - lr * 0.01)                 # wrapped number
        p.sub_(grad * (lr * lr), alpha=0.5)   # both
        p.sum().item()
        counts.append(_compiles())
    return p.cpu(), counts


@pytest.mark.parametrize("mode", list(MODES))
def test_scheduled_alpha_and_wrapped_numbers(mode):
    exp, _ = _hand_sgd("cpu")
    with torch.tpu.set_eager_mode(MODES[mode]):
        got, counts = _hand_sgd("tpu")
    assert counts[-1] == counts[1], f"compiles per step: {counts}"
    torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)


def _kinds(device):
    xi = torch.arange(-3, 5).to(device)
    xf = torch.linspace(-2, 2, 8).to(device)
    xb = torch.arange(8).to(device).to(torch.bfloat16)
    out = []
    for v in (2, 3, -7, 0, 1, 2.5, -0.0, 0.0, float("inf"), float("nan"), 1e30, True):
        out += [xi * v, xi + v, xf * v, xf + v, xf / v if v != 0 else xf * 0, xb * v]
        if type(v) is not bool:
            out += [xf - v, xi - v]
        if type(v) is not bool:
            out += [xi.add(xi, alpha=v) if type(v) is int else xf.add(xf, alpha=v)]
    return [t.cpu() for t in out]


@pytest.mark.parametrize("mode", list(MODES))
def test_traced_scalars_keep_pytorch_dtypes_and_special_values(mode):
    exp = _kinds("cpu")
    with torch.tpu.set_eager_mode(MODES[mode]):
        got = _kinds("tpu")
    for g, e in zip(got, exp):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, equal_nan=True)
        # -0.0 keeps its sign through a traced multiply
        assert torch.equal(torch.signbit(g[g == 0]), torch.signbit(e[e == 0]))


def test_traced_alpha_keeps_pytorch_errors():
    for dev in ("cpu", "tpu"):
        xi = torch.arange(4).to(dev)
        with pytest.raises(RuntimeError, match="alpha must not be a floating point"):
            torch.add(xi, xi, alpha=0.5)
        with pytest.raises(RuntimeError, match="alpha must not be a floating point"):
            xi.sub_(xi, alpha=2.5)


def test_constant_scalar_reuses_one_program_per_kind():
    x = torch.randn(5, 7).to("tpu")
    x * 0.25
    torch.tpu.synchronize()
    before = _compiles()
    for v in (0.5, 0.75, 3.0, -2.0, 1e-3):
        (x * v).sum().item()
    assert _compiles() == before + 1  # only .sum() of this shape is new
    (x * 3).sum().item()  # an int changes the key (it could change the result dtype)
    assert _compiles() == before + 2


def test_compiled_function_of_changing_floats_recompiles_once():
    """torch.compile(backend="tpu") keeps PyTorch's default ``dynamic=None``: the first call
    specialises, the second value makes Dynamo pass the floats as graph inputs (one more graph
    and XLA program), and every later value reuses it. The backend used to force
    ``dynamic=False``, which compiled one graph per value up to Dynamo's recompile limit."""
    import torch._dynamo

    def step(w, x, lr, bc):
        return w - lr / bc * (x @ w) * 1e-3

    torch._dynamo.reset()
    f = torch.compile(step, backend="tpu")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 16, generator=g)
    w0 = torch.randn(16, 16, generator=g)
    w, ref = w0.to("tpu"), w0
    xt = x.to("tpu")
    before = torch.tpu.metrics()["counters"].get("compile_cache_misses", 0)
    for s in range(1, 11):
        lr, bc = 0.1 * (1 - s / 40), 1 - 0.9 ** s
        w = f(w, xt, lr, bc)
        ref = step(ref, x, lr, bc)
    misses = torch.tpu.metrics()["counters"].get("compile_cache_misses", 0) - before
    assert misses == 2, misses
    torch.testing.assert_close(w.cpu(), ref, rtol=1e-5, atol=1e-6)


def _masks(device):
    """Attention-style masks whose diagonal offset changes every step (in place on a view, as
    transformers' continuous batching builds them, and out of place)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, 9, generator=g).to(device)
    out, counts = [], []
    for k in (2, 3, 5, -2, -4, 7, 12):
        m = torch.zeros(6, 12).to(device)
        block = m[1:5, 2:11]
        block.fill_(-1e9)
        block.triu_(k)
        out += [m.cpu(), torch.triu(x, k).cpu(), torch.tril(x, k).cpu()]
        counts.append(_compiles())
    return out, counts


@pytest.mark.parametrize("mode", list(MODES))
def test_changing_triangle_diagonals_compile_once(mode):
    exp, _ = _masks("cpu")
    with torch.tpu.set_eager_mode(MODES[mode]):
        got, counts = _masks("tpu")
    assert counts[-1] == counts[1], f"compiles per step: {counts}"
    for g, e in zip(got, exp):
        assert torch.equal(g, e)


@pytest.mark.parametrize("fastpath", [True, False])
@pytest.mark.parametrize("mode", list(MODES))
def test_scalars_equal_in_python_but_of_other_types_get_their_own_programs(mode, fastpath):
    """1 == 1.0 == True == 1 + 0j in Python (with equal hashes): a program keyed by the bare
    value served ``x * (1 + 0j)`` with ``x * 1``'s program, a float32 result where PyTorch
    gives complex64."""
    from torchtpu.eager import fastpath as _fp

    old = _fp.set_enabled(fastpath) if _fp.available() else None
    try:
        with torch.tpu.set_eager_mode(MODES[mode]):
            x = torch.arange(6.0).reshape(2, 3) - 2
            xt = x.to("tpu")
            for s in (1, True, 1.0, 1 + 0j, 1 - 0j, -0j, 0, 0.0, False, 2, 2.0, 2 + 0j):
                for _ in range(2):  # the second call is a cache hit
                    got = xt * s
                want = x * s
                assert got.dtype == want.dtype, (s, got.dtype, want.dtype)
                g, w = got.cpu(), want
                if w.is_complex():
                    g, w = torch.view_as_real(g), torch.view_as_real(w)
                assert torch.equal(g, w), s
    finally:
        if old is not None:
            _fp.set_enabled(old)
