"""Elementwise arithmetic with PyTorch's type promotion."""
from __future__ import annotations

import jax.numpy as jnp
import torch

from ._util import cast, result_type
from .registry import register

aten = torch.ops.aten


@register(aten.add.Tensor, aten.add.Scalar)
def add(self, other, alpha=1):
    dt = result_type(self, other)
    if alpha != 1:
        other = cast(other, dt) * cast(alpha, dt) if not isinstance(other, (int, float, bool)) else other * alpha
    return cast(self, dt) + cast(other, dt)


@register(aten.sub.Tensor, aten.sub.Scalar)
def sub(self, other, alpha=1):
    dt = result_type(self, other)
    if alpha != 1:
        other = cast(other, dt) * cast(alpha, dt) if not isinstance(other, (int, float, bool)) else other * alpha
    return cast(self, dt) - cast(other, dt)


@register(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    dt = result_type(self, other)
    return cast(self, dt) * cast(other, dt)
