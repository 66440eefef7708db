"""``torch.compile(backend="tpu")``: whole aten graphs compiled to one XLA program each.

Importing this package is cheap (no Dynamo import). It
- registers the Dynamo backend "tpu" (lazily: on the first torch.compile, or right away when
  Dynamo is already loaded);
- keeps PyTorch's ``dynamic=None`` default (automatic dynamic: a Python float that changes
  becomes a graph input after one recompile, not a constant per value);
- routes the default backend (Inductor, which cannot run on "tpu") to "tpu" when the graph's
  inputs live on "tpu"; CPU graphs keep PyTorch's behaviour unchanged;
- once the backend is registered, keeps the objects that existed when a Dynamo compile began
  out of the garbage collector's passes while it runs (``_gc_frozen_while_compiling``).
"""
from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import warnings

import torch

from . import compiler  # noqa: F401

__all__ = ["compiler", "register_backend"]

_registered = [False]


def register_backend() -> None:
    if _registered[0]:
        _gc_frozen_while_compiling()
        return
    from torch._dynamo.backends.registry import _BACKENDS, register_backend as _reg

    from .backend import tpu_backend

    if "tpu" not in _BACKENDS:
        _reg(compiler_fn=tpu_backend, name="tpu")
    _gc_frozen_while_compiling()
    _registered[0] = True


# ---- the garbage collector during Dynamo compiles ----
# Dynamo's tracing allocates hundreds of thousands of objects; those that survive push CPython
# into full (oldest-generation) collections, and each full collection walks every object the
# process holds: ~470k after importing torch, transformers and JAX, 0.3-0.5 s per pass on this
# host, two passes in a warm start's first static-cache generate (0.6-1.1 s of it). While a
# compile runs, the objects that existed before it are moved to the permanent generation
# (``gc.freeze``) and put back when it ends (``gc.unfreeze``, into the oldest generation): the
# passes during the compile walk only what the compile made. Nothing is lost: garbage among the
# older objects that a compile's collections skip is collected by a later pass, and nothing is
# collected that is still reachable. The freeze spans overlapping compiles (Dynamo runs its
# start/end callbacks when the first starts and the last ends), and a process that froze objects
# itself (``gc.get_freeze_count()`` > 0 at a compile's start) is left alone: our unfreeze would
# release its objects too. ``TORCHTPU_COMPILE_GC_FREEZE=0`` turns this off.

GC_FREEZE = os.environ.get("TORCHTPU_COMPILE_GC_FREEZE", "1") != "0"
_gc_state = {"frozen": False}
_gc_lock = threading.Lock()


def _gc_compile_start(args=None) -> None:
    with _gc_lock:
        if GC_FREEZE and not _gc_state["frozen"] and gc.isenabled() \
                and gc.get_freeze_count() == 0:
            gc.freeze()
            _gc_state["frozen"] = True
            from ..runtime.metrics import count

            count("compile_gc_freezes")


def _gc_compile_end(args=None) -> None:
    with _gc_lock:
        if _gc_state["frozen"]:
            _gc_state["frozen"] = False
            gc.unfreeze()


def _gc_frozen_while_compiling() -> None:
    """Install the callbacks (again: ``torch._dynamo.reset()`` clears Dynamo's callbacks); run
    at every ``torch.compile`` for "tpu" and every graph our backend takes."""
    from torch._dynamo.callback import callback_handler

    if _gc_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_gc_compile_start)
    if _gc_compile_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_gc_compile_end)


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
