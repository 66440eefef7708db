"""Allocation of new tpu tensors (empty / empty_strided)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch

from ..runtime import buffer as _buffer
from ..runtime import devices as _devices
from ..runtime import memory as _memory
from ..runtime import program_cache as _program_cache
from ..runtime.dtypes import to_jax
from .executor import _device_index


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, jdtype, device):
    return _program_cache.Program("eager", lambda: jnp.zeros(shape, jdtype),
                                  ("factories.zeros", shape, jdtype, device),
                                  out_shardings=jax.sharding.SingleDeviceSharding(device))


def _zeros(shape, dtype, device_index):
    try:
        return _zeros_fn(tuple(shape), to_jax(dtype), _devices.jax_device(device_index))()
    except (RuntimeError, ValueError) as e:
        n = dtype.itemsize
        for s in shape:
            n *= s
        oom = _memory.oom_error(e, device_index, n)
        if oom is not None:
            raise oom from e
        raise


_NO_ELEMENTS: dict = {}  # (shape, dtype, device index) -> a zero-element array, made once


def _no_elements(shape, dtype, device_index):
    """A zero-element array of ``shape``: there is nothing to compute or write, so one array
    per shape, dtype and device serves every such tensor. Several storages may share an
    immutable array (as a zero-copy ``.to`` or a cached device scalar do); this dict's
    reference keeps it from being donated, so an in-place op on one tensor replaces that
    tensor's array only. (``generate()``'s ``prepare_inputs_for_generation`` makes a
    ``(batch, length, 0)`` tensor every token: a program's call, ~50 us of host time.)"""
    key = (shape, dtype, device_index)
    arr = _NO_ELEMENTS.get(key)
    if arr is None:
        if len(_NO_ELEMENTS) >= 1024:
            _NO_ELEMENTS.clear()
        arr = _NO_ELEMENTS[key] = _zeros(shape, dtype, device_index)
    return arr


def empty_tensor(shape, dtype=None, device=None) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    idx = _device_index(device)
    _devices.jax_device(idx)  # validates the ordinal
    if 0 in shape:
        arr = _no_elements(tuple(shape), dtype, idx)
    else:
        arr = _zeros(shape, dtype, idx)
    return _buffer.wrap(arr, dtype)


def empty_strided(shape, stride, dtype=None, device=None) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    if list(stride) == _buffer._contiguous_strides(shape):
        return empty_tensor(shape, dtype, device)
    idx = _device_index(device)
    n = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    t = empty_tensor([n], dtype, device)
    return torch.ops.aten.as_strided.default(t, shape, stride, 0)
