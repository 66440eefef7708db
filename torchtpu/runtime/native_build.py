"""Building torchtpu's small C++ libraries on first need, cached on disk.

Each library is compiled with the system C++ compiler against the installed torch's headers
and cached under ``$TORCHTPU_CACHE_DIR/native`` if that is set (or ``shared=True``: always
under torch's extension folder, ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``),
keyed by the torch version and a hash of the source and flags; a later process only loads it.
``ffi=True`` builds an XLA FFI library instead (a custom-call handler, no torch or Python:
against the FFI headers jaxlib ships, keyed by the jaxlib version).
Builds by concurrent processes are serialized by a file lock and published by an atomic
rename. Users: ``device/native.py`` (ctypes libraries), ``eager/fastpath.py`` (a Python
extension module) and ``runtime/cpu_kernels.py`` (XLA:CPU custom calls).
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile

import torch


def cache_dir(shared: bool = False) -> str:
    root = None if shared else os.environ.get("TORCHTPU_CACHE_DIR")
    if root:
        return os.path.join(root, "native")
    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # as torch.utils.cpp_extension does
    if not root:
        from torch import _appdirs

        root = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
    return os.path.join(root, "torchtpu_native")


def compiler(what: str, avoid: str, shared: bool = False) -> list[str]:
    """The C++ compiler command; RuntimeError naming ``what`` needs it and ``avoid``."""
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
        f"torchtpu needs a C++ compiler to build {what} (once; cached in "
        f"{cache_dir(shared)}). No c++, g++ or clang++ was found on PATH and CXX is not set: "
        "install one (e.g. apt-get install g++), " + avoid)


def torch_dir() -> str:
    return os.path.dirname(os.path.abspath(torch.__file__))


def compile_flags(python: bool = False, ffi: bool = False) -> list[str]:
    """``python``: also the Python and torch-Python headers (a Python extension module);
    ``ffi``: an XLA FFI handler library (jaxlib's headers only)."""
    if ffi:
        import jax

        return ["-O3", "-shared", "-fPIC", "-std=c++17", "-w", "-I", jax.ffi.include_dir()]
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = ["-O2", "-shared", "-fPIC", "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             "-I", os.path.join(torch_dir(), "include")]
    if python:
        flags += ["-I", os.path.join(torch_dir(), "include", "torch", "csrc", "api", "include"),
                  "-I", sysconfig.get_paths()["include"]]
    return flags


def link_flags(python: bool = False, ffi: bool = False) -> list[str]:
    if ffi:
        return []  # the handler calls nothing outside libc / libstdc++
    # libc10/libtorch_cpu (/libtorch_python) are resolved by soname against the copies this
    # process has already loaded (torch is imported first), so the library carries no path to
    # this torch install
    flags = ["-L", os.path.join(torch_dir(), "lib"), "-lc10", "-ltorch_cpu"]
    if python:
        flags += ["-ltorch", "-ltorch_python"]
    return flags


def library_path(source: str, python: bool = False, shared: bool = False,
                 ffi: bool = False) -> str:
    """Where the compiled library for this torch (``ffi``: this jaxlib) and this source lives
    (built or not)."""
    with open(source, "rb") as f:
        src = f.read()
    flags = [f for f in compile_flags(python, ffi) if not f.startswith("/")]  # not install paths
    key = hashlib.sha256(src + "\0".join(flags).encode()).hexdigest()[:16]
    if ffi:
        import jaxlib

        lib, version = "jaxlib", jaxlib.__version__
    else:
        lib, version = "torch", torch.__version__
    version = re.sub(r"[^0-9A-Za-z.]+", "_", version)
    name = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir(shared), f"{name}-{lib}{version}-{key}.so")


def build(path: str, source: str, what: str, avoid: str, python: bool = False,
          ffi: bool = False) -> None:
    cmd = compiler(what, avoid)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        # sources before libraries: with --as-needed, libraries named first would be dropped
        full = cmd + compile_flags(python, ffi) + [source, "-o", tmp] + link_flags(python, ffi)
        r = subprocess.run(full, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(
                f"torchtpu could not build {what}. Command: {shlex.join(full)}\n"
                f"{r.stderr[-4000:]}\nCheck that the compiler supports "
                f"C++{17 if ffi else 20}, " + avoid)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of the cache
        os.replace(tmp, path)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_locked(path: str, *build_args, **build_kwargs) -> bool:
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
            build(path, *build_args, **build_kwargs)
            return True
        finally:
            if fcntl is not None:
                fcntl.flock(lockf, fcntl.LOCK_UN)
