"""Elementwise, activation, foreach and factory lowerings vs PyTorch on CPU.

Covers what the OpInfo harness does not: type-promotion corner cases, in-place and out=
variants, integer division by zero, foreach in-place ops on optimizer-like lists, real
optimizers with foreach=True, factories' dtype inference. Every check compares with CPU.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

D = "tpu"


def _mk(dtype, shape=(4, 5), lo=-3, hi=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)
    if not dtype.is_signed:
        lo = 0
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=dtype)


def _tpu(x):
    if isinstance(x, torch.Tensor):
        return x.to(D)
    if isinstance(x, (list, tuple)):
        return type(x)(_tpu(e) for e in x)
    return x


def _same(got, exp, **tol):
    gots = got if isinstance(got, (list, tuple)) else (got,)
    exps = exp if isinstance(exp, (list, tuple)) else (exp,)
    assert len(gots) == len(exps)
    for g, e in zip(gots, exps):
        assert g.device.type == D
        g = g.cpu()
        assert g.dtype == e.dtype, (g.dtype, e.dtype)
        torch.testing.assert_close(g, e, equal_nan=True, **tol)


def _check(fn, *args, **kwargs):
    _same(fn(*_tpu(args), **{k: _tpu(v) for k, v in kwargs.items()}), fn(*args, **kwargs))


SPECIAL = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1.5, 2.5,
                        0.5, -0.5, 3.0, -7.0])


# ---------------------------------------------------------------- promotion and semantics

@pytest.mark.parametrize("op", [torch.add, torch.sub, torch.mul, torch.div, torch.remainder,
                                torch.fmod, torch.floor_divide, torch.pow, torch.maximum,
                                torch.eq, torch.lt, torch.atan2, torch.bitwise_and])
@pytest.mark.parametrize("dts", [(torch.int64, torch.float32), (torch.bool, torch.int32),
                                 (torch.float16, torch.float32), (torch.uint8, torch.int8)])
def test_binary_promotion(op, dts):
    a, b = _mk(dts[0]), _mk(dts[1], seed=1)
    if op in (torch.remainder, torch.fmod, torch.floor_divide):
        b = torch.where(b == 0, torch.ones_like(b), b)
    if op is torch.pow and not dts[1].is_floating_point:
        b = b.abs()
    try:
        exp = op(a, b)
    except (RuntimeError, NotImplementedError):
        pytest.skip("CPU rejects this dtype pair")
    _same(op(a.to(D), b.to(D)), exp)


@pytest.mark.parametrize("scalar", [-3, 2.5, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.uint8])
@pytest.mark.parametrize("op", [torch.add, torch.div, torch.remainder, torch.pow, torch.gt,
                                torch.clamp_min])
def test_tensor_scalar_promotion(op, dtype, scalar):
    a = _mk(dtype)
    try:
        exp = op(a, scalar)
    except (RuntimeError, NotImplementedError):
        pytest.skip("CPU rejects this combination")
    _same(op(a.to(D), scalar), exp)


@pytest.mark.parametrize("rounding_mode", [None, "trunc", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int8])
def test_div_rounding_modes(dtype, rounding_mode):
    a, b = _mk(dtype, lo=-9, hi=9), _mk(dtype, seed=3)
    if not dtype.is_floating_point:
        b = torch.where(b == 0, torch.full_like(b, -2), b)
    _check(torch.div, a, b, rounding_mode=rounding_mode)
    _check(torch.div, a, -2, rounding_mode=rounding_mode)


@pytest.mark.parametrize("op", [lambda a, b: torch.div(a, b, rounding_mode="floor"),
                                lambda a, b: torch.div(a, b, rounding_mode="trunc"),
                                torch.remainder, torch.fmod, torch.pow, torch.atan2, torch.hypot,
                                torch.copysign, torch.xlogy, torch.logaddexp, torch.maximum,
                                torch.minimum, torch.fmax, torch.fmin, torch.nextafter,
                                torch.heaviside])
def test_binary_special_values(op):
    _check(op, SPECIAL[:, None], SPECIAL[None, :])


def test_integer_division_by_zero_does_not_crash():
    a = torch.tensor([5, -5, 7, 0], device=D)
    z = torch.zeros(4, dtype=torch.int64, device=D)
    for r in (torch.div(a, z, rounding_mode="trunc"), torch.div(a, z, rounding_mode="floor"),
              a // z, a % z, torch.fmod(a, z)):
        assert r.cpu().dtype == torch.int64
    # true division of integers gives floats, inf/nan like CPU
    _same(a / z, a.cpu() / z.cpu())


def test_false_divided_by_zero_is_nan():
    # XLA rewrites convert(bool) * inf into select(bool, inf, 0); the lowering must not
    _check(torch.div, torch.tensor([True, False]), 0)


def test_int_pow_negative_exponent():
    a = torch.tensor([1, -1, 2, -2, 3, 0, -1])
    b = torch.tensor([-3, -3, -1, -2, 2, 3, -4])
    _check(torch.pow, a, b)
    with pytest.raises(RuntimeError, match="Integers to negative integer powers"):
        torch.pow(a.to(D), -2)
    _check(torch.pow, 2, b.abs())


@pytest.mark.parametrize("op", ["sqrt", "exp", "log", "tanh", "sigmoid", "erf", "lgamma",
                                "digamma", "rsqrt", "exp2", "erfinv", "sinc"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float16])
def test_unary_float_ops(op, dtype):
    x = _mk(dtype, lo=-1, hi=1) if op == "erfinv" else _mk(dtype)
    _check(getattr(torch, op), x)


@pytest.mark.parametrize("op", ["sign", "sgn", "abs", "neg", "ceil", "floor", "round", "trunc",
                                "frac", "isnan", "isinf", "isfinite", "isposinf", "isneginf",
                                "signbit", "nan_to_num", "digamma", "logit", "sigmoid", "erfinv"])
def test_unary_special_values(op):
    _check(getattr(torch, op), SPECIAL)


def test_round_decimals_clamp_lerp_addc():
    x = _mk(torch.float32) * 100
    _check(torch.round, x, decimals=2)
    _check(torch.round, x * 10, decimals=-2)
    _check(torch.clamp, x, -50, 20.5)
    _check(torch.clamp, _mk(torch.int64), 0.5)  # promotes to float
    _check(torch.clamp, x, x * 0 - 1, x * 0 + 1)
    _check(torch.clamp, SPECIAL, -1.0, 1.0)
    _check(torch.lerp, x, x * 2, 0.7)
    _check(torch.lerp, x, x * 2, _mk(torch.float32, seed=4))
    _check(torch.addcmul, x, x, x, value=0.5)
    _check(torch.addcdiv, x, x, x + 1000, value=-2)
    _check(torch.nan_to_num, SPECIAL, nan=1.0, posinf=2.0, neginf=-3.0)
    _check(torch.polygamma, 2, _mk(torch.float64, lo=0.1))


def test_shifts_and_bitwise():
    a = torch.tensor([1, -8, 127, -128, 5], dtype=torch.int8)
    s = torch.tensor([0, 1, 7, 8, 9], dtype=torch.int8)
    _check(torch.bitwise_left_shift, a, s)
    _check(torch.bitwise_right_shift, a, s)
    _check(torch.bitwise_right_shift, a.to(torch.uint8), s.to(torch.uint8))
    _check(torch.bitwise_not, a)
    _check(torch.bitwise_xor, a, 3)
    _check(torch.logical_xor, a, s.float())


def test_errors_match_pytorch():
    b = torch.tensor([True, False], device=D)
    with pytest.raises(RuntimeError, match="Subtraction, the `-` operator"):
        b - b
    with pytest.raises(RuntimeError, match="Negation, the `-` operator"):
        -b
    i = torch.tensor([1, 2], device=D)
    with pytest.raises(RuntimeError, match="alpha must not be a floating point"):
        torch.add(i, i, alpha=0.5)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        i.sqrt_()


# ---------------------------------------------------------------- in-place and out=

def test_inplace_and_out_variants():
    x = _mk(torch.float32)
    y = _mk(torch.float32, seed=2).abs() + 0.5
    ops = [
        lambda a, b: a.add_(b, alpha=2), lambda a, b: a.sub_(3), lambda a, b: a.mul_(b),
        lambda a, b: a.div_(b, rounding_mode="floor"), lambda a, b: a.pow_(2),
        lambda a, b: a.clamp_(-1, 1), lambda a, b: a.lerp_(b, 0.3), lambda a, b: a.exp_(),
        lambda a, b: a.addcdiv_(a, b, value=0.1), lambda a, b: a.remainder_(b),
        lambda a, b: a.sigmoid_(), lambda a, b: a.nan_to_num_(), lambda a, b: a.copysign_(b),
    ]
    for op in ops:
        a, b = x.clone(), y.clone()
        ta, tb = a.to(D), b.to(D)
        r = op(ta, tb)
        assert r is ta
        _same(ta, op(a, b))
    # in-place on a non-contiguous view writes through to the base
    base = x.clone()
    tb = base.to(D)
    tb.t()[1:3].mul_(10)
    base.t()[1:3].mul_(10)
    _same(tb, base)
    # out= with promotion and resize
    out = torch.empty(0, device=D)
    torch.add(x.to(D), 2, out=out)
    _same(out, x + 2)
    outi = torch.empty(3, dtype=torch.float64, device=D)
    torch.mul(x.to(D), y.to(D), out=outi)
    _same(outi, torch.mul(x, y, out=torch.empty(0, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.div(x.to(D), 2, out=torch.empty(0, dtype=torch.int64, device=D))


# ---------------------------------------------------------------- activations (+ backward)

ACTS = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu, "mish": F.mish, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
    "elu": lambda x: F.elu(x, 0.5), "selu": F.selu, "celu": lambda x: F.celu(x, 2.0),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2), "softplus": lambda x: F.softplus(x, 2.0, 1.0),
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 2.0), "threshold": lambda x: F.threshold(x, 0.3, -2.0),
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "logsigmoid": F.logsigmoid,
    "glu": lambda x: F.glu(x, 0), "relu6": F.relu6, "softshrink": F.softshrink,
    "hardshrink": F.hardshrink, "logit": lambda x: torch.logit(x.sigmoid(), 1e-2),
}


@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32])
def test_activation_forward_backward(name, dtype):
    fn = ACTS[name]

    def run(x):
        x = x.detach().requires_grad_(True)
        y = fn(x)
        g = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape).to(y.device)
        y.backward(g)
        return y.detach(), x.grad

    x = _mk(dtype, (4, 6), -4, 4)
    _same(run(x.to(D)), run(x))


def test_activation_inplace_and_prelu():
    x = _mk(torch.float32, (2, 3, 4))
    for op in (F.relu_, lambda t: F.leaky_relu_(t, 0.1), F.hardtanh_, F.elu_,
               lambda t: F.threshold_(t, 0.1, 5.0), lambda t: F.silu(t, inplace=True)):
        t = x.clone().to(D)
        op(t)
        _same(t, op(x.clone()))
    m_cpu = torch.nn.PReLU(3)
    m_tpu = torch.nn.PReLU(3).to(D)
    xc = x.clone().requires_grad_()
    xt = x.clone().to(D).requires_grad_()
    m_cpu(xc).square().sum().backward()
    m_tpu(xt).square().sum().backward()
    _same(xt.grad, xc.grad)
    _same(m_tpu.weight.grad, m_cpu.weight.grad)


# ---------------------------------------------------------------- foreach

def _lists(n=3, dtype=torch.float32):
    return [[_mk(dtype, (3 + i, 2), seed=10 * k + i) for i in range(n)] for k in range(3)]


def test_foreach_functional_and_inplace():
    A, B, C = _lists()
    Bp = [b.abs() + 0.5 for b in B]
    for op in ("add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow"):
        f = getattr(torch, "_foreach_" + op)
        _check(f, A, Bp)
        _check(f, A, 2.5)
        _check(f, A, [1.5, 2, -3.0])
    _check(torch._foreach_add, A, B, alpha=0.3)
    _check(torch._foreach_addcdiv, A, B, Bp, value=0.5)
    _check(torch._foreach_lerp, A, B, 0.3)
    _check(torch._foreach_norm, A)
    _check(torch._foreach_norm, A, float("inf"))
    _check(torch._foreach_sqrt, Bp)

    def chain(A, B):
        A = [a.clone() for a in A]
        torch._foreach_mul_(A, 0.9)
        torch._foreach_add_(A, B, alpha=0.1)
        torch._foreach_addcmul_(A, B, B, value=0.01)
        torch._foreach_lerp_(A, B, 0.5)
        torch._foreach_abs_(A)
        torch._foreach_sqrt_(A)
        torch._foreach_div_(A, [2.0, 3.0, 4.0])
        torch._foreach_maximum_(A, B)
        Z = [a.clone() for a in A]
        torch._foreach_zero_(Z)
        torch._foreach_copy_(Z, B)
        return A + Z

    _check(chain, A, Bp)


@pytest.mark.parametrize("opt_cls,kw", [
    (torch.optim.Adam, dict(lr=0.01, foreach=True)),
    (torch.optim.AdamW, dict(lr=0.01, foreach=True, amsgrad=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, foreach=True)),
    (torch.optim.RMSprop, dict(lr=0.01, foreach=True)),
])
def test_foreach_optimizers(opt_cls, kw):
    params = _lists()[0]

    def train(ps):
        ps = [p.clone().requires_grad_() for p in ps]
        opt = opt_cls(ps, **kw)
        for _ in range(3):
            loss = sum((p * p).sum() for p in ps)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach() for p in ps]

    _same(train(_tpu(params)), train(params))


# ---------------------------------------------------------------- factories

@pytest.mark.parametrize("fn,args,kw", [
    (torch.arange, (10,), {}), (torch.arange, (2, 11, 3), {}), (torch.arange, (0.5, 3), {}),
    (torch.arange, (-1, 1, 0.1), {}), (torch.arange, (10, 0, -3), {}),
    (torch.arange, (1.5, 9.7, 1.1), dict(dtype=torch.int32)),
    (torch.arange, (0, 1, 0.3), dict(dtype=torch.float16)),
    (torch.linspace, (0, 1, 7), {}), (torch.linspace, (-3, 10, 50), dict(dtype=torch.float64)),
    (torch.linspace, (0, 10, 4), dict(dtype=torch.int64)), (torch.linspace, (3, -7, 1), {}),
    (torch.logspace, (-2, 2, 9), dict(base=2.0)), (torch.logspace, (0, 3, 4), dict(dtype=torch.int64)),
    (torch.eye, (3,), {}), (torch.eye, (3, 5), dict(dtype=torch.int32)),
    (torch.tril_indices, (4, 5), {}), (torch.triu_indices, (4, 5, 1), {}),
    (torch.full, ((2, 3), 1.5), {}), (torch.full, ((2,), 7), {}), (torch.full, ((2,), True), {}),
    (torch.zeros, ((2, 3),), {}), (torch.ones, (4,), dict(dtype=torch.int8)),
])
def test_factories(fn, args, kw):
    _same(fn(*args, device=D, **kw), fn(*args, **kw))


def test_factories_have_lowerings():
    """The factories above run as lowerings: no decomposition, no CPU fallback."""
    torch.tpu.reset_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.arange(5, device=D).cpu()
        torch.linspace(0, 1, 5, device=D).cpu()
        torch.eye(3, device=D).cpu()
        torch.tril_indices(3, 3, device=D).cpu()
    per_op = torch.tpu.metrics()["per_op"]
    assert not per_op.get("cpu_fallbacks"), per_op
    assert not per_op.get("decompositions"), per_op


_I64 = torch.iinfo(torch.int64)


@pytest.mark.parametrize("mode", ["strict", "compiled"])
def test_gcd_lcm_int_limits_negatives_and_small_types(mode):
    """Euclid as CPU's calc_gcd does it, with C's wrapping abs: gcd(INT64_MIN, 6) is -2 there;
    lcm's intermediate wraps too. 8/16-bit types compute in int and narrow. No CPU fallback."""
    from torchtpu.runtime.metrics import COUNTERS
    before = (COUNTERS.get("cpu_fallbacks", 0), COUNTERS.get("compile_cpu_fallbacks", 0))
    lo, hi = _I64.min, _I64.max
    a = torch.tensor([0, 0, 6, -6, 12, lo, lo, lo, hi, hi, 7540113804746346429, -15, 1, lo, 0])
    b = torch.tensor([0, 5, 4, -4, -18, 0, 6, lo, hi, 1, 4660046610375530309, 0, lo, -1, lo])
    pairs = [(a, b), (a[:0], b[:0])]  # empty too
    for dt in (torch.int8, torch.int16, torch.int32, torch.uint8):
        info = torch.iinfo(dt)
        g = torch.Generator().manual_seed(3)
        x, y = (torch.randint(info.min, info.max, (300,), generator=g, dtype=torch.int64).to(dt)
                for _ in range(2))
        x[:3], y[1], y[2] = info.min, info.min, 0
        pairs.append((x, y))
    pairs.append((torch.tensor([[12], [-8]]), torch.tensor([18, 0, 5], dtype=torch.int32)))  # broadcast, promotion
    fns = [torch.gcd, torch.lcm]
    if mode == "compiled":
        torch._dynamo.reset()
        fns = [torch.compile(lambda x, y, f=f: f(x, y), backend="tpu", dynamic=False) for f in fns]
    for x, y in pairs:
        _same(fns[0](x.to(D), y.to(D)), torch.gcd(x, y))
        # CPU's own lcm traps (SIGFPE) on INT_MIN / -1 where the wrapped gcd is -1: leave those out
        keep = torch.gcd(x, y) != -1
        if not keep.all():
            x, y = x[keep], y[keep]
        _same(fns[1](x.to(D), y.to(D)), torch.lcm(x, y))
    assert (COUNTERS.get("cpu_fallbacks", 0), COUNTERS.get("compile_cpu_fallbacks", 0)) == before
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.gcd(torch.ones(2, device=D), torch.ones(2, device=D))


# Each case fails on CPU with a dispatch error; on tpu it must raise the same exception type with
# the same message (PyTorch's ScalarType names: 'Float', 'Long', 'ComplexFloat').
_SAME_ERROR = {
    "gcd of floats": lambda d: torch.gcd(torch.ones(2, device=d), torch.ones(2, device=d)),
    "bitwise_and of floats": lambda d: torch.ones(2, device=d) & torch.ones(2, device=d),
    "bitwise_not of floats": lambda d: torch.bitwise_not(torch.ones(2, device=d)),
    "left shift of floats": lambda d: torch.ones(2, device=d) << torch.ones(2, device=d),
    "frac of longs": lambda d: torch.ones(2, dtype=torch.long, device=d).frac(),
    "floor division of bools": lambda d: torch.div(torch.ones(2, dtype=torch.bool, device=d),
                                                   torch.ones(2, dtype=torch.bool, device=d),
                                                   rounding_mode="floor"),
    "clamp of bools": lambda d: torch.ones(2, dtype=torch.bool, device=d).clamp(
        torch.zeros(2, dtype=torch.bool, device=d), torch.ones(2, dtype=torch.bool, device=d)),
    "bincount of floats": lambda d: torch.bincount(torch.ones(2, device=d)),
    "in-place float into long": lambda d: torch.ones(2, dtype=torch.long, device=d).add_(
        torch.ones(2, device=d)),
    "cumsum in bool": lambda d: torch.cumsum(torch.ones(2, device=d), 0, dtype=torch.bool),
    "pow of bool tensors": lambda d: torch.ones(2, dtype=torch.bool, device=d) ** torch.ones(
        2, dtype=torch.bool, device=d),
    "hardtanh of bools": lambda d: torch.nn.functional.hardtanh(torch.ones(2, dtype=torch.bool,
                                                                           device=d)),
    "random_ of complex": lambda d: torch.ones(2, dtype=torch.complex64, device=d).random_(),
    "random_ bounds of complex": lambda d: torch.ones(2, dtype=torch.complex64,
                                                      device=d).random_(1, 4),
    "sign of complex": lambda d: torch.ones(2, dtype=torch.complex64, device=d).sign(),
}
for _name in ("erf", "erfc", "erfinv", "lgamma", "digamma", "i0", "special.i0e", "special.i1",
              "special.i1e", "special.ndtri", "special.log_ndtr", "special.erfcx", "deg2rad",
              "rad2deg", "floor", "ceil", "trunc", "round", "frac"):
    _SAME_ERROR[f"{_name} of complex"] = (
        lambda d, _n=_name: functools.reduce(getattr, _n.split("."), torch)(
            torch.full((2,), 0.5 + 0.5j, device=d)))


@pytest.mark.parametrize("case", sorted(_SAME_ERROR))
def test_dispatch_errors_read_like_cpu(case):
    errs = []
    for dev in ("cpu", D):
        with pytest.raises(RuntimeError) as info:
            _SAME_ERROR[case](dev)
        errs.append((type(info.value), str(info.value)))
    assert errs[1] == errs[0]


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_sub_with_one_bool_operand_raises_as_cpu(mode):
    """PyTorch's sub_check refuses a bool operand on either side (a Python bool scalar too,
    which it wraps as a bool tensor), not only two bool tensors; the lowering raised only
    when the promoted dtype was bool, so ``mask - 0``, ``1 - mask`` and ``ints - mask``
    returned numbers where CPU raises."""
    b = torch.tensor([True, False, True])
    f = torch.tensor([1.5, 2.0, 3.0])
    i = torch.tensor([1, 2, 3])
    cases = [
        lambda b, f, i: b - 0, lambda b, f, i: 1 - b, lambda b, f, i: f - True,
        lambda b, f, i: True - f, lambda b, f, i: i - b, lambda b, f, i: b - i,
        lambda b, f, i: torch.rsub(b, 2), lambda b, f, i: f.clone().sub_(b),
        lambda b, f, i: torch.sub(i, b, out=torch.empty(3, dtype=torch.long, device=i.device)),
        lambda b, f, i: f - torch.tensor(True), lambda b, f, i: b - b,
    ]
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER))
    with ctx:
        for fn in cases:
            with pytest.raises(RuntimeError) as exp:
                fn(b, f, i)
            with pytest.raises(RuntimeError, match="Subtraction, the `-` operator") as got:
                fn(b.to(D), f.to(D), i.to(D))
            assert str(got.value).split(".")[0] == str(exp.value).split(".")[0]
        _same(i.to(D) - 1, i - 1)
        _same(torch.rsub(f.to(D), 2, alpha=3), torch.rsub(f, 2, alpha=3))
        _same(f.to(D) - i.to(D), f - i)
        torch.tpu.synchronize()


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_float_mul_div_by_one_element_uses_unrounded_scalar(mode, dtype):
    """CPU's mul and true-division kernels compute a float16/bfloat16 tensor times/over a
    one-element second operand (a Python number, a 0-dim tensor) in float32 from the operand's
    unrounded value. Rounding the scalar to the tensor's dtype first made ``half * 1e5`` inf
    (1e5 is inf in half) and ``half / 1e5`` 0, and cost bfloat16 scale factors their low bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(500, generator=g) * 3,
                   torch.tensor([1e-3, 1.0, 3.0, 6e4, -0.0, 1e-7])]).to(dtype)
    fns = [lambda t: t * 1e5, lambda t: t / 1e5, lambda t: t * 3.3, lambda t: t / 3.3,
           lambda t: 1e5 / t, lambda t: t * 1e-8, lambda t: t.mul(torch.tensor(7e4)),
           lambda t: t.div(torch.tensor(7e4, dtype=torch.float64)), lambda t: t * 2,
           lambda t: t.clone().div_(1e5), lambda t: t.clone().mul_(0.1),
           lambda t: t * t, lambda t: t / (t + 100)]
    if mode == "compiled":
        torch._dynamo.reset()
        fns = [torch.compile(f, backend="tpu", dynamic=False) for f in fns]
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER))
    with ctx:
        for k, fn in enumerate(fns):
            got = fn(x.to(D)).cpu()
            exp = fn(x)
            if k == 4 and mode != "strict":
                # 1e5 / t is reciprocal(t) * 1e5: a fused program may keep the reciprocal
                # in float32 (one rounding less); compare within one ulp there
                torch.testing.assert_close(got, exp, atol=0, rtol=2 ** -7)
                continue
            assert torch.equal(got, exp), (k, got[(got != exp)][:4], exp[(got != exp)][:4])


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_float_scalar_opmath_floor_trunc_lerp_alpha(mode, dtype):
    """More of CPU's float32 opmath for float16/bfloat16 with a scalar: div_floor/div_trunc
    (and floor_divide) by a one-element divisor use its unrounded value (``x // 1e-5`` was off by
    up to 96 in half), lerp's Scalar weight is unrounded, and add/sub with alpha round alpha to
    the dtype but compute ``a + alpha * b`` in float32 with one final rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, generator=g) * 3,
                   torch.tensor([1e-3, 1.0, 3.0, 6e4, -0.0, 1e-7])]).to(dtype)
    y = (torch.randn(2006, generator=g) * 3).to(dtype)
    exact = [lambda a, b: a // 1e-5, lambda a, b: torch.div(a, 1e5, rounding_mode="floor"),
             lambda a, b: torch.div(a, 3.3, rounding_mode="trunc"),
             lambda a, b: torch.div(a, torch.tensor(1e-5), rounding_mode="trunc")]
    # CPU's vectorised add and lerp fuse the multiply-add (one rounding in float32): a tie in
    # a handful of elements may round the other way
    close = [lambda a, b: a.add(b, alpha=3.3), lambda a, b: a.sub(b, alpha=3.3),
             lambda a, b: torch.add(a, b, alpha=0.1), lambda a, b: torch.lerp(a, b, 0.3),
             lambda a, b: torch.lerp(a, b, 0.7), lambda a, b: a.clone().lerp_(b, 0.1)]
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER))
    with ctx:
        for k, fn in enumerate(exact):
            got, exp = fn(x.to(D), y.to(D)).cpu(), fn(x, y)
            assert torch.equal(got, exp), (k, got[got != exp][:4], exp[got != exp][:4])
        for k, fn in enumerate(close):
            got, exp = fn(x.to(D), y.to(D)).cpu(), fn(x, y)
            # (atol: a cancelling a - alpha * b leaves the unfused product's rounding error)
            torch.testing.assert_close(got, exp, atol=1e-6, rtol=2 ** -7)
            assert (got != exp).sum() <= 12, (k, (got != exp).sum())  # it was 100-800 of 2006


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_float_foreach_scalars_use_opmath(mode, dtype):
    """CPU runs ``_foreach_*`` tensor by tensor, so float16/bfloat16 lists get the element ops'
    float32 opmath: ``_foreach_mul(xs, 1e5)`` was inf in half (the traced scalar rounded to the
    dtype), ``_foreach_div``/``lerp``/``addcmul`` lost low bits the same way."""
    g = torch.Generator().manual_seed(0)
    xs = [(torch.randn(n, generator=g) * 3).to(dtype) for n in (300, 7, 64)]
    ys = [(torch.randn(n, generator=g) * 3).to(dtype) for n in (300, 7, 64)]
    exact = [lambda a, b: torch._foreach_mul(a, 1e5), lambda a, b: torch._foreach_div(a, 1e5),
             lambda a, b: torch._foreach_mul(a, 3.3), lambda a, b: torch._foreach_div(a, [3.3, 1e5, 0.1]),
             lambda a, b: torch._foreach_mul(a, torch.tensor(7e4).to(a[0].device)),
             lambda a, b: torch._foreach_add(a, 3.3), lambda a, b: torch._foreach_mul(a, b)]
    # CPU fuses the multiply-add of add/sub with alpha, lerp and addcmul: ties may differ
    close = [lambda a, b: torch._foreach_add(a, b, alpha=3.3),
             lambda a, b: torch._foreach_sub(a, b, alpha=0.1),
             lambda a, b: torch._foreach_lerp(a, b, 0.3),
             lambda a, b: torch._foreach_addcmul(a, b, b, value=0.01)]
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER))
    with ctx:
        for k, fn in enumerate(exact + close):
            got = [t.cpu() for t in fn([x.to(D) for x in xs], [y.to(D) for y in ys])]
            exp = fn(xs, ys)
            got, exp = torch.cat(got), torch.cat(exp)
            if k < len(exact):
                assert torch.equal(got, exp), (k, got[got != exp][:4], exp[got != exp][:4])
            else:
                torch.testing.assert_close(got, exp, atol=1e-6, rtol=2 ** -7)
                assert (got != exp).sum() <= 10, (k, (got != exp).sum())  # it was 20-150 of 371
