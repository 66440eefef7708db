"""``torch.compile(backend="tpu")``: whole aten graphs compiled to one XLA program each.

Importing this package is cheap (no Dynamo import). It
- registers the Dynamo backend "tpu" (lazily: on the first torch.compile, or right away when
  Dynamo is already loaded);
- keeps PyTorch's ``dynamic=None`` default (automatic dynamic: a Python float that changes
  becomes a graph input after one recompile, not a constant per value);
- routes the default backend (Inductor, which cannot run on "tpu") to "tpu" when the graph's
  inputs live on "tpu"; CPU graphs keep PyTorch's behaviour unchanged;
- once the backend is registered, keeps the objects that existed when a Dynamo compile began
  out of the garbage collector's passes while it runs (``gc_freeze.install``).
"""
from __future__ import annotations

import functools
import sys
import warnings

import torch

from . import compiler  # noqa: F401
from . import gc_freeze

__all__ = ["compiler", "register_backend"]

_registered = [False]


def register_backend() -> None:
    if _registered[0]:
        gc_freeze.install()
        return
    from torch._dynamo.backends.registry import _BACKENDS, register_backend as _reg

    from .backend import tpu_backend

    if "tpu" not in _BACKENDS:
        _reg(compiler_fn=tpu_backend, name="tpu")
    gc_freeze.install()
    _registered[0] = True


def _is_tpu_backend(backend) -> bool:
    if backend == "tpu":
        return True
    from .backend import tpu_backend

    return backend is tpu_backend or backend is compiler.backend


def _module_on_tpu(model) -> bool:
    if isinstance(model, torch.nn.Module):
        for t in model.parameters():
            return t.device.type == "tpu"
        for t in model.buffers():
            return t.device.type == "tpu"
    return False


_orig_compile = torch.compile


@functools.wraps(_orig_compile)
def _compile(model=None, *args, **kwargs):
    backend = kwargs.get("backend", "inductor")
    if isinstance(backend, str) and backend == "tpu" or not isinstance(backend, str) and \
            _is_tpu_backend(backend):
        register_backend()
    elif backend == "inductor" and "backend" not in kwargs and _module_on_tpu(model):
        register_backend()
        kwargs["backend"] = "tpu"
    return _orig_compile(model, *args, **kwargs)


def _install() -> None:
    if getattr(torch.compile, "_torchtpu", False):
        return
    _compile._torchtpu = True
    torch.compile = _compile
    # Inductor cannot run on "tpu": a default-backend graph whose inputs are on tpu goes to us.
    wrapper = torch._TorchCompileInductorWrapper
    orig_call = wrapper.__call__

    def __call__(self, model_, inputs_):
        if any(isinstance(x, torch.Tensor) and x.device.type == "tpu" for x in inputs_):
            register_backend()
            from .backend import tpu_backend

            return tpu_backend(model_, inputs_)
        return orig_call(self, model_, inputs_)

    wrapper.__call__ = __call__
    if "torch._dynamo" in sys.modules:
        try:
            register_backend()
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"torchtpu: could not register the 'tpu' compile backend: {e}")


_install()
