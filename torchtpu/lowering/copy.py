"""copy_: assign a value into a tensor (cast and broadcast), as one lowering.

Eager Strict mode keeps its own copy kernel (eager/copy.py: host transfers, zero-copy sharing
of immutable arrays); the graph executors (Fused, compile) record tpu->tpu copies with this.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch

from .registry import aten, register


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


@register(torch.ops.prims.device_put.default)
def device_put(a, device, non_blocking=False):
    """A device move inside a graph (``x.to("tpu")``, ``.cpu()``): the value is unchanged; the
    compiled runtime hands each graph output to the device its FakeTensor names."""
    return a


def register_inductor_prims() -> None:
    """Lowerings of ops in ``torch._inductor.inductor_prims``, which Dynamo itself emits (it
    rewrites ``addcmul_(..., value=v)`` to ``prims.fma``). Called by the compiler on first use:
    importing that module costs most of a second, which ``import torch`` must not pay."""
    from torch._inductor import inductor_prims  # noqa: F401  (defines torch.ops.prims.fma)

    @register(torch.ops.prims.fma.default)
    def fma(a, b, c):
        return a * b + c
