"""Loss lowerings (forward and backward), PyTorch semantics.

``reduction`` is PyTorch's enum: 0 none, 1 mean, 2 sum. (l1_loss, kl_div and cross_entropy are
CompositeImplicitAutograd in PyTorch: they decompose before reaching the backend.) Class indices are never checked
against the data (a lowering cannot branch on data, and raising would need a host sync): an
out-of-range target makes the loss (and its gradient) NaN instead of raising as PyTorch's CPU
kernel does, so the error is visible, never a plausible wrong number.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ._util import cast, result_type
from .registry import aten, register

NONE, MEAN, SUM = 0, 1, 2


def _acc(dtype):
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _reduce(loss, reduction):
    if reduction == NONE:
        return loss
    acc = _acc(loss.dtype)
    s = jnp.sum(loss.astype(acc))
    if reduction == MEAN:
        s = s / loss.size
    return s.astype(loss.dtype)


def _grad_scale(grad_output, reduction, n, dtype):
    """The upstream gradient broadcast to elementwise form (mean divides by n)."""
    g = grad_output.astype(dtype)
    if reduction == MEAN:
        g = g / n
    return g


# ---------------------------------------------------------------- nll

def _nll_parts(self, target, weight, ignore_index):
    """(picked log-prob, per-element weight) with the class axis removed."""
    cdim = 1 if self.ndim >= 2 else 0
    c = self.shape[cdim]
    t = target.astype(jnp.int64)
    ignored = t == ignore_index
    bad = ~ignored & ((t < 0) | (t >= c))
    safe = jnp.clip(jnp.where(ignored, 0, t), 0, c - 1)
    picked = jnp.take_along_axis(self, jnp.expand_dims(safe, cdim), axis=cdim)
    picked = jnp.squeeze(picked, cdim)
    w = jnp.ones(safe.shape, self.dtype) if weight is None else weight.astype(self.dtype)[safe]
    w = jnp.where(ignored, jnp.zeros((), self.dtype), w)
    w = jnp.where(bad, jnp.full((), jnp.nan, self.dtype), w)
    return picked, w, safe, cdim


def _nll_forward(self, target, weight, reduction, ignore_index):
    picked, w, _, _ = _nll_parts(self, target, weight, ignore_index)
    loss = -picked * w
    acc = _acc(self.dtype)
    if reduction == NONE:
        return loss, jnp.zeros((), self.dtype)
    total = jnp.sum(w.astype(acc))
    s = jnp.sum(loss.astype(acc))
    if reduction == MEAN:
        s = s / total
    return s.astype(self.dtype), total.astype(self.dtype)


def _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    _, w, safe, cdim = _nll_parts(self, target, weight, ignore_index)
    g = grad_output.astype(self.dtype)
    if reduction == MEAN:
        g = g / total_weight.astype(self.dtype)
    # ignored targets contribute exactly 0, as CPU's kernel skips them (with every target
    # ignored the mean's total weight is 0, and -0 * (g / 0) would be nan)
    ignored = target.astype(jnp.int64) == ignore_index
    contrib = jnp.where(ignored, jnp.zeros((), self.dtype), -w * g)
    onehot = jnp.arange(self.shape[cdim]).reshape(
        (-1,) + (1,) * (self.ndim - cdim - 1)) == jnp.expand_dims(safe, cdim)
    return jnp.where(onehot, jnp.expand_dims(contrib, cdim), jnp.zeros((), self.dtype))


def _targets_ok(self, target, weight, reduction, ignore_index, *args):
    """Every target a class index or ignore_index (the registry ``check``)."""
    c = self.shape[1 if self.ndim >= 2 else 0]
    t = target.astype(jnp.int64)
    return jnp.all((t == ignore_index) | ((t >= 0) & (t < c)))


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
          check=(_targets_ok, IndexError, "Target is out of bounds."))
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(self, target, weight, reduction, ignore_index)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


# ---------------------------------------------------------------- regression losses

def _pair(self, target):
    dt = result_type(self, target)
    a, b = cast(self, dt), cast(target, dt)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape), dt


def _sum_to(x, shape):
    if x.shape == tuple(shape):
        return x
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@register(aten.mse_loss.default)
def mse_loss(self, target, reduction=MEAN):
    a, b, _ = _pair(self, target)
    return _reduce(jnp.square(a - b), reduction)


@register(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    a, b, dt = _pair(self, target)
    g = _grad_scale(grad_output, reduction, a.size, a.dtype)
    return _sum_to(2 * (a - b) * g, self.shape).astype(self.dtype)


@register(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=MEAN, beta=1.0):
    a, b, _ = _pair(self, target)
    z = jnp.abs(a - b)
    if beta == 0:
        loss = z
    else:
        loss = jnp.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)
    return _reduce(loss, reduction)


@register(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    a, b, _ = _pair(self, target)
    g = _grad_scale(grad_output, reduction, a.size, a.dtype)
    x = a - b
    if beta == 0:
        d = jnp.sign(x)
    else:
        d = jnp.where(x <= -beta, -1.0, jnp.where(x >= beta, 1.0, x / beta)).astype(a.dtype)
    return _sum_to(d * g, self.shape).astype(self.dtype)


@register(aten.huber_loss.default)
def huber_loss(self, target, reduction=MEAN, delta=1.0):
    a, b, _ = _pair(self, target)
    z = jnp.abs(a - b)
    loss = jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta))
    return _reduce(loss, reduction)


@register(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    a, b, _ = _pair(self, target)
    g = _grad_scale(grad_output, reduction, a.size, a.dtype)
    x = a - b
    d = jnp.where(x < -delta, -delta, jnp.where(x > delta, delta, x)).astype(a.dtype)
    return _sum_to(d * g, self.shape).astype(self.dtype)


# ---------------------------------------------------------------- classification losses

def _probabilities_ok(self, target, *args, **kwargs):
    return jnp.all((self >= 0) & (self <= 1)) & jnp.all((target >= 0) & (target <= 1))


@register(aten.binary_cross_entropy.default,
          check=(_probabilities_ok, RuntimeError,
                 "all elements of input and target should be between 0 and 1"))
def binary_cross_entropy(self, target, weight=None, reduction=MEAN):
    x, y = self, target.astype(self.dtype)
    log_x = jnp.maximum(jnp.log(x), -100.0)
    log_1mx = jnp.maximum(jnp.log1p(-x), -100.0)
    loss = -(y * log_x + (1 - y) * log_1mx)
    if weight is not None:
        loss = loss * weight.astype(self.dtype)
    return _reduce(loss.astype(self.dtype), reduction)


@register(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=MEAN):
    x, y = self, target.astype(self.dtype)
    g = _grad_scale(grad_output, reduction, x.size, x.dtype)
    d = (x - y) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        d = d * weight.astype(x.dtype)
    return (d * g).astype(self.dtype)


@register(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=MEAN):
    x, y = self, target.astype(self.dtype)
    sp = jnp.logaddexp(0.0, -x).astype(x.dtype)  # log(1 + exp(-x)), stable
    if pos_weight is not None:
        lw = (pos_weight.astype(x.dtype) - 1) * y + 1
        loss = (1 - y) * x + lw * sp
    else:
        loss = (1 - y) * x + sp
    if weight is not None:
        loss = loss * weight.astype(x.dtype)
    return _reduce(loss, reduction)


@register(aten.soft_margin_loss.default)
def soft_margin_loss(self, target, reduction=MEAN):
    x, y = self, target.astype(self.dtype)
    return _reduce(jnp.logaddexp(0.0, -y * x).astype(x.dtype), reduction)


@register(aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward(grad_output, self, target, reduction):
    x, y = self, target.astype(self.dtype)
    g = _grad_scale(grad_output, reduction, x.size, x.dtype)
    z = jnp.exp(-y * x)
    return (-y * z / (1 + z) * g).astype(self.dtype)


@register(aten.multi_margin_loss.default)
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=MEAN):
    x = self if self.ndim == 2 else self.reshape(1, -1)
    c = x.shape[1]
    t = jnp.clip(target.reshape(-1).astype(jnp.int64), 0, c - 1)
    xt = jnp.take_along_axis(x, t[:, None], 1)
    z = jnp.maximum(margin - xt + x, 0)
    if p == 2:
        z = z * z
    if weight is not None:
        z = z * weight.astype(x.dtype)[t][:, None]
    z = jnp.where(jnp.arange(c)[None, :] == t[:, None], 0, z)
    loss = (jnp.sum(z, 1) / c).astype(self.dtype)
    if self.ndim < 2:
        loss = loss.reshape(target.shape)
    return _reduce(loss, reduction)


@register(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=MEAN):
    f = lambda x: multi_margin_loss(x, target, p, margin, weight, reduction)  # noqa: E731
    _, vjp = jax.vjp(f, self)
    return vjp(grad_output.astype(self.dtype).reshape(f(self).shape))[0]


def _multilabel_margin(self, target, reduction):
    x = self if self.ndim == 2 else self.reshape(1, -1)
    t = target.reshape(x.shape).astype(jnp.int64)
    c = x.shape[1]
    valid = jnp.cumprod(t != -1, axis=1).astype(bool)  # targets end at the first -1
    safe = jnp.clip(t, 0, c - 1)
    onehot = (safe[:, :, None] == jnp.arange(c)[None, None, :]) & valid[:, :, None]
    is_target = jnp.any(onehot, axis=1)
    xt = jnp.take_along_axis(x, safe, axis=1)  # (N, K) scores of the targets
    z = jnp.maximum(1 - xt[:, :, None] + x[:, None, :], 0)  # (N, K, C)
    z = jnp.where(valid[:, :, None] & ~is_target[:, None, :], z, 0)
    loss = (jnp.sum(z, axis=(1, 2)) / c).astype(self.dtype)
    if self.ndim < 2:
        loss = loss.reshape(())
    return _reduce(loss, reduction), is_target.astype(self.dtype).reshape(self.shape)


@register(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(self, target, reduction):
    return _multilabel_margin(self, target, reduction)


@register(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    f = lambda x: _multilabel_margin(x, target, reduction)[0]  # noqa: E731
    out, vjp = jax.vjp(f, self)
    return vjp(grad_output.astype(self.dtype).reshape(out.shape))[0]
