"""Factory and fill ops."""
from __future__ import annotations

import jax.numpy as jnp
import torch

from ._util import cast, result_type, to_jax
from .registry import register

aten = torch.ops.aten


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
