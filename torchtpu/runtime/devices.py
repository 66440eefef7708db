"""PJRT devices through JAX: which platform, which devices, x64 semantics."""
from __future__ import annotations

import functools
import os

import jax

# PyTorch semantics need int64/float64 (DESIGN fact 9).
jax.config.update("jax_enable_x64", True)


def _cpu_sync_dispatch() -> bool:
    """``TORCHTPU_CPU_SYNC_DISPATCH=1``: XLA:CPU runs each program inline on the calling
    thread (JAX's ``jax_cpu_enable_async_dispatch`` False) instead of handing it to its
    worker pool. Same executables, same results; it saves the hand-off (a futex wake of a
    worker, and waits on XLA's in-flight semaphore) that every program that is not "cheap"
    pays, at the price of no overlap between Python and the program. JAX reads that option
    only when its CPU client is created and, being a flag, not from the environment
    (``JAX_CPU_ENABLE_ASYNC_DISPATCH`` is ignored), so it is set here, at import, before
    any backend exists; ``cpu_dispatch()`` says what the client was made with."""
    return os.environ.get("TORCHTPU_CPU_SYNC_DISPATCH", "0") not in ("0", "")


if _cpu_sync_dispatch():
    from jax._src import xla_bridge as _xb

    if not _xb._backends:  # a backend made before torchtpu's import keeps its setting
        jax.config.update("jax_cpu_enable_async_dispatch", False)


def cpu_dispatch() -> str:
    """"sync" or "async": how JAX's CPU client runs programs (the option's value; the
    client reads it once, when it is created, and torchtpu sets it only before that)."""
    from jax._src import xla_bridge as _xb

    return "async" if _xb._CPU_ENABLE_ASYNC_DISPATCH.value else "sync"

_PLATFORM_ALIASES = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu"}


@functools.lru_cache(maxsize=None)
def platform() -> str:
    """The PJRT platform backing "tpu": $TORCHTPU_PLATFORM, else JAX's default backend."""
    want = os.environ.get("TORCHTPU_PLATFORM", "").strip().lower()
    if want:
        if want not in _PLATFORM_ALIASES:
            raise RuntimeError(f"TORCHTPU_PLATFORM={want!r}: expected one of tpu, gpu, cpu")
        return _PLATFORM_ALIASES[want]
    return jax.default_backend()


# The JAX backend is created lazily, at the first device use, not at ``import torch``: a
# multi-process job must join its cluster (``jax.distributed.initialize``) before that.
# ``before_backend``: callables run once, just before the backend is created (the distributed
# bootstrap registers one); ``after_backend``: callables run once with the device tuple.
before_backend: list = []
after_backend: list = []
_devs: list = []
# In a multi-process job each process owns one device; CUDA habits name it tpu:{local_rank}
# (``set_device(local_rank)``, ``device=f"tpu:{local_rank}"``). ``alias_count`` > 1 makes
# tpu:0 .. tpu:{alias_count - 1} all name that one device, and tensors there report tpu:0
# (``canonical_index``), which is then also the current device. Not tpu:{local_rank}: PyTorch's
# autograd engine sizes its per-device queues by the device guard's count, which for a Python
# backend is 1 (and C++ fills a missing index from that guard as 0); torchtpu's C++ guard
# answers both right where its extension builds (eager/fastpath.cpp NativeGuard), not
# everywhere. See torchtpu/distributed/bootstrap.py.
alias_count = [0]


def canonical_index(index: int) -> int:
    """The index tensors on tpu:index report: ``index``, or 0 when every index is an alias of
    this process's one device."""
    return 0 if alias_count[0] else index


def backend_created() -> bool:
    return bool(_devs)


# A process forked after its backend exists (a DataLoader worker, ``multiprocessing``'s default
# start method on Linux) inherits the PJRT client without the threads that run and complete
# its work: a program or transfer there waits forever. As CUDA does, the child may import and
# seed torch but any use of the device raises (``check_fork``); a fork before the backend
# exists is a clean process that makes its own.
_bad_fork = [False]
BAD_FORK_MESSAGE = ("Cannot re-initialize TPU in forked subprocess. To use TPU with "
                    "multiprocessing, you must use the 'spawn' start method")


def _after_fork_in_child() -> None:
    if _devs:
        _bad_fork[0] = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def in_bad_fork() -> bool:
    """This process was forked from one whose backend existed (``torch.tpu._is_in_bad_fork``)."""
    return _bad_fork[0]


def check_fork() -> None:
    """Raise CUDA's RuntimeError in a bad fork (see ``in_bad_fork``)."""
    if _bad_fork[0]:
        raise RuntimeError(BAD_FORK_MESSAGE)


def devices() -> tuple:
    """The local PJRT devices that tpu:0, tpu:1, ... name (creates the backend once)."""
    if _devs:
        if _bad_fork[0]:
            check_fork()
        return _devs[0]
    for hook in list(before_backend):
        hook()
    devs = tuple(jax.local_devices(backend=platform()))
    if not _devs:
        _devs.append(devs)
        for hook in list(after_backend):
            hook(devs)
    return _devs[0]


def device_count() -> int:
    """Physical local devices (executors key on this)."""
    return len(devices())


def visible_device_count() -> int:
    """What ``torch.tpu.device_count()`` reports: the local devices, or the aliases of this
    process's one device in a multi-process job."""
    return max(len(devices()), alias_count[0])


def jax_device(index: int | None):
    """The jax device for tpu:index, raising like CUDA for an invalid ordinal."""
    devs = devices()
    i = 0 if index is None else index
    if 0 <= i < len(devs):
        return devs[i]
    if 0 <= i < alias_count[0] and len(devs) == 1:
        return devs[0]
    n = visible_device_count()
    raise RuntimeError(
        f"Invalid device ordinal: tpu:{i} does not exist (device_count() is {n})")


def device_name(index: int | None = None) -> str:
    d = jax_device(index)
    kind = getattr(d, "device_kind", "") or d.platform
    return kind


# The device layer (device/tpu_module.py) owns the current device and parses device arguments
# ("tpu:1", torch.device, an int); it registers both here at import, so the runtime (memory
# statistics, synchronisation) and the executors ask through these without importing it (a
# lower layer never imports a higher one). Before registration: device 0, ints only.
_index_hooks: list = [lambda: 0, None]


def register_index_hooks(current, index_of) -> None:
    """``current() -> int`` (the current device); ``index_of(device) -> int`` (None: current)."""
    _index_hooks[0] = current
    _index_hooks[1] = index_of


def current_index() -> int:
    """The current tpu device's index (``torch.tpu.current_device()``)."""
    return _index_hooks[0]()


def index_of(device) -> int:
    """The index a device argument names (None: the current device)."""
    if device is None:
        return _index_hooks[0]()
    if isinstance(device, int):
        return device
    if _index_hooks[1] is None:
        raise RuntimeError(f"torchtpu: device {device!r} named before the device layer loaded")
    return _index_hooks[1](device)
