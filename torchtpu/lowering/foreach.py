"""``_foreach_*`` lowerings: a whole list of tensors in one XLA program.

Optimizers (``foreach=True``, PyTorch's default on accelerators) update every parameter with a
handful of these, so each is one program instead of one per tensor. The step-dependent scalars
(Adam's bias corrections, a scheduled learning rate) are traced (``scalar_args``), so a training
loop does not recompile every step.

Unary and min/max/clamp/pow/lerp/norm variants map the element lowering of the base op over the
lists; they are registered by ``register_all()`` once every family module has filled the table.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch

from . import elementwise as _ew, registry
from ._util import cast, result_type, to_jax
from .registry import aten, register


try:  # a traced Scalar[] element should promote like a Python number, as PyTorch's does
    from jax._src.lax.lax import _convert_element_type as _cet

    def _weak(s):
        return _cet(s, weak_type=True)
except ImportError:  # pragma: no cover
    def _weak(s):
        return s


def _scalars(scalars, n):
    """A Scalar[] argument (a traced 1-d array or a list) as n weakly typed scalars."""
    if isinstance(scalars, (list, tuple)):
        return list(scalars)
    return [_weak(scalars[i]) for i in range(n)]


# ---- arithmetic, written out so no scalar is branched on (they are traced) ----

def _arith(op, x, y, alpha=1):
    dt = result_type(x, y)
    if dt in (torch.float16, torch.bfloat16):
        # CPU runs a foreach op tensor by tensor: float16/bfloat16 take the element ops'
        # float32 opmath (a scalar factor or divisor unrounded, alpha applied in float32)
        if op in ("add", "sub"):
            return getattr(_ew, op)(x, y, alpha)
        return getattr(_ew, op)(x, y)
    a = cast(x, dt)
    b = y if not hasattr(y, "dtype") else cast(y, dt)
    if op == "add":
        return (a + b * alpha).astype(to_jax(dt))
    if op == "sub":
        return (a - b * alpha).astype(to_jax(dt))
    if op == "mul":
        return (a * b).astype(to_jax(dt))
    # true division: integer inputs give the default float dtype, as torch.div does
    if not (dt.is_floating_point or dt.is_complex):
        dt = torch.get_default_dtype()
        a = cast(x, dt)
        b = y if not hasattr(y, "dtype") else cast(y, dt)
    return (a / b).astype(to_jax(dt))


def _make_arith(op):
    def list_(self, other, *, alpha=1):
        return [_arith(op, x, y, alpha) for x, y in zip(self, other)]

    def scalar(self, scalar):
        return [_arith(op, x, scalar) for x in self]

    def scalar_list(self, scalars):
        return [_arith(op, x, s) for x, s in zip(self, _scalars(scalars, len(self)))]

    def tensor(self, other, *, alpha=1):
        return [_arith(op, x, other, alpha) for x in self]

    packet = getattr(aten, "_foreach_" + op)
    register(packet.List, scalar_args=("alpha",))(list_)
    register(packet.Scalar, scalar_args=("scalar",))(scalar)
    register(packet.ScalarList, scalar_args=("scalars",))(scalar_list)
    if "Tensor" in packet.overloads():
        register(packet.Tensor, scalar_args=("alpha",))(tensor)


for _op in ("add", "sub", "mul", "div"):
    _make_arith(_op)


def _addc(div, x, t1, t2, value):
    dt = result_type(x, t1, t2)
    a, b, c = cast(x, dt), cast(t1, dt), cast(t2, dt)
    if dt in (torch.float16, torch.bfloat16):  # addcmul/addcdiv's float32 opmath
        f = jnp.float32
        a, b, c, value = a.astype(f), b.astype(f), c.astype(f), cast(value, torch.float32)
    return (a + value * (b / c if div else b * c)).astype(to_jax(dt))


def _make_addc(div):
    packet = aten._foreach_addcdiv if div else aten._foreach_addcmul

    @register(packet.Scalar, scalar_args=("value",))
    def scalar(self, tensor1, tensor2, value=1):
        return [_addc(div, x, a, b, value) for x, a, b in zip(self, tensor1, tensor2)]

    @register(packet.ScalarList, scalar_args=("scalars",))
    def scalar_list(self, tensor1, tensor2, scalars):
        vals = _scalars(scalars, len(self))
        return [_addc(div, x, a, b, v) for x, a, b, v in zip(self, tensor1, tensor2, vals)]

    @register(packet.Tensor)
    def tensor(self, tensor1, tensor2, scalars):
        vals = scalars.reshape(-1)
        return [_addc(div, x, a, b, vals[i]) for i, (x, a, b) in
                enumerate(zip(self, tensor1, tensor2))]

    # PyTorch wants ``scalars`` on the CPU (CUDA's kernel reads it there): move it over
    registry.LOWERINGS[packet.Tensor].meta["host_tensors"] = True


_make_addc(False)
_make_addc(True)


@register(aten._foreach_lerp.Scalar, scalar_args=("weight",))
def lerp_scalar(self, tensors1, weight):
    return [_lerp(x, y, weight) for x, y in zip(self, tensors1)]


@register(aten._foreach_lerp.ScalarList, scalar_args=("weight",))
def lerp_scalar_list(self, tensors1, weight):
    return [_lerp(x, y, w) for x, y, w in zip(self, tensors1, _scalars(weight, len(self)))]


@register(aten._foreach_lerp.List)
def lerp_list(self, tensors1, weights):
    return [_lerp(x, y, w) for x, y, w in zip(self, tensors1, weights)]


def _lerp(x, y, w):
    """PyTorch's lerp: x + w*(y-x) for |w| < 0.5, else y - (y-x)*(1-w) (exact at w = 1)."""
    dt = x.dtype
    if dt in (jnp.float16, jnp.bfloat16):  # lerp's float32 opmath, the weight unrounded
        return _ew._lerp(x, y.astype(dt), w)
    w = jnp.asarray(w).astype(dt) if not hasattr(w, "dtype") or w.dtype != dt else w
    d = y.astype(dt) - x
    return jnp.where(jnp.abs(w) < 0.5, x + w * d, y.astype(dt) - d * (1 - w)).astype(dt)


@register(aten._foreach_copy.default)
def copy(self, src, non_blocking=False):
    return [jnp.broadcast_to(s.astype(x.dtype), x.shape) for x, s in zip(self, src)]


@register(aten._foreach_zero.default)
def zero(self):
    return [jnp.zeros_like(x) for x in self]


@register(aten._foreach_clone.default)
def clone(self, *, memory_format=None):
    return [x for x in self]


@register(aten._foreach_mm.default)
def mm(self, mat2):
    return [jnp.matmul(a, b, precision="highest") for a, b in zip(self, mat2)]


# ---- the rest map a base op's lowering over the lists ----

_UNARY = ("abs acos asin atan ceil cos cosh erf erfc exp expm1 floor frac lgamma log log10 "
          "log1p log2 neg reciprocal round rsqrt sigmoid sign sin sinh sqrt tan tanh trunc").split()
_BINARY = ("clamp_max", "clamp_min", "maximum", "minimum", "pow")


def _unary(base):
    def fn(self):
        return [base(x) for x in self]

    return fn


def _binary_list(base):
    def fn(self, other):
        return [base(x, y) for x, y in zip(self, other)]

    return fn


def _binary_scalar(base):
    def fn(self, scalar):
        return [base(x, scalar) for x in self]

    return fn


def _binary_scalar_list(base):
    def fn(self, scalars):
        return [base(x, s) for x, s in zip(self, scalars)]

    return fn


def _lowering_fn(op):
    low = registry.get(op)
    return None if low is None else low.fn


def register_all() -> None:
    """Register the mapped foreach ops whose base op has a lowering (call after all families)."""
    for name in _UNARY:
        base = _lowering_fn(getattr(aten, name).default)
        if base is not None:
            register(getattr(aten, "_foreach_" + name).default)(_unary(base))
    for name in _BINARY:
        packet = getattr(aten, "_foreach_" + name)
        if name == "pow":
            tensor_op, scalar_op = aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar
            names = {"List": tensor_op, "Scalar": scalar_op, "ScalarList": scalar_op}
        elif name.startswith("clamp"):
            names = {"List": getattr(aten, name).Tensor, "Scalar": getattr(aten, name).default,
                     "ScalarList": getattr(aten, name).default}
        else:
            names = {"List": getattr(aten, name).default}
        makers = {"List": _binary_list, "Scalar": _binary_scalar, "ScalarList": _binary_scalar_list}
        for ov, base_op in names.items():
            base = _lowering_fn(base_op)
            if base is not None and ov in packet.overloads():
                register(getattr(packet, ov))(makers[ov](base))
    norm = _lowering_fn(aten.linalg_vector_norm.default)
    if norm is not None:
        @register(aten._foreach_norm.Scalar)
        def foreach_norm(self, ord=2, dtype=None):
            return [norm(x, ord, None, False, dtype=dtype) for x in self]
    amax = _lowering_fn(aten.max.default)
    if amax is not None:
        @register(aten._foreach_max.default)
        def foreach_max(self):
            return [amax(x) for x in self]
