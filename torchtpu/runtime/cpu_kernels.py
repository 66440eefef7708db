"""torchtpu's CPU-only kernels: XLA FFI custom calls for XLA:CPU.

A kernel here is a C++ twin of a portable lowering (the reference, and the path on every other
platform) for an op XLA:CPU runs poorly as a program: ``cpu_paged_attention.cc`` is the paged
attention of ``lowering/paged_attention.py`` (``ragged_paged_attention_xla``), reading each
token's KV pages in place where the lowering gathers and reorders them.

A kernel is built on first need with the system C++ compiler against the FFI headers jaxlib
ships (``native_build``: cached by source hash, file lock, atomic publish) and registered with
``jax.ffi.register_ffi_target(..., platform="cpu")``. ``available(name)`` answers whether it can
be used in this process (building and registering it once); never raises: without a compiler,
or with ``TORCHTPU_CPU_KERNELS=0`` (all kernels) or the kernel's own switch set to ``0``
(``TORCHTPU_CPU_ATTENTION_KERNEL`` for the paged attention), the lowering takes its portable
path. ``TORCHTPU_CPU_ATTENTION_THREADS`` caps the threads one paged-attention call uses (default:
XLA:CPU's intra-op pool, the caller included; ``1``: the calling thread alone; the output is the
same bits either way; ``set_attention_threads`` changes it in a running process). ``TARGETS`` maps custom-call target names to kernels, so that ``custom_calls.ready`` can
register a kernel before an executable that calls it is read back from the compile cache.
"""
from __future__ import annotations

import ctypes
import os
import threading
import warnings

from . import native_build as _nb

_HERE = os.path.dirname(os.path.abspath(__file__))

# kernel name -> (source, exported handler symbol, custom-call target, switch variable)
KERNELS = {
    "paged_attention": ("cpu_paged_attention.cc", "TorchtpuCpuPagedAttention",
                        "torchtpu_cpu_paged_attention", "TORCHTPU_CPU_ATTENTION_KERNEL"),
}
TARGETS = {target: name for name, (_, _, target, _) in KERNELS.items()}

_lock = threading.Lock()
_state: dict = {}  # kernel name -> None (registered) or the reason it is not used
_libs: list = []  # loaded libraries stay referenced for the life of the process
_handles: dict = {}  # kernel name -> its loaded library


def enabled(name: str) -> bool:
    """The switches allow the kernel (``TORCHTPU_CPU_KERNELS`` and the kernel's own)."""
    if os.environ.get("TORCHTPU_CPU_KERNELS", "1") == "0":
        return False
    return os.environ.get(KERNELS[name][3], "1") != "0"


def switches() -> str:
    """The switches' values, for keys of programs whose lowering reads them."""
    names = ["TORCHTPU_CPU_KERNELS"] + [k[3] for k in KERNELS.values()]
    return ",".join(f"{n}={os.environ.get(n, '')}" for n in names)


def target(name: str) -> str:
    return KERNELS[name][2]


def _make_ready(name: str) -> None:
    import jax

    source, symbol, tgt, _ = KERNELS[name]
    src = os.path.join(_HERE, source)
    path = _nb.library_path(src, ffi=True)
    _nb.build_locked(path, src, f"its CPU {name} kernel", "or set "
                     f"{KERNELS[name][3]}=0 to use the portable lowering", ffi=True)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(tgt, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    _libs.append(lib)
    if name == "paged_attention":
        lib.torchtpu_cpu_attention_threads.argtypes = [ctypes.c_int64]
        lib.torchtpu_cpu_attention_threads.restype = ctypes.c_int64
        lib.torchtpu_cpu_attention_split_calls.restype = ctypes.c_int64
        lib.torchtpu_cpu_attention_pool_pieces.restype = ctypes.c_int64
        threads = os.environ.get("TORCHTPU_CPU_ATTENTION_THREADS", "").strip()
        if threads:
            try:
                lib.torchtpu_cpu_attention_threads(max(0, int(threads)))
            except ValueError:
                warnings.warn(f"TORCHTPU_CPU_ATTENTION_THREADS={threads!r} is not an integer: "
                              "ignored (XLA's intra-op pool is used)", stacklevel=2)
    _handles[name] = lib


def prepare(name: str) -> None:
    """Build (once) and register the kernel; raises why it cannot be."""
    reason = _ready(name)
    if reason is not None:
        raise RuntimeError(reason)


def _ready(name: str) -> str | None:
    if name in _state:
        return _state[name]
    with _lock:
        if name not in _state:
            try:
                _make_ready(name)
                _state[name] = None
            except Exception as e:  # noqa: BLE001 - no compiler, a failed build: not used
                _state[name] = f"CPU kernel {name} unavailable: {type(e).__name__}: {e}"
    return _state[name]


def available(name: str) -> bool:
    """The kernel is switched on and registered in this process (built on first need)."""
    return enabled(name) and _ready(name) is None


def set_attention_threads(n: int) -> int:
    """Cap the threads of a paged-attention call in this process (0: XLA's intra-op pool, the
    default; 1: the calling thread alone); returns the previous cap. Builds the kernel if needed."""
    prepare("paged_attention")
    return int(_handles["paged_attention"].torchtpu_cpu_attention_threads(int(n)))


def attention_split_calls() -> tuple[int, int]:
    """How many paged-attention calls in this process split their work over several threads,
    and how many pieces of work XLA's pool threads ran for them (the rest: the calling thread)."""
    prepare("paged_attention")
    lib = _handles["paged_attention"]
    return (int(lib.torchtpu_cpu_attention_split_calls()),
            int(lib.torchtpu_cpu_attention_pool_pieces()))
