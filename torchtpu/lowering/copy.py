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


@register(torch.ops.prims.convert_element_type.default)
def convert_element_type(a, dtype):
    """A dtype conversion (``x.to(torch.bfloat16)`` on the same device is this one op)."""
    from ._util import to_jax

    jd = to_jax(dtype)
    if jnp.issubdtype(a.dtype, jnp.complexfloating) and not jnp.issubdtype(jd, jnp.complexfloating):
        a = jnp.real(a)
    return a.astype(jd)
