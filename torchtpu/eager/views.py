"""Reading and writing tensors that are views of a storage's array.

A tensor's view of its storage array is described by a hashable *spec* that goes into the
compile-cache key; the storage offset of a strided view is a traced argument, so walking
``x[i]`` over i does not recompile.

spec None           the tensor is the array exactly
spec ("r", shape)   contiguous over the whole storage: a reshape
spec ("s", shape, strides)   anything else: a gather at offset + sum(i_k * stride_k)
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def spec_of(t, arr):
    """(spec, offset-or-None) of tensor ``t`` over storage array ``arr``."""
    shape = t.shape
    off = t.storage_offset()
    if off == 0 and t.is_contiguous():
        if arr.shape == shape:
            return None, None
        if t.numel() == arr.size:
            return ("r", tuple(shape)), None
    return ("s", tuple(shape), tuple(t.stride())), off


def _flat_index(shape, strides, offset):
    idx = jnp.asarray(offset, dtype=jnp.int64)
    for d, (n, st) in enumerate(zip(shape, strides)):
        if n == 1 or st == 0:
            continue
        iota = lax.broadcasted_iota(jnp.int64, shape, d)
        idx = idx + iota * st
    return jnp.broadcast_to(idx, shape)


def read(arr, spec, offset):
    """The value of a view (traced)."""
    if spec is None:
        return arr
    if spec[0] == "r":
        return arr.reshape(spec[1])
    _, shape, strides = spec
    flat = arr.reshape(-1)
    if 0 in shape:
        return jnp.zeros(shape, arr.dtype)
    return flat[_flat_index(shape, strides, offset)]


def write(arr, spec, offset, value):
    """The storage array after assigning ``value`` (already cast/broadcast) into the view."""
    value = value.astype(arr.dtype)
    if spec is None:
        return jnp.broadcast_to(value, arr.shape)
    if spec[0] == "r":
        return jnp.broadcast_to(value, spec[1]).reshape(arr.shape)
    _, shape, strides = spec
    if 0 in shape:
        return arr
    value = jnp.broadcast_to(value, shape)
    flat = arr.reshape(-1).at[_flat_index(shape, strides, offset).reshape(-1)].set(value.reshape(-1))
    return flat.reshape(arr.shape)
