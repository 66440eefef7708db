"""copy_: assign a value into a tensor (cast and broadcast), as one lowering.

Eager Strict mode keeps its own copy kernel (eager/copy.py: host transfers, zero-copy sharing
of immutable arrays); the graph executors (Fused, compile) record tpu->tpu copies with this.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch

from .registry import register

aten = torch.ops.aten


@register(aten.copy_.default)
def copy_(self, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


@register(aten.copy.default)
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)
