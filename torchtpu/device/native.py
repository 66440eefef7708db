"""torchtpu's two pieces of C++, each a small library built on first need.

- ``pinned_hooks.cpp``: PrivateUse1 hooks with a pinned host allocator. PyTorch's C++ sometimes
  asks the accelerator's hooks for one (DDP's Reducer does, under
  ``find_unused_parameters=True`` or ``static_graph=True``); hooks written in Python cannot.
- ``set_data.cpp``: ``tensor.data = other`` between CPU and "tpu" (``device/set_data.py``).

Each is compiled on first need (not at import), with the
system C++ compiler against the installed torch's headers, and cached on disk under
``$TORCHTPU_CACHE_DIR/native`` if that is set, else under torch's extension folder
(``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), keyed by the torch version and a
hash of the source and flags; a later process only loads it. Builds by concurrent processes are
serialized by a file lock and published by an atomic rename.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "pinned_hooks.cpp")
_lock = threading.Lock()
_state: dict = {"installed": False, "lib": None, "built": False, "seconds": None}

# The advice every failure message ends with.
_AVOID = ("or avoid the need: DistributedDataParallel(..., find_unused_parameters=False) "
          "without static_graph (transformers' Trainer: ddp_find_unused_parameters=False)")


def cache_dir() -> str:
    root = os.environ.get("TORCHTPU_CACHE_DIR")
    if root:
        return os.path.join(root, "native")
    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # as torch.utils.cpp_extension does
    if not root:
        from torch import _appdirs

        root = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
    return os.path.join(root, "torchtpu_native")


_PINNED_WHAT = ("its pinned-memory hooks, which PyTorch requires for DistributedDataParallel "
                "with find_unused_parameters=True or static_graph=True on device 'tpu'")


def _compiler(what: str = _PINNED_WHAT, avoid: str = _AVOID) -> list[str]:
    cxx = os.environ.get("CXX")
    if cxx:
        cmd = shlex.split(cxx)
        if not cmd or shutil.which(cmd[0]) is None:
            raise RuntimeError(
                f"torchtpu needs a C++ compiler to build {what}; CXX={cxx!r} was not found: "
                "fix CXX, " + avoid)
        return cmd
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return [path]
    raise RuntimeError(
        f"torchtpu needs a C++ compiler to build {what} (once; cached in {cache_dir()}). "
        "No c++, g++ or clang++ was found on PATH and CXX is not set: install one (e.g. "
        "apt-get install g++), " + avoid)


def _torch_dir() -> str:
    return os.path.dirname(os.path.abspath(torch.__file__))


def _compile_flags() -> list[str]:
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return ["-O2", "-shared", "-fPIC", "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", os.path.join(_torch_dir(), "include")]


def _link_flags() -> list[str]:
    # libc10/libtorch_cpu are resolved by soname against the copies this process has already
    # loaded (torch is imported first), so the library carries no path to this torch install
    return ["-L", os.path.join(_torch_dir(), "lib"), "-lc10", "-ltorch_cpu"]


def library_path(source: str = _SOURCE) -> str:
    """Where the compiled library for this torch and this source lives (built or not)."""
    with open(source, "rb") as f:
        src = f.read()
    flags = [f for f in _compile_flags() if not f.startswith("/")]  # not the install path
    key = hashlib.sha256(src + "\0".join(flags).encode()).hexdigest()[:16]
    version = re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)
    name = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir(), f"{name}-torch{version}-{key}.so")


def _build(path: str, source: str = _SOURCE, what: str = _PINNED_WHAT,
           avoid: str = _AVOID) -> None:
    cmd = _compiler(what, avoid)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        # sources before libraries: with --as-needed, libraries named first would be dropped
        full = cmd + _compile_flags() + [source, "-o", tmp] + _link_flags()
        r = subprocess.run(full, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(
                f"torchtpu could not build {what}. Command: {shlex.join(full)}\n"
                f"{r.stderr[-4000:]}\nCheck that the compiler supports C++20, " + avoid)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of the cache
        os.replace(tmp, path)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_locked(path: str, *build_args) -> bool:
    """Build ``path`` unless it exists; one process builds, others wait. True if built here."""
    if os.path.exists(path):
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock: concurrent builds are still safe thanks to os.replace
        fcntl = None
    with open(path + ".lock", "a") as lockf:
        if fcntl is not None:
            fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if os.path.exists(path):  # another process built it while we waited
                return False
            _build(path, *build_args)
            return True
        finally:
            if fcntl is not None:
                fcntl.flock(lockf, fcntl.LOCK_UN)


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
