"""Tensors on tpu:1, tpu:2, ...

``torch._C._acc.create_empty_tensor`` always makes a tensor on device index 0 (its C++
hard-codes it), ``set_`` refuses a storage of another device, and a TensorImpl's device cannot
be changed from Python. One Python-reachable C++ constructor does take a PrivateUse1 device
index: DLPack import. ``torch.from_dlpack`` maps DLPack's ``kDLExtDev`` device type to
PrivateUse1 with the capsule's ``device_id`` and wraps the data pointer with ``from_blob``
(no allocator involved). So for an array on device N > 0 we build a DLPack capsule in ctypes
holding a fake, unique, never-dereferenced address (like every tpu storage's), import it, and
attach the array to the storage like ``buffer.wrap`` does.

``install()`` hooks this into ``buffer.wrap`` only when the platform has more than one device.
"""
from __future__ import annotations

import ctypes

import torch

from ..runtime import buffer as _buffer
from ..runtime import devices as _devices

_kDLExtDev = 12
_DL_CODES = {
    torch.float32: (2, 32), torch.float64: (2, 64), torch.float16: (2, 16),
    torch.bfloat16: (4, 16), torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32),
    torch.int64: (0, 64), torch.uint8: (1, 8), torch.uint16: (1, 16), torch.uint32: (1, 32),
    torch.uint64: (1, 64), torch.bool: (6, 8), torch.complex64: (5, 64),
    torch.complex128: (5, 128),
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DELETER)]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# the DLManagedTensor structs PyTorch still points to, until it calls their deleter
_live: dict = {}


@_DELETER
def _deleter(ptr):
    _live.pop(ctypes.cast(ptr, ctypes.c_void_p).value, None)


def empty_on(shape, dtype: torch.dtype, index: int, nbytes: int | None = None) -> torch.Tensor:
    """A contiguous tpu:index tensor with a fresh storage (fake address, no buffer yet)."""
    code = _DL_CODES.get(dtype)
    if code is None:
        raise TypeError(f"Unsupported dtype {dtype} on device tpu:{index} (only tpu:0 holds it)")
    ndim = len(shape)
    strides = _buffer._contiguous_strides(list(shape))
    if nbytes is None:
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
    m = _DLManagedTensor()
    sh = (ctypes.c_int64 * max(ndim, 1))(*shape)
    st = (ctypes.c_int64 * max(ndim, 1))(*strides)
    m.dl_tensor.data = _buffer._alloc_address(nbytes)
    m.dl_tensor.device = _DLDevice(_kDLExtDev, index)
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype = _DLDataType(code[0], code[1], 1)
    m.dl_tensor.shape = sh
    m.dl_tensor.strides = st
    m.deleter = _deleter
    addr = ctypes.addressof(m)
    _live[addr] = (m, sh, st)
    cap = _PyCapsule_New(addr, b"dltensor", None)
    return torch._C._from_dlpack(cap)


_templates: dict = {}


def shell(index: int, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor on tpu:index to be given a storage (``buffer._set_storage``): ``.data`` of a
    cached empty tensor there (a new TensorImpl with its own version counter, ~1 us, where
    ``empty_on`` costs ~35 us). Dtypes DLPack cannot carry are reinterpreted from uint8."""
    t = _templates.get((index, dtype))
    if t is None:
        if dtype in _DL_CODES:
            t = empty_on((0,), dtype, index)
        else:
            t = empty_on((0,), torch.uint8, index).view(dtype)
        # never collected: at interpreter exit the DLPack deleter (a ctypes callback) may run
        # after ctypes is torn down, which crashes the process
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))
        _templates[(index, dtype)] = t
    return t.data


def wrap_on(array, shape, dtype, strides, nbytes):
    """``buffer.wrap`` for arrays not on device 0 (None for device 0: the usual path)."""
    idx = _index.get(_device_of(array), 0)
    if idx == 0:
        return None
    t = shell(idx, dtype)
    st = _buffer._make_storage(_buffer._alloc_address(nbytes), _buffer._torch_device(idx),
                               nbytes)
    _buffer._set_storage(_buffer._CPU_KEYS, t, st, 0, list(shape), list(strides))
    st._tpu_buffer = _buffer.Buffer(array)
    return t


def _device_of(array):
    try:
        return array.sharding._device
    except AttributeError:
        devs = array.devices()
        return next(iter(devs)) if len(devs) == 1 else None


_index: dict = {}


def install() -> None:
    """Hooked to run when the backend is created (runtime/devices.py creates it lazily)."""
    _devices.after_backend.append(_install)


def _install(devs) -> None:
    if len(devs) < 2 or not hasattr(_buffer, "wrap_multi"):
        return
    _index.update({d: i for i, d in enumerate(devs)})
    _buffer.wrap_multi = wrap_on
