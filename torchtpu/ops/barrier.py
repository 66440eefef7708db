"""``torch.tpu.ops.optimization_barrier``: XLA's optimization barrier as a torch op.

``optimization_barrier(tensors) -> tensors``: returns its inputs unchanged (new tensors, same
values), and XLA may not move computation across it: nothing computed from the outputs is
scheduled before all inputs are computed, and no expression of the inputs is fused with or
rematerialized past it (``jax.lax.optimization_barrier``). Use it to pin the order of memory
-heavy work in a compiled graph (e.g. keep activation checkpointing's recomputation from being
hoisted into the forward). In eager it is an identity. The gradient passes through a barrier of
its own. A list in, a list out (as ``jax.lax.optimization_barrier`` takes a pytree; no TorchTPU
source was available to read, so the signature is JAX's, for a list of tensors).

Custom op ``torch.ops.tpu.optimization_barrier``: fake kernel, autograd, a lowering in the one
table, and a CPU kernel (clones).
"""
from __future__ import annotations

import torch
from jax import lax

from ..eager import kernels as _kernels
from ..lowering import registry as _registry

__all__ = ["optimization_barrier"]

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define("optimization_barrier(Tensor[] tensors) -> Tensor[]")
_ops = torch.ops.tpu


def optimization_barrier(tensors):
    """The tensors (a list or tuple, or one tensor), unchanged, behind an XLA optimization
    barrier; returns the same structure."""
    if isinstance(tensors, torch.Tensor):
        return _ops.optimization_barrier([tensors])[0]
    out = _ops.optimization_barrier(list(tensors))
    return tuple(out) if isinstance(tensors, tuple) else list(out)


@torch.library.register_fake("tpu::optimization_barrier")
def _fake(tensors):
    return [torch.empty_like(t) for t in tensors]


def _cpu(tensors):
    return [t.clone() for t in tensors]


_lib.impl("optimization_barrier", _cpu, "CPU")


def _low(tensors):
    return list(lax.optimization_barrier(list(tensors)))


_registry.register(_ops.optimization_barrier.default)(_low)
_kernels.bind_lowering(_registry.get(_ops.optimization_barrier.default))


def _setup(ctx, inputs, output):
    pass


def _backward(ctx, grads):
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    out = _ops.optimization_barrier([grads[i] for i in present]) if present else []
    for i, g in zip(present, out):
        grads[i] = g
    return (grads,)


torch.library.register_autograd("tpu::optimization_barrier", _backward, setup_context=_setup)
