"""torchtpu's two pieces of C++, each a small library built on first need.

- ``pinned_hooks.cpp``: PrivateUse1 hooks with a pinned host allocator. PyTorch's C++ sometimes
  asks the accelerator's hooks for one (DDP's Reducer does, under
  ``find_unused_parameters=True`` or ``static_graph=True``); hooks written in Python cannot.
- ``set_data.cpp``: ``tensor.data = other`` between CPU and "tpu" (``device/set_data.py``).

Each is compiled on first need (not at import) and cached on disk by
``runtime/native_build.py`` (under ``$TORCHTPU_CACHE_DIR/native`` if that is set, else under
torch's extension folder); a later process only loads it.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

from ..runtime import native_build as _nb

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "pinned_hooks.cpp")
_lock = threading.Lock()
_state: dict = {"installed": False, "lib": None, "built": False, "seconds": None}

# The advice every failure message ends with.
_AVOID = ("or avoid the need: DistributedDataParallel(..., find_unused_parameters=False) "
          "without static_graph (transformers' Trainer: ddp_find_unused_parameters=False)")


def cache_dir() -> str:
    return _nb.cache_dir()


_PINNED_WHAT = ("its pinned-memory hooks, which PyTorch requires for DistributedDataParallel "
                "with find_unused_parameters=True or static_graph=True on device 'tpu'")


def _compiler(what: str = _PINNED_WHAT, avoid: str = _AVOID) -> list[str]:
    return _nb.compiler(what, avoid)


def library_path(source: str = _SOURCE) -> str:
    """Where the compiled library for this torch and this source lives (built or not)."""
    return _nb.library_path(source)


def _build(path: str, source: str = _SOURCE, what: str = _PINNED_WHAT,
           avoid: str = _AVOID) -> None:
    _nb.build(path, source, what, avoid)


def _build_locked(path: str, *build_args) -> bool:
    """Build ``path`` unless it exists; one process builds, others wait. True if built here."""
    return _nb.build_locked(path, *(build_args or (_SOURCE, _PINNED_WHAT, _AVOID)))


def install_pinned_hooks() -> None:
    """Make the PrivateUse1 ("tpu") hooks provide a pinned host allocator, building the
    library on first need. Idempotent and thread-safe; raises RuntimeError when it cannot."""
    if _state["installed"]:
        return
    with _lock:
        if _state["installed"]:
            return
        if not sys.platform.startswith("linux"):
            raise RuntimeError(
                "torchtpu's pinned-memory hooks (needed by PyTorch for DistributedDataParallel "
                "with find_unused_parameters=True or static_graph=True on device 'tpu') are "
                f"built for Linux only, not {sys.platform}; " + _AVOID)
        # torch's Python hooks exist: the package root registered the device (device/
        # registration.py) before any of its modules could run; we re-type them in place
        path = library_path()
        t0 = time.perf_counter()
        built = _build_locked(path)
        lib = ctypes.CDLL(path)
        lib.torchtpu_install_pinned_hooks.restype = ctypes.c_int
        lib.torchtpu_registered_hooks_type.restype = ctypes.c_char_p
        rc = lib.torchtpu_install_pinned_hooks()
        if rc < 0:
            raise RuntimeError(
                "torchtpu cannot add a pinned-memory allocator to the PrivateUse1 hooks: "
                "they were registered by someone else (C++ type "
                f"{lib.torchtpu_registered_hooks_type().decode()}), not by torchtpu; " + _AVOID)
        _state.update(installed=True, lib=lib, built=built,
                      seconds=time.perf_counter() - t0)


def load(source: str, what: str, avoid: str) -> tuple[ctypes.CDLL, bool]:
    """The library built from ``source`` (a file beside this one), building it on first need;
    (library, built by this process). Raises RuntimeError naming ``what`` needs it."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"torchtpu builds {what} for Linux only, not {sys.platform}; "
                           + avoid)
    source = os.path.join(_HERE, source)
    path = library_path(source)
    built = _build_locked(path, source, what, avoid)
    return ctypes.CDLL(path), built


def status() -> dict:
    """{'installed', 'built' (compiled by this process), 'seconds' (build or load time)}."""
    return {k: _state[k] for k in ("installed", "built", "seconds")}
