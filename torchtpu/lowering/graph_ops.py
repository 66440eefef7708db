"""Lowerings of ops that reach only graphs (torch.compile, torch.export), registered
``graph_only``: eager "tpu" tensors keep PyTorch's own kernels for them, because there they move
data between devices (``_to_copy``), may name another device (``full_like(..., device="cpu")``)
or check metadata on the host (``_assert_tensor_metadata``).

``torch.export``'s core ATen opset contains all of them; inside one XLA program a device move
is the identity (the runtime places outputs) and metadata asserts are checked while tracing,
where shapes and dtypes are static.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch

from ._util import to_jax
from .copy import convert_element_type
from .registry import aten, register


@register(aten._to_copy.default, graph_only=True)
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """``x.to(dtype/device)``: a dtype conversion (a copy: arrays are immutable)."""
    return self if dtype is None else convert_element_type(self, dtype)


def _like_dtype(self, dtype):
    return self.dtype if dtype is None else to_jax(dtype)


@register(aten.full_like.default, graph_only=True)
def full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):
    return jnp.full(self.shape, fill_value, _like_dtype(self, dtype))


@register(aten.zeros_like.default, aten.empty_like.default, graph_only=True)
def zeros_like(self, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    """(``empty_like``'s values are unspecified: zeros are as good as any.)"""
    return jnp.zeros(self.shape, _like_dtype(self, dtype))


@register(aten.ones_like.default, graph_only=True)
def ones_like(self, *, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):
    return jnp.ones(self.shape, _like_dtype(self, dtype))


@register(aten.empty.memory_format, graph_only=True)
def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), to_jax(dtype or torch.get_default_dtype()))


@register(aten._assert_tensor_metadata.default, graph_only=True)
def _assert_tensor_metadata(a, size=None, stride=None, dtype=None, *, device=None, layout=None):
    """Checked while tracing (shapes and dtypes are static there); symbolic sizes are skipped."""
    if dtype is not None and a.dtype != to_jax(dtype):
        raise RuntimeError(f"Tensor dtype mismatch: expected {dtype}, got {a.dtype}")
    if size is not None:
        if len(size) != a.ndim or any(
                isinstance(s, int) and isinstance(d, int) and s != d
                for s, d in zip(size, a.shape)):
            raise RuntimeError(f"Tensor shape mismatch: expected {list(size)}, got "
                               f"{list(a.shape)}")
    return ()


@register(aten._assert_scalar.default, graph_only=True)
def _assert_scalar(self, assert_msg):
    """A shape guard of an exported graph; a symbolic condition JAX cannot decide is left to
    the shape constraints of the exported function."""
    if self is False:
        raise RuntimeError(f"Runtime assertion failed: {assert_msg}")
    return ()


@register(aten.sym_constrain_range_for_size.default, graph_only=True)
def sym_constrain_range_for_size(size, *, min=None, max=None):
    return ()


@register(torch.ops.prims._make_token.default, graph_only=True)
def _make_token():
    """An effect token made inside the graph: the compile backend has aot_autograd unlift them
    (Inductor's convention, which AOTAutogradCache's runtime wrappers assume); effectful ops
    (``with_effects``) run in the graph's node order, so a token carries nothing."""
    return jnp.zeros((0,), jnp.bool_)


@register(torch.ops.prims._sink_tokens.default, graph_only=True)
def _sink_tokens(tokens):
    return ()
