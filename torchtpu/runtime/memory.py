"""Device memory statistics, CUDA-style names.

Two sources, whichever the platform has:

- PJRT's allocator statistics (``jax.Device.memory_stats()``: GPU and TPU). These are the real
  allocator's numbers: bytes in use, peak, reserved, limit.
- Otherwise (the CPU PJRT client keeps none) our own accounting of the live device buffers:
  the bytes of every ``jax.Array`` alive on the device (``jax.live_arrays()``), which is what the
  device really holds. The peak is the highest value seen by any statistics query,
  ``synchronize()``, or event record since the last ``reset_peak_memory_stats()``: a sampled
  peak, not an allocator-exact one (``memory_stats()["source"]`` says which source was used).

Out of memory (``oom_error``): XLA reports an allocation it cannot make as ``RESOURCE_EXHAUSTED``
(XLA:CPU: "Out of memory allocating N bytes"; TPU/GPU: "... trying to allocate 1.00G"). Every
path that runs device work (allocation, transfers, eager ops, Fused graphs, compiled graphs, the
host syncs that surface an asynchronous failure) turns it into ``torch.OutOfMemoryError`` with
CUDA's message shape ("TPU out of memory. Tried to allocate 2.00 GiB. TPU 0 has a total
capacity of ... of which ... is free. ..."), which is what ``except torch.OutOfMemoryError`` and
accelerate's ``find_executable_batch_size`` look for. XLA allocates a program's outputs when it
is dispatched on ready inputs (the error is raised by the op that asked) and its temporaries, or
everything when its inputs are still being computed, when it runs: such a failure surfaces at the
next host sync, and the values that program (and anything computed from them) would have made
are lost; tensors it does not write keep their values.

Size and free memory (``mem_get_info``, ``total_memory``): PJRT's ``bytes_limit`` and bytes in
use where the platform reports them. On the CPU platform the device's memory *is* the host's, so
they come from the host: total is physical memory, free is the kernel's ``MemAvailable`` (both
bounded by the process's cgroup limit). Arrays torchtpu holds are host memory already counted as
used there, so nothing is subtracted twice. Sizing a cache from ``free`` therefore takes memory
from everything else on the machine: take a fraction of it, as for any shared host memory.
"""
from __future__ import annotations

import gc
import os
import re

import jax
import torch

from . import devices as _devices
from . import inflight as _inflight
from .metrics import count

_peak: dict[int, int] = {}
_alloc_count: dict[int, int] = {}


def _pjrt_stats(index: int):
    try:
        s = _devices.jax_device(index).memory_stats()
    except Exception:
        return None
    return s or None


def _failed(a) -> bool:
    """Whether ``a`` is the output of a program that failed (it holds no memory)."""
    try:
        if not a.is_ready():
            return False
        a.block_until_ready()
    except Exception:  # noqa: BLE001 - the program's error, raised again on every read
        return True
    return False


def live_bytes(index: int, skip_failed: bool = False) -> tuple[int, int]:
    """(bytes, number of arrays) alive on tpu:index, counted from jax's live arrays;
    ``skip_failed``: leave out the outputs of programs that failed (an out-of-memory message
    must not count the allocation that failed as held)."""
    _inflight.clear()  # freed arrays it held until done are no longer counted once done
    dev = _devices.jax_device(index)
    total = 0
    n = 0
    for a in jax.live_arrays():
        try:
            if a.is_deleted() or _inflight.holds(a) or (skip_failed and _failed(a)):
                continue
            for shard in a.addressable_shards:
                if shard.device == dev:
                    total += shard.data.nbytes
                    n += 1
        except Exception:
            continue
    return total, n


def _index(device) -> int:
    return _devices.index_of(device)


def memory_allocated(device=None) -> int:
    i = _index(device)
    s = _pjrt_stats(i)
    if s is not None and "bytes_in_use" in s:
        cur = int(s["bytes_in_use"])
    else:
        cur = live_bytes(i)[0]
    if cur > _peak.get(i, 0):
        _peak[i] = cur
    return cur


def max_memory_allocated(device=None) -> int:
    i = _index(device)
    s = _pjrt_stats(i)
    cur = memory_allocated(i)
    if s is not None and "peak_bytes_in_use" in s and i not in _peak_reset_base:
        return int(s["peak_bytes_in_use"])
    return max(_peak.get(i, 0), cur)


# after reset_peak_memory_stats the PJRT peak (which cannot be reset) no longer applies
_peak_reset_base: set = set()


def memory_reserved(device=None) -> int:
    i = _index(device)
    s = _pjrt_stats(i)
    if s is not None:
        for k in ("bytes_reserved", "pool_bytes"):
            if k in s:
                return int(s[k])
        if "bytes_in_use" in s:
            return int(s["bytes_in_use"])
    return memory_allocated(i)


def max_memory_reserved(device=None) -> int:
    i = _index(device)
    s = _pjrt_stats(i)
    if s is not None and "peak_pool_bytes" in s and i not in _peak_reset_base:
        return int(s["peak_pool_bytes"])
    return max(memory_reserved(i), _peak.get(i, 0))


def reset_peak_memory_stats(device=None) -> None:
    i = _index(device)
    _peak_reset_base.add(i)
    _peak[i] = 0
    memory_allocated(i)


def _meminfo() -> dict:
    """/proc/meminfo in bytes (empty where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path: str):
    try:
        with open(path) as f:
            v = f.read().strip()
    except OSError:
        return None
    return int(v) if v.isdigit() else None


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage not counting reclaimable page cache) of this process's memory cgroup, or
    None where there is no limit (cgroup v2 ``memory.max``, else v1 ``memory.limit_in_bytes``)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            names = ("memory.max", "memory.current", "inactive_file")
            roots = [os.path.join("/sys/fs/cgroup", path.lstrip("/")), "/sys/fs/cgroup"]
        elif "memory" in controllers.split(","):  # v1
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            roots = [os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")),
                     "/sys/fs/cgroup/memory"]
        else:
            continue
        for root in roots:
            limit = _read_int(os.path.join(root, names[0]))
            usage = _read_int(os.path.join(root, names[1]))
            if limit is None or usage is None:
                continue
            if limit >= 1 << 60:  # "max" (v2 reads as None) or v1's page-rounded 2**63
                return None
            inactive = 0
            try:
                with open(os.path.join(root, "memory.stat")) as f:
                    for stat in f:
                        k, _, v = stat.partition(" ")
                        if k == names[2]:
                            inactive = int(v)
            except (OSError, ValueError):
                pass
            return limit, max(usage - inactive, 0)
    return None


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory this process may use: MemAvailable and MemTotal,
    bounded by the cgroup limit; sysconf where there is no /proc/meminfo."""
    info = _meminfo()
    total = info.get("MemTotal")
    avail = info.get("MemAvailable")
    if total is None:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = page * os.sysconf("SC_PHYS_PAGES")
            avail = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = total or 0
    if avail is None:
        avail = max(total - live_bytes_all(), 0)
    cg = _cgroup_limit()
    if cg is not None:
        limit, usage = cg
        total = min(total, limit) if total else limit
        avail = min(avail, max(limit - usage, 0))
    return min(avail, total), total


def live_bytes_all() -> int:
    """Bytes of every live array on the platform's devices (the fallback where the OS tells
    nothing about free memory)."""
    return sum(live_bytes(i)[0] for i in range(_devices.device_count()))


def total_memory(index: int) -> int:
    """The device's memory size: PJRT's ``bytes_limit``, else (CPU platform) the host's."""
    s = _pjrt_stats(index)
    if s is not None and "bytes_limit" in s:
        return int(s["bytes_limit"])
    return host_memory()[1]


def memory_stats(device=None) -> dict:
    """CUDA-style keys ("allocated_bytes.all.current", ...) plus the raw PJRT statistics."""
    i = _index(device)
    s = _pjrt_stats(i)
    cur = memory_allocated(i)
    out = {
        "allocated_bytes.all.current": cur,
        "allocated_bytes.all.peak": max_memory_allocated(i),
        "reserved_bytes.all.current": memory_reserved(i),
        "reserved_bytes.all.peak": max_memory_reserved(i),
        "source": "pjrt" if s is not None else "live_arrays",
    }
    out["bytes_free"], out["bytes_limit"] = mem_get_info(i)
    if s is None:
        out["active.all.current"] = live_bytes(i)[1]
    else:
        out["pjrt"] = dict(s)
        if "num_allocs" in s:
            out["allocation.all.allocated"] = int(s["num_allocs"])
    return dict(sorted(out.items()))


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device's memory, as ``torch.cuda.mem_get_info``.

    With PJRT statistics: ``bytes_limit`` less the bytes the allocator holds. On the CPU
    platform: the host's available and total memory (see the module docstring).
    """
    i = _index(device)
    s = _pjrt_stats(i)
    if s is not None and "bytes_limit" in s:
        total = int(s["bytes_limit"])
        held = max(int(s.get("bytes_in_use", 0)), int(s.get("bytes_reserved", 0)),
                   int(s.get("pool_bytes", 0)))
        return max(total - held, 0), total
    return host_memory()


def empty_cache() -> None:
    """Free the memory of unreachable tensors now (a garbage collection: their storages hold
    the arrays). PJRT returns a dead array's memory at once, so there is no other cache to
    empty; compiled programs are kept."""
    gc.collect()


def sample_peak(index: int | None = None) -> None:
    """Update the sampled peak (called on synchronize and event record)."""
    if index is None:
        for i in range(_devices.device_count()):
            if _pjrt_stats(i) is None:
                memory_allocated(i)
    elif _pjrt_stats(index) is None:
        memory_allocated(index)


# ---- out of memory ----

_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM ")
_BYTES = re.compile(r"allocat\w* (\d+) bytes")
_SIZED = re.compile(r"allocate (?:a buffer of )?([\d.]+)\s*([KMGT]?)i?B?\b")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def format_size(n: int) -> str:
    """PyTorch's CUDA allocator spelling of a size (``format_size`` in CUDACachingAllocator)."""
    if n < 1024:
        return f"{n} bytes"
    if n < 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n < 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is XLA (or the host, on the CPU platform) running out of memory."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False  # already translated
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, (RuntimeError, ValueError)):
        return False
    msg = str(exc)
    return any(m in msg for m in _OOM_MARKERS)


def requested_bytes(msg: str):
    """The size of the failed allocation an XLA message names, or None."""
    m = _BYTES.search(msg)
    if m is not None:
        return int(m.group(1))
    m = _SIZED.search(msg)
    if m is not None:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    return None


def oom_error(exc: BaseException, index: int | None = None, nbytes: int | None = None):
    """``torch.OutOfMemoryError`` for an out-of-memory failure of device work on tpu:index
    (CUDA's message, the device named), or None when ``exc`` is something else. ``nbytes``: the
    allocation's size where the caller knows it and the message does not say."""
    if not is_oom(exc):
        return None
    count("out_of_memory_errors")
    msg = str(exc)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    first = next((ln for ln in lines if any(m in ln for m in _OOM_MARKERS)),
                 lines[0] if lines else type(exc).__name__)
    want = requested_bytes(msg)
    if want is None:
        want = nbytes
    i = _devices.current_index() if index is None else index
    try:
        free, total = mem_get_info(i)
        s = _pjrt_stats(i)  # an allocator's count never includes the allocation that failed
        held = (int(s["bytes_in_use"]) if s is not None and "bytes_in_use" in s
                else live_bytes(i, skip_failed=True)[0])
    except Exception:  # noqa: BLE001 - the message is best effort, the error type is not
        free = total = held = None
    parts = ["TPU out of memory."]
    parts.append(f"Tried to allocate {format_size(want)}." if want is not None else
                 "Tried to allocate more memory than is free.")
    if total is not None:
        parts.append(f"TPU {i} has a total capacity of {format_size(total)} of which "
                     f"{format_size(free)} is free.")
        parts.append(f"Of the allocated memory {format_size(held)} is allocated by PyTorch "
                     f"(torchtpu's live arrays on tpu:{i}).")
    parts.append(f"({_devices.platform()} runtime: {first.strip()})")
    return torch.OutOfMemoryError(" ".join(parts))


def block_until_ready(x):
    """``jax.block_until_ready``, raising ``torch.OutOfMemoryError`` for an allocation that failed
    while the work ran (Debug mode's wait after each op)."""
    try:
        return jax.block_until_ready(x)
    except (RuntimeError, ValueError) as e:
        oom = oom_error(e)
        if oom is not None:
            raise oom from e
        raise
