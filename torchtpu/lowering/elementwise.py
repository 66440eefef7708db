"""Elementwise (pointwise) math with PyTorch's type promotion and edge-case semantics.

Every lowering here is a pure JAX function; dtype decisions use ``_util.result_type`` (PyTorch's
promotion over arrays and Python scalars). Unary float ops on integer/bool inputs compute in the
default float dtype, as PyTorch does.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch
from jax import lax

from ._util import cast as _cast, float_result_type, is_array, jdtype, result_type, to_jax
from ..runtime.dtypes import scalar_type_name as _tname
from . import registry
from .registry import aten, register


# ---------------------------------------------------------------- helpers

def _is_int(dt: torch.dtype) -> bool:
    return not (dt.is_floating_point or dt.is_complex) and dt != torch.bool


def _is_intlike(dt: torch.dtype) -> bool:
    return not (dt.is_floating_point or dt.is_complex)


def cast(x, dtype: torch.dtype):
    """``_util.cast`` that wraps out-of-range Python integers like PyTorch's scalar conversion."""
    if isinstance(x, int) and not isinstance(x, bool) and _is_int(dtype):
        info = np.iinfo(to_jax(dtype))
        if not info.min <= x <= info.max:
            x = np.array(x & 0xFFFFFFFFFFFFFFFF, np.uint64).astype(to_jax(dtype)).item()
    if is_array(x) and x.dtype == jnp.bool_ and (dtype.is_floating_point or dtype.is_complex):
        # XLA rewrites convert(pred) * c into select(pred, c, 0), losing 0 * inf = nan
        # (False / 0 would give 0): keep the converted value opaque to that rewrite.
        return lax.optimization_barrier(_cast(x, dtype))
    return _cast(x, dtype)


def _binop(self, other, dt=None):
    dt = dt or result_type(self, other)
    a, b = cast(self, dt), cast(other, dt)
    if a.shape != b.shape:
        a, b = jnp.broadcast_arrays(a, b)
    return a, b, dt


def _check_alpha(dt, alpha):
    if alpha is None:
        return
    if isinstance(alpha, bool):
        if dt != torch.bool and not _is_intlike(dt) and not (dt.is_floating_point or dt.is_complex):
            raise RuntimeError("Boolean alpha only supported for Boolean results.")
        if dt != torch.bool and alpha is True:
            return
    if is_array(alpha):  # a traced Python number (scalar_args): its kind is its dtype's
        kind = jnp.dtype(alpha.dtype).kind
        if _is_intlike(dt) and kind == "f":
            raise RuntimeError("For integral input tensors, argument alpha must not be a "
                               "floating point number.")
        if not dt.is_complex and kind == "c":
            raise RuntimeError("For non-complex input tensors, argument alpha must not be a "
                               "complex number.")
        return
    if _is_intlike(dt) and isinstance(alpha, float):
        raise RuntimeError("For integral input tensors, argument alpha must not be a floating point number.")
    if not dt.is_complex and isinstance(alpha, complex):
        raise RuntimeError("For non-complex input tensors, argument alpha must not be a complex number.")


def _upcast(jfn):
    """Run ``jfn`` in float32 for half/bfloat16 inputs (PyTorch's opmath on CPU)."""

    def f(*xs):
        d = xs[0].dtype
        if d in (jnp.float16, jnp.bfloat16):
            return jfn(*(x.astype(jnp.float32) for x in xs)).astype(d)
        return jfn(*xs)

    return f


def _unary_float(jfn):
    up = _upcast(jfn)

    def lowering(self):
        dt = float_result_type(self)
        return up(cast(self, dt))

    lowering.__name__ = getattr(jfn, "__name__", "unary")
    return lowering


def _real_dtype(dt):
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dt, dt)


# ---------------------------------------------------------------- add / sub / mul / div

# alpha traced (an optimizer's ``p.add_(g, alpha=-lr)`` with a scheduled lr); the default 1
# stays static (eager/executor.py ``_traceable``) and costs nothing
@register(aten.add.Tensor, aten.add.Scalar, scalar_args=("alpha",))
def add(self, other, alpha=1):
    dt = result_type(self, other)
    _check_alpha(dt, alpha)
    a, b, _ = _binop(self, other, dt)
    if (is_array(alpha) or alpha != 1) and dt in (torch.float16, torch.bfloat16):
        return _alpha_opmath(a, b, alpha, dt)
    if is_array(alpha) or alpha != 1:
        b = b * cast(alpha, dt)
    if dt == torch.bool:
        return jnp.logical_or(a, b)
    return a + b


@register(aten.sub.Tensor, aten.sub.Scalar, scalar_args=("alpha",))
def sub(self, other, alpha=1):
    _sub_check(self, other)
    dt = result_type(self, other)
    _check_alpha(dt, alpha)
    a, b, _ = _binop(self, other, dt)
    if (is_array(alpha) or alpha != 1) and dt in (torch.float16, torch.bfloat16):
        return _alpha_opmath(a, -b, alpha, dt)
    if is_array(alpha) or alpha != 1:
        b = b * cast(alpha, dt)
    return a - b


def _alpha_opmath(a, b, alpha, dt):
    # CPU's add kernel rounds alpha to a float16/bfloat16 result's dtype but computes
    # a + alpha * b in float32 and rounds once (b * alpha rounded first was one rounding more)
    f = jnp.float32
    return (a.astype(f) + b.astype(f) * cast(cast(alpha, dt), torch.float32)).astype(a.dtype)


def _is_bool(x) -> bool:
    return isinstance(x, bool) or (is_array(x) and x.dtype == jnp.bool_)


def _sub_check(self, other):
    # PyTorch's sub_check: a bool operand on either side refuses, a Python bool scalar too
    # (it is wrapped as a bool tensor), whatever the promoted dtype
    if _is_bool(self) and _is_bool(other):
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                           "Use the `^` or `logical_xor()` operator instead.")
    if _is_bool(self) or _is_bool(other):
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                           "If you are trying to invert a mask, use the `~` or `logical_not()` "
                           "operator instead.")


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self, other, alpha=1):
    return sub(other, self, alpha) if is_array(other) else _rsub_scalar(self, other, alpha)


def _rsub_scalar(self, other, alpha):
    _sub_check(other, self)
    dt = result_type(self, other)
    _check_alpha(dt, alpha)
    a, b, _ = _binop(self, other, dt)
    if alpha != 1:
        a = a * cast(alpha, dt)
    return b - a


def _opmath_scalar(other, dt) -> bool:
    """PyTorch's CPU mul and true-division kernels compute a float16/bfloat16 result whose
    second operand is one element (a Python number, a 0-dim tensor, anything broadcast from a
    single element) in float32 from that operand's unrounded value (``iter.is_scalar(2)``,
    ``original_scalar_value<opmath_t>``): ``half * 1e5`` is finite where 1e5 rounded to half
    is inf, ``half / 1e5`` is not 0. Rounding the scalar to the result dtype first lost that."""
    return dt in (torch.float16, torch.bfloat16) and (not is_array(other) or other.size == 1)


def _opmath(fn, self, other, dt):
    a = cast(self, dt).astype(jnp.float32)
    return fn(a, cast(other, torch.float32)).astype(to_jax(dt))


@register(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    dt = result_type(self, other)
    if _opmath_scalar(other, dt):
        return _opmath(lambda a, b: a * b, self, other, dt)
    a, b, dt = _binop(self, other, dt)
    if dt == torch.bool:
        return jnp.logical_and(a, b)
    return a * b


def _trunc_div(a, b, dt):
    if _is_intlike(dt):
        if dt == torch.bool:
            raise NotImplementedError('"div_trunc_cpu" not implemented for \'Bool\'')
        return lax.div(a, b)
    return jnp.trunc(a / b)


def _floor_div(a, b, dt):
    if _is_intlike(dt):
        if dt == torch.bool:
            raise NotImplementedError('"div_floor_cpu" not implemented for \'Bool\'')
        if not jnp.issubdtype(a.dtype, jnp.signedinteger):
            return lax.div(a, b)
        q = lax.div(a, b)
        r = lax.rem(a, b)
        adjust = (r != 0) & ((a < 0) != (b < 0))
        return jnp.where(adjust, q - 1, q)
    if dt.is_complex:
        raise RuntimeError("div_floor_cpu does not support complex inputs")
    # PyTorch's div_floor_floating (Python's float floor division)
    compute = a.dtype
    if dt in (torch.float16, torch.bfloat16):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    mod = lax.rem(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    fl = jnp.floor(div)
    fl = jnp.where(div - fl > 0.5, fl + 1, fl)
    res = jnp.where(div != 0, fl, jnp.copysign(jnp.zeros_like(div), a / b))
    res = jnp.where(b == 0, a / b, res)
    return res.astype(compute)


@register(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar)
def div(self, other):
    dt = float_result_type(self, other)
    if _opmath_scalar(other, dt):
        return _opmath(lambda a, b: a / b, self, other, dt)
    a, b, _ = _binop(self, other, dt)
    return a / b


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(self, other, *, rounding_mode=None):
    if rounding_mode is None:
        return div(self, other)
    dt = result_type(self, other)
    if rounding_mode in ("trunc", "floor") and _opmath_scalar(other, dt):
        # CPU's div_trunc/div_floor kernels too compute in float32 from the unrounded scalar
        fn = _trunc_div if rounding_mode == "trunc" else _floor_div
        return _opmath(lambda a, b: fn(a, b, torch.float32), self, other, dt)
    a, b, _ = _binop(self, other, dt)
    if rounding_mode == "trunc":
        return _trunc_div(a, b, dt)
    if rounding_mode == "floor":
        return _floor_div(a, b, dt)
    raise RuntimeError("div expected rounding_mode to be one of None, 'trunc', or 'floor' but found "
                       f"'{rounding_mode}'")


@register(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(self, other):
    dt = result_type(self, other)
    if _opmath_scalar(other, dt):
        return _opmath(lambda a, b: _floor_div(a, b, torch.float32), self, other, dt)
    a, b, dt = _binop(self, other, dt)
    return _floor_div(a, b, dt)


def _remainder(a, b, dt):
    if dt.is_complex:
        raise RuntimeError("remainder does not support complex inputs")
    if _is_intlike(dt):
        if dt == torch.bool:
            raise NotImplementedError('"remainder_cpu" not implemented for \'Bool\'')
        r = lax.rem(a, b)
        if not jnp.issubdtype(a.dtype, jnp.signedinteger):
            return r
        return jnp.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
    compute = a.dtype
    if dt in (torch.float16, torch.bfloat16):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    m = lax.rem(a, b)
    m = jnp.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)
    return m.astype(compute)


@register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(self, other):
    a, b, dt = _binop(self, other)
    return _remainder(a, b, dt)


@register(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(self, other):
    a, b, dt = _binop(self, other)
    if dt == torch.bool:
        raise NotImplementedError('"fmod_cpu" not implemented for \'Bool\'')
    if dt in (torch.float16, torch.bfloat16):
        return lax.rem(a.astype(jnp.float32), b.astype(jnp.float32)).astype(a.dtype)
    return lax.rem(a, b)


# ---------------------------------------------------------------- gcd / lcm

def _int_binop(self, other, name):
    a, b, dt = _binop(self, other)
    if not _is_intlike(dt) or dt == torch.bool:
        raise NotImplementedError(f'"{name}_cpu" not implemented for \'{_tname(dt)}\'')
    return a, b, dt


def _gcd(a, b):
    """PyTorch's calc_gcd: Euclid on |a|, |b| with C's truncated remainder. abs wraps as C++'s
    does (|INT64_MIN| stays INT64_MIN, so gcd(INT64_MIN, 6) is -2, as on CPU). At most ~93
    steps for 64-bit values (consecutive Fibonacci numbers are the worst case); the loop stops
    when every element is done, bounded at 200 steps."""
    a, b = jnp.abs(a), jnp.abs(b)
    one = jnp.ones((), a.dtype)

    def cond(state):
        i, a, _ = state
        return (i < 200) & jnp.any(a != 0)

    def body(state):
        i, a, b = state
        live = a != 0
        r = lax.rem(b, jnp.where(live, a, one))
        return i + 1, jnp.where(live, r, a), jnp.where(live, a, b)

    return lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), a, b))[2]


@register(aten.gcd.default)
def gcd(self, other):
    a, b, dt = _int_binop(self, other, "gcd")
    return _gcd(a, b)


@register(aten.lcm.default)
def lcm(self, other):
    """CPU: g = gcd(a, b); g == 0 ? 0 : |a / g * b|, computed in C++'s int for 8/16-bit types
    (then narrowed, wrapping), in the type itself (wrapping) for 32/64-bit ones."""
    a, b, dt = _int_binop(self, other, "lcm")
    orig = a.dtype
    wide = orig.itemsize < 4
    if wide:
        a, b = a.astype(jnp.int32), b.astype(jnp.int32)
    g = _gcd(a, b)
    zero = g == 0
    q = lax.div(a, jnp.where(zero, jnp.ones((), g.dtype), g))
    r = jnp.where(zero, jnp.zeros((), g.dtype), jnp.abs(q * b))
    return r.astype(orig) if wide else r


# ---------------------------------------------------------------- pow

def _int_pow(a, b):
    """PyTorch's integer pow: negative exponents give 0 except for bases 1 and -1."""
    pos = jnp.power(a, jnp.maximum(b, 0).astype(a.dtype))
    if not jnp.issubdtype(b.dtype, jnp.signedinteger):
        return pos
    one = jnp.ones_like(a)
    odd = (-b) % 2 == 1
    neg = jnp.where(a == 1, one, jnp.where(a == -1, jnp.where(odd, -one, one), jnp.zeros_like(a)))
    return jnp.where(b < 0, neg, pos)


_FLOAT_EXP_SPECIAL = {2.0, 3.0, -1.0, -2.0, 0.5, -0.5, 1.0, 0.0}


@register(aten.pow.Tensor_Tensor)
def pow_tensor_tensor(self, exponent):
    a, b, dt = _binop(self, exponent)
    if dt == torch.bool:  # PyTorch has no bool pow kernel (a bool Python exponent is fine)
        raise NotImplementedError('"pow" not implemented for \'Bool\'')
    if _is_int(dt):
        return _int_pow(a, b)
    return jnp.power(a, b)


@register(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(self, exponent):
    dt = result_type(self, exponent)
    if dt == torch.bool:
        return self if exponent else jnp.ones(self.shape, jnp.bool_)
    a = cast(self, dt)
    if _is_int(dt):
        if isinstance(exponent, (int, bool)) and exponent < 0:
            raise RuntimeError("Integers to negative integer powers are not allowed.")
        return lax.integer_pow(a, int(exponent)) if int(exponent) <= 64 else _int_pow(a, cast(exponent, dt))
    if not isinstance(exponent, complex) and float(exponent) in _FLOAT_EXP_SPECIAL:
        e = float(exponent)
        if e == 0.0:
            return jnp.ones_like(a)
        if e == 1.0:
            return a
        if e == 2.0:
            return a * a
        if e == 3.0:
            return a * a * a
        if e == 0.5:
            return jnp.sqrt(a)
        if e == -0.5:
            return lax.rsqrt(a)
        if e == -1.0:
            return 1 / a
        if e == -2.0:
            return 1 / (a * a)
    return jnp.power(a, cast(exponent, dt))


@register(aten.pow.Scalar)
def pow_scalar(self, exponent):
    dt = result_type(self, exponent)
    if dt == torch.bool:
        raise NotImplementedError('"pow" not implemented for \'Bool\'')
    a = cast(self, dt)
    b = cast(exponent, dt)
    if _is_int(dt):
        return _int_pow(jnp.broadcast_to(a, b.shape), b)
    return jnp.power(a, b)


@register(aten.float_power.Tensor_Tensor, aten.float_power.Tensor_Scalar, aten.float_power.Scalar)
def float_power(self, exponent):
    cplx = any((is_array(x) and jdtype(x).is_complex) or isinstance(x, complex) for x in (self, exponent))
    dt = torch.complex128 if cplx else torch.float64
    return jnp.power(cast(self, dt), cast(exponent, dt))


# ---------------------------------------------------------------- unary

@register(aten.neg.default)
def neg(self):
    if self.dtype == jnp.bool_:
        raise RuntimeError("Negation, the `-` operator, on a bool tensor is not supported. If you are "
                           "trying to invert a mask, use the `~` or `logical_not()` operator instead.")
    return -self


@register(aten.abs.default)
def abs_(self):
    if self.dtype == jnp.bool_:
        raise NotImplementedError('"abs_cpu" not implemented for \'Bool\'')
    return jnp.abs(self)


@register(aten.sign.default)
def sign(self):
    if self.dtype == jnp.bool_:
        return self
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise NotImplementedError("Unlike NumPy, torch.sign is not intended to support complex "
                                  "numbers. Please use torch.sgn instead.")
    if jnp.issubdtype(self.dtype, jnp.floating):
        # PyTorch: (0 < x) - (x < 0), so sign(nan) == 0
        return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)
    return jnp.sign(self)


@register(aten.sgn.default)
def sgn(self):
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        mag = jnp.abs(self)
        return jnp.where(mag == 0, jnp.zeros_like(self), self / jnp.where(mag == 0, 1, mag).astype(self.dtype))
    return sign(self)


@register(aten.reciprocal.default)
def reciprocal(self):
    dt = float_result_type(self)
    return 1 / cast(self, dt)


@register(aten.rsqrt.default)
def rsqrt(self):
    return lax.rsqrt(cast(self, float_result_type(self)))


for _op, _fn in [
    (aten.sqrt.default, jnp.sqrt), (aten.exp.default, jnp.exp), (aten.exp2.default, jnp.exp2),
    (aten.expm1.default, jnp.expm1), (aten.log.default, jnp.log), (aten.log2.default, jnp.log2),
    (aten.log10.default, jnp.log10), (aten.log1p.default, jnp.log1p),
    (aten.sin.default, jnp.sin), (aten.cos.default, jnp.cos), (aten.tan.default, jnp.tan),
    (aten.asin.default, jnp.arcsin), (aten.acos.default, jnp.arccos), (aten.atan.default, jnp.arctan),
    (aten.sinh.default, jnp.sinh), (aten.cosh.default, jnp.cosh), (aten.tanh.default, jnp.tanh),
    (aten.asinh.default, jnp.arcsinh), (aten.acosh.default, jnp.arccosh),
    (aten.atanh.default, jnp.arctanh), (aten.erf.default, lax.erf), (aten.erfc.default, lax.erfc),
    (aten.erfinv.default, lax.erf_inv), (aten.lgamma.default, lax.lgamma),
    (aten.i0.default, jsp.i0), (aten.special_i0e.default, jsp.i0e), (aten.special_i1.default, jsp.i1),
    (aten.special_i1e.default, jsp.i1e), (aten.special_ndtri.default, jsp.ndtri),
    (aten.special_log_ndtr.default, jsp.log_ndtr), (aten.special_erfcx.default, jsp.erfcx),
    (aten.sigmoid.default, jax.nn.sigmoid), (aten.sinc.default, jnp.sinc),
    (aten.deg2rad.default, jnp.deg2rad), (aten.rad2deg.default, jnp.rad2deg),
]:
    register(_op)(_unary_float(_fn))


@register(aten.special_entr.default)
def special_entr(self):
    x = cast(self, float_result_type(self))
    safe = jnp.where(x > 0, x, 1)
    return jnp.where(jnp.isnan(x), x,
                     jnp.where(x > 0, -x * jnp.log(safe), jnp.where(x == 0, jnp.zeros_like(x), -jnp.inf)))


def _digamma(x):
    r = lax.digamma(x)
    # PyTorch: digamma(+-0) = -+inf; poles at negative integers give nan (jax agrees)
    return jnp.where(x == 0, jnp.copysign(jnp.full_like(x, jnp.inf), -x), r)


@register(aten.digamma.default)
def digamma(self):
    return _digamma(cast(self, float_result_type(self)))


def _polygamma_pos(n, x):
    """psi^(n)(x) = (-1)^(n+1) n! zeta(n+1, x) for n >= 1, valid for every real x.

    jax's Hurwitz zeta is only right for x > 0: shift x up with the recurrence
    zeta(s, x) = x^-s + zeta(s, x + 1) (a loop whose trip count is the most negative input).
    """
    s = jnp.asarray(n + 1, x.dtype)

    def cond(c):
        return jnp.any(c[0] < 1)

    def body(c):
        q, acc = c
        low = q < 1
        return jnp.where(low, q + 1, q), acc + jnp.where(low, q ** -s, 0)

    q, acc = lax.while_loop(cond, body, (jnp.where(jnp.isnan(x) | jnp.isinf(x), 1, x), jnp.zeros_like(x)))
    z = acc + jsp.zeta(s, q)
    sign = 1.0 if n % 2 else -1.0
    r = sign * math.exp(math.lgamma(n + 1.0)) * z
    r = jnp.where(jnp.isposinf(x), 0.0, r)
    return jnp.where(jnp.isnan(x), x, jnp.where(jnp.isneginf(x), jnp.nan, r))


def _trigamma(x):
    """PyTorch's CPU trigamma (reflection for x < 0.5, 6 recurrence steps, asymptotic series)."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(math.pi * x)
    result = jnp.where(reflect, -(math.pi * math.pi) / (sin_pi_x * sin_pi_x), jnp.zeros_like(x))
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / x
    return jnp.where(reflect, -result, result)


@register(aten.frexp.Tensor)
def frexp(self):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError("torch.frexp() only supports floating-point dtypes")
    m, e = jnp.frexp(self)
    return m.astype(self.dtype), e.astype(jnp.int32)


@register(aten.polygamma.default)
def polygamma(n, self):
    if n < 0:
        raise RuntimeError("polygamma(n, x) does not support negative n.")
    x = cast(self, float_result_type(self))
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _upcast(_trigamma)(x)
    # the shift recurrence sums many terms: accumulate in float64
    return _polygamma_pos(n, x.astype(jnp.float64)).astype(x.dtype)


@register(aten.special_zeta.default, aten.special_zeta.other_scalar, aten.special_zeta.self_scalar)
def special_zeta(self, other):
    dt = float_result_type(self, other)
    x, q, _ = _binop(self, other, dt)
    return _upcast(_zeta)(x, q)


def _zeta(x, q):
    # PyTorch's order of special cases (cephes): x == 1 -> inf; x < 1 -> nan; q a non-positive
    # integer -> inf
    r = jsp.zeta(x, q)
    r = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, r)
    r = jnp.where(x < 1, jnp.nan, r)
    return jnp.where(x == 1, jnp.inf, r).astype(x.dtype)


@register(aten.logit.default)
def logit(self, eps=None):
    x = cast(self, float_result_type(self))
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@register(aten.ceil.default)
def ceil(self):
    return self if _is_intlike(jdtype(self)) else jnp.ceil(self)


@register(aten.floor.default)
def floor(self):
    return self if _is_intlike(jdtype(self)) else jnp.floor(self)


@register(aten.trunc.default)
def trunc(self):
    return self if _is_intlike(jdtype(self)) else jnp.trunc(self)


@register(aten.round.default)
def round_(self):
    return self if _is_intlike(jdtype(self)) else jnp.round(self)


@register(aten.round.decimals)
def round_decimals(self, *, decimals):
    if _is_intlike(jdtype(self)):
        return self
    if decimals == 0:
        return jnp.round(self)
    x = self.astype(jnp.float32) if self.dtype in (jnp.float16, jnp.bfloat16) else self
    if decimals > 0:
        p = jnp.asarray(10.0 ** decimals, x.dtype)
        r = jnp.round(x * p) / p
    else:
        p = jnp.asarray(10.0 ** (-decimals), x.dtype)
        r = jnp.round(x / p) * p
    return r.astype(self.dtype)


@register(aten.frac.default)
def frac(self):
    if _is_intlike(jdtype(self)):
        raise NotImplementedError(f'"frac_cpu" not implemented for \'{_tname(jdtype(self))}\'')
    return self - jnp.trunc(self)


@register(aten.signbit.default)
def signbit(self):
    dt = jdtype(self)
    if dt == torch.bool:
        return jnp.zeros(self.shape, jnp.bool_)
    if _is_intlike(dt):
        return self < 0
    return jnp.signbit(self)


@register(aten.isnan.default)
def isnan(self):
    return jnp.isnan(self) if not _is_intlike(jdtype(self)) else jnp.zeros(self.shape, jnp.bool_)


@register(aten.isinf.default)
def isinf(self):
    return jnp.isinf(self) if not _is_intlike(jdtype(self)) else jnp.zeros(self.shape, jnp.bool_)


@register(aten.isfinite.default)
def isfinite(self):
    return jnp.isfinite(self) if not _is_intlike(jdtype(self)) else jnp.ones(self.shape, jnp.bool_)


@register(aten.isposinf.default)
def isposinf(self):
    if jdtype(self).is_complex:
        raise RuntimeError("isposinf does not support complex inputs.")
    return jnp.isposinf(self) if not _is_intlike(jdtype(self)) else jnp.zeros(self.shape, jnp.bool_)


@register(aten.isneginf.default)
def isneginf(self):
    if jdtype(self).is_complex:
        raise RuntimeError("isneginf does not support complex inputs.")
    return jnp.isneginf(self) if not _is_intlike(jdtype(self)) else jnp.zeros(self.shape, jnp.bool_)


@register(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    dt = jdtype(self)
    if _is_intlike(dt):
        return self
    if dt.is_complex:
        re = nan_to_num(jnp.real(self), nan, posinf, neginf)
        im = nan_to_num(jnp.imag(self), nan, posinf, neginf)
        return lax.complex(re, im)
    fi = jnp.finfo(self.dtype)
    nan_v = jnp.asarray(0.0 if nan is None else nan, self.dtype)
    pos_v = jnp.asarray(fi.max if posinf is None else posinf, self.dtype)
    neg_v = jnp.asarray(fi.min if neginf is None else neginf, self.dtype)
    x = jnp.where(jnp.isnan(self), nan_v, self)
    x = jnp.where(jnp.isposinf(self), pos_v, x)
    return jnp.where(jnp.isneginf(self), neg_v, x)


@register(aten.conj_physical.default)
def conj_physical(self):
    return jnp.conj(self) if jnp.issubdtype(self.dtype, jnp.complexfloating) else self


@register(aten._conj.default)
def _conj(self):
    """The lazy-conjugate view, for graphs (eager keeps PyTorch's view kernel): a graph value
    is what the view reads, the conjugate (complex RoPE's backward has it; as a CPU callback
    it failed: numpy() refuses a tensor with the conjugate bit)."""
    return conj_physical(self)


@register(aten.angle.default)
def angle(self):
    dt = jdtype(self)
    if dt.is_complex:
        return jnp.angle(self)
    x = cast(self, float_result_type(self))
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.asarray(np.pi, x.dtype), jnp.zeros_like(x)))


# ---------------------------------------------------------------- binary float math

def _binary_float(jfn, name):
    up = _upcast(jfn)

    def lowering(self, other):
        dt = float_result_type(self, other)
        return up(cast(self, dt), cast(other, dt))

    lowering.__name__ = name
    return lowering


register(aten.atan2.default)(_binary_float(jnp.arctan2, "atan2"))
register(aten.hypot.default)(_binary_float(jnp.hypot, "hypot"))
register(aten.copysign.Tensor, aten.copysign.Scalar)(_binary_float(jnp.copysign, "copysign"))


@register(aten.nextafter.default)
def nextafter(self, other):
    a, b, dt = _binop(self, other)
    return jnp.nextafter(a, b)


@register(aten.xlogy.Tensor, aten.xlogy.Scalar_Other, aten.xlogy.Scalar_Self)
def xlogy(self, other):
    dt = float_result_type(self, other)
    x, y = cast(self, dt), cast(other, dt)
    x, y = jnp.broadcast_arrays(x, y)
    r = x * jnp.log(y)
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(r), r))


@register(aten.special_xlog1py.default, aten.special_xlog1py.other_scalar,
          aten.special_xlog1py.self_scalar)
def xlog1py(self, other):
    dt = float_result_type(self, other)
    x, y = cast(self, dt), cast(other, dt)
    x, y = jnp.broadcast_arrays(x, y)
    r = x * jnp.log1p(y)
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(r), r))


@register(aten.heaviside.default)
def heaviside(self, values):
    if jdtype(self) != jdtype(values):
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes")
    x, v = jnp.broadcast_arrays(self, values)
    return jnp.where(x == 0, v, (x > 0).astype(x.dtype))


@register(aten.logaddexp.default)
def logaddexp(self, other):
    a, b, dt = _binop(self, other)
    return _upcast(_logaddexp)(a, b)


def _logaddexp(a, b):
    m = jnp.maximum(a, b)
    r = m + jnp.log1p(jnp.exp(-jnp.abs(a - b)))
    return jnp.where(jnp.isinf(a) & (a == b), a, r)


@register(aten.logaddexp2.default)
def logaddexp2(self, other):
    a, b, dt = _binop(self, other)
    return _upcast(_logaddexp2)(a, b)


def _logaddexp2(a, b):
    m = jnp.maximum(a, b)
    r = m + jnp.log1p(jnp.exp2(-jnp.abs(a - b))) / jnp.log(jnp.asarray(2.0, a.dtype))
    return jnp.where(jnp.isinf(a) & (a == b), a, r)


# ---------------------------------------------------------------- clamp / min / max / lerp

def _clamp(x, lo, hi):
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


@register(aten.clamp.default, aten.clamp.Tensor)
def clamp(self, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    dt = result_type(self, min, max)
    if dt == torch.bool:
        raise NotImplementedError('"clamp_cpu" not implemented for \'Bool\'')
    lo = None if min is None else cast(min, dt)
    hi = None if max is None else cast(max, dt)
    return _clamp(cast(self, dt), lo, hi)


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self, min):
    dt = result_type(self, min)
    return jnp.maximum(cast(self, dt), cast(min, dt))


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self, max):
    dt = result_type(self, max)
    return jnp.minimum(cast(self, dt), cast(max, dt))


def _minmax(jfn, name):
    def lowering(self, other):
        a, b, dt = _binop(self, other)
        if dt.is_complex:
            raise RuntimeError(f"{name} not implemented for complex tensors.")
        if dt == torch.bool:
            return jnp.logical_or(a, b) if "max" in name else jnp.logical_and(a, b)
        return jfn(a, b)

    lowering.__name__ = name
    return lowering


register(aten.maximum.default)(_minmax(jnp.maximum, "maximum"))
register(aten.minimum.default)(_minmax(jnp.minimum, "minimum"))
register(aten.fmax.default)(_minmax(jnp.fmax, "fmax"))
register(aten.fmin.default)(_minmax(jnp.fmin, "fmin"))


def _lerp(a, b, w):
    if a.dtype in (jnp.float16, jnp.bfloat16):  # opmath: compute in float32, round once
        return _lerp(a.astype(jnp.float32), b.astype(jnp.float32),
                     jnp.asarray(w).astype(jnp.float32)).astype(a.dtype)
    diff = b - a
    return jnp.where(jnp.abs(w) < 0.5, a + w * diff, b - diff * (1 - w))


@register(aten.lerp.Scalar)
def lerp_scalar(self, end, weight):
    dt = jdtype(self)
    if jdtype(end) != dt:
        raise RuntimeError(f"expected dtype {dt} for `end` but got dtype {jdtype(end)}")
    # a float16/bfloat16 lerp computes in float32 with the weight unrounded, as CPU's does
    return _lerp(self, end, cast(weight, torch.float32 if dt in (torch.float16, torch.bfloat16)
                                 else dt))


@register(aten.lerp.Tensor)
def lerp_tensor(self, end, weight):
    dt = jdtype(self)
    if jdtype(end) != dt:
        raise RuntimeError(f"expected dtype {dt} for `end` but got dtype {jdtype(end)}")
    if jdtype(weight) != dt:
        raise RuntimeError(f"expected dtype {dt} for `weight` but got dtype {jdtype(weight)}")
    return _lerp(self, end, weight)


@register(aten.addcmul.default, scalar_args=("value",))
def addcmul(self, tensor1, tensor2, *, value=1):
    dt = result_type(self, tensor1, tensor2)
    s, t1, t2 = cast(self, dt), cast(tensor1, dt), cast(tensor2, dt)
    if dt == torch.bool:
        return s | (t1 & t2) if value else s
    if dt in (torch.float16, torch.bfloat16):
        f = jnp.float32
        return (s.astype(f) + cast(value, torch.float32) * t1.astype(f) * t2.astype(f)).astype(s.dtype)
    return s + cast(value, dt) * t1 * t2


@register(aten.addcdiv.default, scalar_args=("value",))
def addcdiv(self, tensor1, tensor2, *, value=1):
    dt = result_type(self, tensor1, tensor2)
    if _is_intlike(jdtype(tensor1)) and _is_intlike(jdtype(tensor2)):
        raise RuntimeError("Integer division with addcdiv is no longer supported, and in a future "
                           "release addcdiv will perform a true division of tensor1 and tensor2. "
                           "The historic addcdiv behavior can be implemented as "
                           "(input + value * torch.trunc(tensor1 / tensor2)).to(input.dtype) for "
                           "integer inputs and as (input + value * tensor1 / tensor2) for float "
                           "inputs. The future addcdiv behavior is just the latter implementation: "
                           "(input + value * tensor1 / tensor2), for all dtypes.")
    s, t1, t2 = cast(self, dt), cast(tensor1, dt), cast(tensor2, dt)
    if dt in (torch.float16, torch.bfloat16):
        f = jnp.float32
        return (s.astype(f) + cast(value, torch.float32) * (t1.astype(f) / t2.astype(f))).astype(s.dtype)
    return s + cast(value, dt) * (t1 / t2)


# ---------------------------------------------------------------- bitwise / logical / comparison

def _bitwise(jfn, name):
    def lowering(self, other):
        a, b, dt = _binop(self, other)
        if not _is_intlike(dt):
            raise NotImplementedError(f'"{name}_cpu" not implemented for \'{_tname(dt)}\'')
        return jfn(a, b)

    lowering.__name__ = name
    return lowering


for _pk, _fn, _nm in [(aten.bitwise_and, jnp.bitwise_and, "bitwise_and"),
                      (aten.bitwise_or, jnp.bitwise_or, "bitwise_or"),
                      (aten.bitwise_xor, jnp.bitwise_xor, "bitwise_xor")]:
    register(_pk.Tensor, _pk.Scalar, _pk.Scalar_Tensor)(_bitwise(_fn, _nm))
register(aten.__and__.Tensor, aten.__and__.Scalar)(_bitwise(jnp.bitwise_and, "bitwise_and"))
register(aten.__or__.Tensor, aten.__or__.Scalar)(_bitwise(jnp.bitwise_or, "bitwise_or"))
register(aten.__xor__.Tensor, aten.__xor__.Scalar)(_bitwise(jnp.bitwise_xor, "bitwise_xor"))


@register(aten.bitwise_not.default)
def bitwise_not(self):
    dt = jdtype(self)
    if not _is_intlike(dt):
        raise NotImplementedError(f'"bitwise_not_cpu" not implemented for \'{_tname(dt)}\'')
    return jnp.logical_not(self) if dt == torch.bool else jnp.bitwise_not(self)


def _lshift(a, b):
    bits = jnp.iinfo(a.dtype).bits
    ok = (b >= 0) & (b < bits)
    return jnp.where(ok, lax.shift_left(a, jnp.where(ok, b, 0)), jnp.zeros_like(a))


def _rshift(a, b):
    bits = jnp.iinfo(a.dtype).bits
    signed = jnp.issubdtype(a.dtype, jnp.signedinteger)
    ok = (b >= 0) & (b < bits)
    sh = lax.shift_right_arithmetic if signed else lax.shift_right_logical
    inrange = sh(a, jnp.where(ok, b, 0))
    if signed:
        return jnp.where(ok, inrange, sh(a, jnp.full_like(a, bits - 1)))
    return jnp.where(ok, inrange, jnp.zeros_like(a))


def _shift(jfn, name):
    def lowering(self, other):
        a, b, dt = _binop(self, other)
        if not _is_int(dt):
            raise NotImplementedError(f'"{name}_cpu" not implemented for \'{_tname(dt)}\'')
        a, b = jnp.broadcast_arrays(a, b)
        return jfn(a, b)

    lowering.__name__ = name
    return lowering


register(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
         aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor,
         aten.__lshift__.Scalar)(_shift(_lshift, "lshift"))
register(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
         aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor,
         aten.__rshift__.Scalar)(_shift(_rshift, "rshift"))


def _nz(x):
    return x if x.dtype == jnp.bool_ else x != 0


@register(aten.logical_and.default)
def logical_and(self, other):
    return jnp.logical_and(_nz(self), _nz(other))


@register(aten.logical_or.default)
def logical_or(self, other):
    return jnp.logical_or(_nz(self), _nz(other))


@register(aten.logical_xor.default)
def logical_xor(self, other):
    return jnp.logical_xor(_nz(self), _nz(other))


@register(aten.logical_not.default)
def logical_not(self):
    return jnp.logical_not(_nz(self))


def _compare(jfn, name):
    def lowering(self, other):
        a, b, dt = _binop(self, other)
        return jfn(a, b)

    lowering.__name__ = name
    return lowering


for _pk, _fn in [(aten.eq, jnp.equal), (aten.ne, jnp.not_equal), (aten.lt, jnp.less),
                 (aten.le, jnp.less_equal), (aten.gt, jnp.greater), (aten.ge, jnp.greater_equal)]:
    register(_pk.Tensor, _pk.Scalar)(_compare(_fn, _pk.__name__))


# ---------------------------------------------------------------- complex inputs CPU refuses

def _refusing_complex(fn, exc, message):
    """``fn``, raising PyTorch CPU's error for a complex input (ops it has no complex kernel
    for; JAX would raise a TypeError naming its own primitive, or compute a value)."""

    @functools.wraps(fn)
    def lowering(self, *args, **kwargs):
        if is_array(self) and jnp.issubdtype(self.dtype, jnp.complexfloating):
            raise exc(message.format(t=_tname(self.dtype)))
        return fn(self, *args, **kwargs)

    return lowering


def _vml(name):
    return (NotImplementedError, f'"{name}" not implemented for \'{{t}}\'')


for _op, (_exc, _msg) in {
    aten.erf.default: _vml("erf_vml_cpu"), aten.erfc.default: _vml("erfc_vml_cpu"),
    aten.erfinv.default: _vml("erfinv_vml_cpu"), aten.lgamma.default: _vml("lgamma_vml_cpu"),
    aten.digamma.default: _vml("digamma"), aten.i0.default: _vml("i0_vml_cpu"),
    aten.special_i0e.default: _vml("i0e_cpu"), aten.special_i1.default: _vml("i1_cpu"),
    aten.special_i1e.default: _vml("i1e_cpu"), aten.special_ndtri.default: _vml("ndtri_cpu"),
    aten.special_log_ndtr.default: _vml("log_ndtr_cpu"),
    aten.special_erfcx.default: _vml("erfcx_cpu"), aten.round.default: _vml("round_vml_cpu"),
    aten.round.decimals: _vml("round_vml_cpu"), aten.frac.default: _vml("frac_cpu"),
    aten.floor.default: (NotImplementedError, "floor is not supported for complex inputs"),
    aten.ceil.default: (NotImplementedError, "ceil is not supported for complex inputs"),
    aten.trunc.default: (NotImplementedError, "trunc is not supported for complex inputs"),
    aten.deg2rad.default: (RuntimeError, "deg2rad is not supported for complex tensors."),
    aten.rad2deg.default: (RuntimeError, "rad2deg is not supported for complex tensors."),
}.items():
    if _op in registry.LOWERINGS:
        registry.LOWERINGS[_op].fn = _refusing_complex(registry.LOWERINGS[_op].fn, _exc, _msg)
