"""``tensor.data = other`` between CPU and "tpu", as between CPU and CUDA.

PyTorch's setter (``VariableHooks::set_data``) refuses to replace a tensor's data with one whose
TensorImpl type it does not list as compatible, and its C++ lists no PrivateUse1 (the same root
cause as ``module_apply.py``): ``param.data = param.to("tpu")`` raised "incompatible tensor type".
FSDP2's ``fully_shard`` does exactly that for a module built on CPU
(``torch/distributed/fsdp/_fully_shard/_fsdp_init.py``), and so do many training scripts.

``Tensor.data`` becomes a Python property: its getter is PyTorch's own; its setter is
PyTorch's own except when the data moves between "cpu" and "tpu" (plain strided tensors), where
``set_data.cpp`` does what PyTorch's does after its type check: the tensor keeps its Python
object, autograd meta (``requires_grad``, ``.grad``, hooks) and version counter, and takes
storage, sizes, strides, dtype and device from ``other``; a cached gradient accumulator is
dropped. That library is built on first need with the system C++ compiler (cached on disk,
``device/native.py``); without one the assignment raises a RuntimeError saying so.
"""
from __future__ import annotations

import ctypes
import threading

import torch

_C_DATA = torch._C.TensorBase.__dict__["data"]
_lock = threading.Lock()
_state: dict = {"lib": None, "installed": False, "built": False}
_WHAT = ("its cross-device `tensor.data = ...` (between device 'cpu' and device 'tpu', as FSDP2's "
         "fully_shard does for a module built on CPU)")
_AVOID = ("or move modules with module.to('tpu') (no compiler needed), or build the model on "
          "device 'tpu' (e.g. under `with torch.device('tpu'):`)")


def _lib():
    lib = _state["lib"]
    if lib is None:
        with _lock:
            lib = _state["lib"]
            if lib is None:
                from . import native

                lib, _state["built"] = native.load("set_data.cpp", _WHAT, _AVOID)
                lib.torchtpu_set_data.restype = ctypes.c_int
                lib.torchtpu_set_data.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                _state["lib"] = lib
    return lib


def set_data(self: torch.Tensor, new: torch.Tensor) -> None:
    """``self.data = new`` where one is on "cpu" and the other on "tpu"."""
    if self.layout != torch.strided or new.layout != torch.strided:
        raise RuntimeError("Attempted to call `variable.set_data(tensor)`, but `variable` and "
                           "`tensor` have incompatible tensor type.")
    if self.requires_grad and not (new.is_floating_point() or new.is_complex()):
        raise RuntimeError("data set to a tensor that requires gradients must be floating "
                           "point or complex dtype")
    if _lib().torchtpu_set_data(self._cdata, new._cdata) != 0:
        raise RuntimeError(f"torchtpu: setting .data of a tensor on {self.device} to a tensor "
                           f"on {new.device} failed")


def _set(self, new):
    # one of them on "cpu", the other on "tpu" (is_cpu is a cheap C attribute; .device is not)
    if (isinstance(new, torch.Tensor) and self.is_cpu is not new.is_cpu
            and (new if self.is_cpu else self).device.type == "tpu"
            and not torch._C._has_torch_function_variadic(self, new)):
        return set_data(self, new)
    return _C_DATA.__set__(self, new)


def install() -> None:
    if not _state["installed"]:
        _state["installed"] = True
        torch.Tensor.data = property(_C_DATA.__get__, _set, doc=_C_DATA.__doc__)
