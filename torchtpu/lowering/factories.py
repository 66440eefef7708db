"""Factory and fill ops."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ._util import cast, result_type, to_jax
from .registry import aten, register


@register(aten.fill_.Scalar)
def fill_scalar_(self, value):
    return jnp.full(self.shape, value, self.dtype)


@register(aten.fill_.Tensor)
def fill_tensor_(self, value):
    return jnp.broadcast_to(value.astype(self.dtype), self.shape)


@register(aten.zero_.default)
def zero_(self):
    return jnp.zeros(self.shape, self.dtype)


@register(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is None:
        dtype = result_type(fill_value) if not isinstance(fill_value, float) else torch.get_default_dtype()
    return jnp.full(tuple(size), fill_value, to_jax(dtype))


@register(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s, to_jax(dtype or torch.get_default_dtype()))


def _is_float_scalar(v):
    if isinstance(v, bool):
        return False
    if isinstance(v, (float, complex)):
        return True
    return hasattr(v, "dtype") and not jnp.issubdtype(v.dtype, jnp.integer) and v.dtype != jnp.bool_


@register(aten.zeros.default)
def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), to_jax(dtype or torch.get_default_dtype()))


@register(aten.ones.default)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), to_jax(dtype or torch.get_default_dtype()))


@register(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(*args, dtype=None, layout=None, device=None, pin_memory=None):
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    elif len(args) == 2:
        (start, end), step = args, 1
    else:
        start, end, step = args
    if dtype is None:
        dtype = (torch.get_default_dtype() if any(_is_float_scalar(v) for v in (start, end, step))
                 else torch.int64)
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if any(jax.export.is_symbolic_dim(v) for v in (start, end, step)):
        # a symbolic size (torch.export.Dim, exported shape-polymorphic): integer ranges
        if not (isinstance(step, int) and step > 0) or dtype.is_floating_point:
            raise NotImplementedError("arange over a symbolic size needs an integer step > 0")
        n = (end - start + step - 1) // step
        return (start + jnp.arange(n, dtype=jnp.int64) * step).astype(to_jax(dtype))
    if not all(math.isfinite(float(v)) for v in (start, end)):
        raise RuntimeError(f"unsupported range: {start} -> {end}")
    if (step > 0 and end < start) or (step < 0 and end > start):
        raise RuntimeError("upper bound and larger bound inconsistent with step sign")
    if dtype.is_floating_point or dtype.is_complex:
        n = math.ceil((float(end) - float(start)) / float(step))
    else:
        n = math.ceil((float(end) - float(start)) / float(step))
        if all(isinstance(v, int) for v in (start, end, step)):
            n = -((start - end) // step)  # exact integer ceil
    n = max(int(n), 0)
    jd = to_jax(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        acc = jnp.float64
        return (jnp.asarray(start, acc) + jnp.arange(n, dtype=acc) * jnp.asarray(step, acc)).astype(jd)
    if all(isinstance(v, int) for v in (start, end, step)):
        return (start + jnp.arange(n, dtype=jnp.int64) * step).astype(jd)
    # integral dtype from float bounds: PyTorch accumulates in int64 from truncated start/step
    return (int(start) + jnp.arange(n, dtype=jnp.int64) * int(step)).astype(jd)


def _linspace_steps(start, end, steps, dt):
    """PyTorch's linspace: start + i*step for the first half, end - (steps-1-i)*step after."""
    compute = dt if jnp.issubdtype(dt, jnp.inexact) and dt not in (jnp.float16, jnp.bfloat16) \
        else jnp.float64 if not jnp.issubdtype(dt, jnp.inexact) else jnp.float32
    s = jnp.asarray(start).astype(compute)
    e = jnp.asarray(end).astype(compute)
    if steps == 1:
        return s.reshape(1)
    step = (e - s) / (steps - 1)
    i = jnp.arange(steps, dtype=compute)
    half = steps // 2
    return jnp.where(jnp.arange(steps) < half, s + step * i, e - step * (steps - 1 - i))


def _check_steps(steps):
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")


@register(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
          aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    _check_steps(steps)
    dtype = dtype or torch.get_default_dtype()
    jd = to_jax(dtype)
    if steps == 0:
        return jnp.zeros((0,), jd)
    vals = _linspace_steps(start, end, steps, jd)
    if not jnp.issubdtype(jd, jnp.inexact):
        # integer linspace: PyTorch computes the step in float and truncates
        s = jnp.asarray(start).astype(jnp.float64)
        e = jnp.asarray(end).astype(jnp.float64)
        if steps == 1:
            return s.reshape(1).astype(jd)
        step = (e - s) / (steps - 1)
        i = jnp.arange(steps, dtype=jnp.float64)
        half = steps // 2
        vals = jnp.where(jnp.arange(steps) < half, s + step * i, e - step * (steps - 1 - i))
        return jnp.trunc(vals).astype(jd)
    return vals.astype(jd)


@register(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
          aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None,
             pin_memory=None):
    _check_steps(steps)
    dtype = dtype or torch.get_default_dtype()
    jd = to_jax(dtype)
    if steps == 0:
        return jnp.zeros((0,), jd)
    compute = jnp.float64 if not jnp.issubdtype(jd, jnp.inexact) else \
        (jnp.float32 if jd in (jnp.float16, jnp.bfloat16) else jd)
    s = jnp.asarray(start).astype(compute)
    e = jnp.asarray(end).astype(compute)
    if steps == 1:
        return jnp.power(jnp.asarray(base, compute), s).reshape(1).astype(jd)
    step = (e - s) / (steps - 1)
    i = jnp.arange(steps, dtype=compute)
    half = steps // 2
    expo = jnp.where(jnp.arange(steps) < half, s + step * i, e - step * (steps - 1 - i))
    return jnp.power(jnp.asarray(base, compute), expo).astype(jd)


@register(aten.eye.default, aten.eye.m)
def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None):
    if n < 0:
        raise RuntimeError(f"n must be greater or equal to 0, got {n}")
    if m is not None and m < 0:
        raise RuntimeError(f"m must be greater or equal to 0, got {m}")
    return jnp.eye(n, n if m is None else m, dtype=to_jax(dtype or torch.get_default_dtype()))


def _tri_indices(fn, row, col, offset, dtype):
    r, c = fn(row, offset, col)
    return jnp.asarray(np.stack([r, c]).astype(np.int64).reshape(2, -1), to_jax(dtype or torch.int64))


@register(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=torch.int64, layout=None, device=None,
                 pin_memory=None):
    return _tri_indices(np.tril_indices, row, col, offset, dtype)


@register(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=torch.int64, layout=None, device=None,
                 pin_memory=None):
    return _tri_indices(np.triu_indices, row, col, offset, dtype)


@register(aten._efficientzerotensor.default)
def efficientzerotensor(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    # a plain zero tensor: the ZeroTensor dispatch key is an optimisation, not a semantic
    return jnp.zeros(tuple(size), to_jax(dtype or torch.get_default_dtype()))
