"""Activation functions and the backward ops autograd calls for them.

Half/bfloat16 inputs compute in float32 and round once at the end (PyTorch's opmath on CPU).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ._util import canonical_dim
from .registry import aten, register


_LOW = (jnp.float16, jnp.bfloat16)


def _opmath(fn):
    """Compute ``fn`` on float32 copies of half/bfloat16 arrays; cast the result(s) back."""

    def wrapped(*args, **kwargs):
        arrays = [a for a in args if hasattr(a, "dtype")]
        dt = arrays[0].dtype if arrays else None
        if dt in _LOW:
            args = tuple(a.astype(jnp.float32) if hasattr(a, "dtype") and a.dtype == dt else a
                         for a in args)
            out = fn(*args, **kwargs)
            if isinstance(out, tuple):
                return tuple(o.astype(dt) for o in out)
            return out.astype(dt)
        return fn(*args, **kwargs)

    wrapped.__name__ = fn.__name__
    return wrapped


def _c(v, x):
    return jnp.asarray(v, x.dtype)


@register(aten.relu.default)
def relu(self):
    if self.dtype == jnp.bool_:
        raise NotImplementedError('"clamp_min_scalar_cpu" not implemented for \'Bool\'')
    return jnp.maximum(self, jnp.zeros((), self.dtype))


@register(aten.threshold.default)
def threshold(self, threshold, value):
    return jnp.where(self <= _c(threshold, self), _c(value, self), self)


@register(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= _c(threshold, self), jnp.zeros((), grad_output.dtype), grad_output)


_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_SQRT1_2 = math.sqrt(0.5)


@register(aten.gelu.default)
@_opmath
def gelu(self, *, approximate="none"):
    if approximate == "tanh":
        inner = _SQRT_2_PI * (self + 0.044715 * self * self * self)
        return 0.5 * self * (1 + jnp.tanh(inner))
    return self * 0.5 * (1 + lax.erf(self * _SQRT1_2))


@register(aten.gelu_backward.default)
@_opmath
def gelu_backward(grad_output, self, *, approximate="none"):
    x = self
    if approximate == "tanh":
        kappa = 0.044715
        x_sq = x * x
        inner = _SQRT_2_PI * (x + kappa * x_sq * x)
        t = jnp.tanh(inner)
        left = 0.5 * x
        right = 1 + t
        left_d = 0.5 * right
        dinner = _SQRT_2_PI * (1 + 3 * kappa * x_sq)
        right_d = left * (1 - t * t) * dinner
        return grad_output * (left_d + right_d)
    cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
    pdf = jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2 * math.pi))
    return grad_output * (cdf + x * pdf)


@register(aten.silu.default)
@_opmath
def silu(self):
    return self * jax.nn.sigmoid(self)


@register(aten.silu_backward.default)
@_opmath
def silu_backward(grad_output, self):
    s = jax.nn.sigmoid(self)
    return grad_output * s * (1 + self * (1 - s))


def _softplus1(x):
    # log1p(exp(x)) without overflow
    return jnp.logaddexp(x, jnp.zeros((), x.dtype))


@register(aten.mish.default)
@_opmath
def mish(self):
    return self * jnp.tanh(_softplus1(self))


@register(aten.mish_backward.default)
@_opmath
def mish_backward(grad_output, self):
    s = jax.nn.sigmoid(self)
    t = jnp.tanh(_softplus1(self))
    return grad_output * (t + self * s * (1 - t * t))


@register(aten.hardswish.default)
@_opmath
def hardswish(self):
    return self * jnp.clip(self + 3, 0, 6) / 6


@register(aten.hardswish_backward.default)
@_opmath
def hardswish_backward(grad_output, self):
    return jnp.where(self < -3, jnp.zeros((), self.dtype),
                     jnp.where(self <= 3, grad_output * (self / 3 + 0.5), grad_output))


@register(aten.hardsigmoid.default)
@_opmath
def hardsigmoid(self):
    return jnp.clip(self + 3, 0, 6) / 6


@register(aten.hardsigmoid_backward.default)
@_opmath
def hardsigmoid_backward(grad_output, self):
    return jnp.where((self > -3) & (self < 3), grad_output / 6, jnp.zeros((), grad_output.dtype))


@register(aten.elu.default)
@_opmath
def elu(self, alpha=1, scale=1, input_scale=1):
    neg = alpha * jnp.expm1(self * input_scale)
    return jnp.where(self > 0, self * scale, neg * scale)


@register(aten.elu_backward.default)
@_opmath
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    x = self_or_result
    if is_result:
        if alpha < 0:
            raise RuntimeError("In-place elu backward calculation is triggered with a negative "
                               "slope which is not supported. This is caused by calling in-place "
                               "forward function with a negative slope, please call out-of-place "
                               "version instead.")
        neg = grad_output * input_scale * (x + alpha * scale)
    else:
        neg = grad_output * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, neg, grad_output * scale)


@register(aten.celu.default)
@_opmath
def celu(self, alpha=1.0):
    if alpha == 0:
        raise RuntimeError("ZeroDivisionError")
    return elu(self, alpha, 1.0, 1.0 / alpha)


@register(aten.leaky_relu.default)
@_opmath
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope)


@register(aten.leaky_relu_backward.default)
@_opmath
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    if self_is_result and negative_slope < 0:
        raise RuntimeError("In-place leakyReLu backward calculation is triggered with a negative "
                           "slope which is not supported. This is caused by calling in-place "
                           "forward function with a negative slope, please call out-of-place "
                           "version instead. File an issue at https://github.com/pytorch/pytorch "
                           "if you do require supporting in-place leakRelu backward calculation "
                           "with negative slope")
    return jnp.where(self > 0, grad_output, grad_output * negative_slope)


@register(aten.softplus.default)
@_opmath
def softplus(self, beta=1, threshold=20):
    bx = self * beta
    return jnp.where(bx > threshold, self, jnp.log1p(jnp.exp(bx)) / beta)


@register(aten.softplus_backward.default)
@_opmath
def softplus_backward(grad_output, self, beta, threshold):
    bx = self * beta
    z = jnp.exp(bx)
    return jnp.where(bx > threshold, grad_output, grad_output * z / (z + 1))


@register(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    if self.dtype == jnp.bool_:
        raise RuntimeError("Bool inputs not supported for hardtanh")
    return jnp.minimum(jnp.maximum(self, _c(min_val, self)), _c(max_val, self))


@register(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    return jnp.where((self <= min_val) | (self >= max_val), jnp.zeros((), grad_output.dtype),
                     grad_output)


@register(aten.sigmoid_backward.default)
@_opmath
def sigmoid_backward(grad_output, output):
    if jnp.issubdtype(output.dtype, jnp.complexfloating):
        return grad_output * jnp.conj((1 - output) * output)
    return grad_output * (1 - output) * output


@register(aten.tanh_backward.default)
@_opmath
def tanh_backward(grad_output, output):
    if jnp.issubdtype(output.dtype, jnp.complexfloating):
        return grad_output * jnp.conj(1 - output * output)
    return grad_output * (1 - output * output)


@register(aten.logit_backward.default)
@_opmath
def logit_backward(grad_output, self, eps=None):
    x = self
    g = grad_output / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.full_like(g, jnp.nan), g)
    return jnp.where((x < eps) | (x > 1 - eps), jnp.zeros_like(g), g)


@register(aten.glu.default)
@_opmath
def glu(self, dim=-1):
    d = canonical_dim(dim, self.ndim)
    if self.shape[d] % 2:
        raise RuntimeError(f"Halving dimension must be even, but dimension {d} is size "
                           f"{self.shape[d]}")
    a, b = jnp.split(self, 2, axis=d)
    return a * jax.nn.sigmoid(b)


@register(aten.glu_backward.default)
@_opmath
def glu_backward(grad_output, self, dim):
    d = canonical_dim(dim, self.ndim)
    a, b = jnp.split(self, 2, axis=d)
    s = jax.nn.sigmoid(b)
    return jnp.concatenate([grad_output * s, grad_output * a * s * (1 - s)], axis=d)


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    # the buffer is an implementation detail of PyTorch's CPU kernel; like CUDA we return an
    # empty one and log_sigmoid_backward does not read it
    out = _opmath(lambda x: -_softplus1(-x))(self)
    return out, jnp.zeros((0,), self.dtype)


@register(aten.log_sigmoid_backward.default)
@_opmath
def log_sigmoid_backward(grad_output, self, buffer):
    # d/dx log(sigmoid(x)) = 1 - sigmoid(x) = sigmoid(-x)
    return grad_output * jax.nn.sigmoid(-self)


def _prelu_w(self, weight):
    # weight has one element or one per channel (dim 1 of the input)
    if weight.size == 1 or self.ndim < 2:
        return weight.reshape(())
    shape = [1] * self.ndim
    shape[1] = weight.size
    return weight.reshape(shape)


@register(aten._prelu_kernel.default)
@_opmath
def prelu_kernel(self, weight):
    return jnp.where(self > 0, self, _prelu_w(self, weight) * self)


@register(aten._prelu_kernel_backward.default)
@_opmath
def prelu_kernel_backward(grad_output, self, weight):
    w = _prelu_w(self, weight)
    gx = jnp.where(self > 0, grad_output, w * grad_output)
    gw_full = jnp.where(self > 0, jnp.zeros_like(self), self * grad_output)
    if weight.size == 1 or self.ndim < 2:
        gw = jnp.sum(gw_full).reshape(weight.shape)
    else:
        axes = tuple(i for i in range(self.ndim) if i != 1)
        gw = jnp.sum(gw_full, axis=axes).reshape(weight.shape)
    return gx, gw


@register(aten.softshrink.default)
@_opmath
def softshrink(self, lambd=0.5):
    return jnp.where(self > lambd, self - lambd, jnp.where(self < -lambd, self + lambd,
                                                           jnp.zeros_like(self)))


@register(aten.softshrink_backward.default)
def softshrink_backward(grad_output, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_output.dtype),
                     grad_output)


@register(aten.hardshrink.default)
def hardshrink(self, lambd=0.5):
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), self.dtype), self)


@register(aten.hardshrink_backward.default)
def hardshrink_backward(grad_out, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_out.dtype), grad_out)
