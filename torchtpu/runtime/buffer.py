"""How a "tpu" tensor carries its data.

A tpu tensor is a plain torch.Tensor whose storage has the right byte size and a fake,
unique, never-dereferenced data pointer. The data is one immutable jax.Array held by a
``Buffer`` attached to the storage's Python object (PyTorch preserves that object for the
storage's lifetime), so every view, ``detach``, ``.data`` and saved tensor shares it.

The array's shape is whatever produced it (usually the shape of the tensor that was first
created on the storage); its size always equals the storage's element count.
"""
from __future__ import annotations

import jax
import torch

from . import dtypes
from .inflight import note as _inflight_note

_ATTR = "_tpu_buffer"
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset._handle.redispatch_boxed
_create_empty = torch._C._acc.create_empty_tensor
_make_storage = torch._C._construct_storage_from_data_pointer

# Fake device addresses: unique and non-overlapping per storage, like a real allocator's,
# so code that compares data_ptr() (overlap checks, dedup in torch.save) behaves.
_ALIGN = 512


class Buffer:
    """The mutable holder of one storage's immutable jax.Array."""

    __slots__ = ("array", "__weakref__")

    def __init__(self, array):
        self.array = array

    def __repr__(self):
        return f"Buffer({self.array.shape}, {self.array.dtype})"


_next_free = [1 << 44]


def _alloc_address(nbytes: int) -> int:
    addr = _next_free[0]
    _next_free[0] = addr + (nbytes // _ALIGN + 1) * _ALIGN
    return addr


def _contiguous_strides(shape):
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return strides[::-1]


_device_objects: dict = {}
_TPU0 = torch.device("privateuseone", 0)


def _torch_device(index: int) -> torch.device:
    d = _device_objects.get(index)
    if d is None:
        d = _device_objects[index] = torch.device("tpu", index)
    return d


_wrap_meta: dict = {}


def _meta(shape, jdtype):
    m = _wrap_meta.get((shape, jdtype))
    if m is None:
        dt = dtypes.to_torch(jdtype)
        n = 1
        for d in shape:
            n *= d
        m = _wrap_meta[(shape, jdtype)] = (list(shape), dt, _contiguous_strides(shape), n * dt.itemsize)
    return m


# Set by torchtpu.device.multidevice when the platform has several devices: builds the tensor
# for an array on device N > 0 (create_empty_tensor can only make tpu:0), None for device 0.
wrap_multi = None


def wrap(array, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tpu tensor (contiguous, offset 0) whose storage holds ``array``."""
    _inflight_note(array)  # synchronize waits for it even once the tensor is freed
    return wrap_noted(array, dtype)


def wrap_noted(array, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``wrap`` for an array ``inflight.note`` has seen (a Program's output)."""
    shape, dt, strides, nbytes = _meta(array.shape, array.dtype)
    if dtype is not None and dtype != dt:
        nbytes = nbytes // dt.itemsize * dtype.itemsize
        dt = dtype
    if wrap_multi is not None:
        t = wrap_multi(array, shape, dt, strides, nbytes)
        if t is not None:
            return t
    t = _create_empty(shape, dt)
    addr = _next_free[0]  # _alloc_address, inlined
    _next_free[0] = addr + (nbytes // _ALIGN + 1) * _ALIGN
    st = _make_storage(addr, _TPU0, nbytes)
    _set_storage(_CPU_KEYS, t, st, 0, shape, strides)
    st._tpu_buffer = Buffer(array)
    return t


_pending_meta: dict = {}


def wrap_pending(aval, buf: Buffer) -> torch.Tensor:
    """A new tpu tensor of ``aval``'s shape and dtype whose storage holds ``buf`` (a buffer
    whose value is not computed yet: the fused executor's, which passes canonical avals)."""
    m = _pending_meta.get(id(aval))
    if m is None or m[0] is not aval:
        m = _pending_meta[id(aval)] = (aval,) + _meta(tuple(aval.shape), aval.dtype)
    _, shape, dt, strides, nbytes = m
    t = _create_empty(shape, dt)
    addr = _next_free[0]  # _alloc_address, inlined
    _next_free[0] = addr + (nbytes // _ALIGN + 1) * _ALIGN
    st = _make_storage(addr, _TPU0, nbytes)
    _set_storage(_CPU_KEYS, t, st, 0, shape, strides)
    st._tpu_buffer = buf
    return t


def buffer_of(t: torch.Tensor) -> Buffer:
    """The Buffer behind a tpu tensor; RuntimeError if it has none."""
    try:
        return t.untyped_storage()._tpu_buffer
    except AttributeError:
        raise RuntimeError(
            f"tpu tensor of shape {tuple(t.shape)} has no device buffer (storage was not "
            "created by torchtpu, e.g. torch.from_dlpack of a tpu tensor's DLPack capsule: "
            "a tpu tensor's DLPack pointer is not device memory; exchange it through .cpu())"
        ) from None


def attach(t: torch.Tensor, array) -> None:
    """Give a tpu tensor created elsewhere (e.g. by ``set_``) a storage holding ``array``."""
    buffer_of_storage(t.untyped_storage(), array)


def buffer_of_storage(st, array=None) -> Buffer:
    b = getattr(st, _ATTR, None)
    if b is None:
        b = Buffer(array)
        setattr(st, _ATTR, b)
    elif array is not None:
        b.array = array
    return b


def new_storage(nbytes: int, device_index: int = 0):
    """A fresh tpu UntypedStorage of ``nbytes`` (a fake pointer, no buffer yet)."""
    return _make_storage(_alloc_address(nbytes), _torch_device(device_index), nbytes)
