"""Device memory statistics, CUDA-style names.

Two sources, whichever the platform has:

- PJRT's allocator statistics (``jax.Device.memory_stats()``: GPU and TPU). These are the real
  allocator's numbers: bytes in use, peak, reserved, limit.
- Otherwise (the CPU PJRT client keeps none) our own accounting of the live device buffers:
  the bytes of every ``jax.Array`` alive on the device (``jax.live_arrays()``), which is what the
  device really holds. The peak is the highest value seen by any statistics query,
  ``synchronize()``, or event record since the last ``reset_peak_memory_stats()``: a sampled
  peak, not an allocator-exact one (``memory_stats()["source"]`` says which source was used).

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

import jax

from . import devices as _devices

_peak: dict[int, int] = {}
_alloc_count: dict[int, int] = {}


def _pjrt_stats(index: int):
    try:
        s = _devices.jax_device(index).memory_stats()
    except Exception:
        return None
    return s or None


def live_bytes(index: int) -> tuple[int, int]:
    """(bytes, number of arrays) alive on tpu:index, counted from jax's live arrays."""
    dev = _devices.jax_device(index)
    total = 0
    n = 0
    for a in jax.live_arrays():
        try:
            if a.is_deleted():
                continue
            for shard in a.addressable_shards:
                if shard.device == dev:
                    total += shard.data.nbytes
                    n += 1
        except Exception:
            continue
    return total, n


def _index(device) -> int:
    if device is None:
        from ..device import tpu_module

        return tpu_module.current_device()
    if isinstance(device, int):
        return device
    from ..device import tpu_module

    return tpu_module._index(device)


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
