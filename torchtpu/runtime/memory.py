"""Device memory statistics, CUDA-style names.

Two sources, whichever the platform has:

- PJRT's allocator statistics (``jax.Device.memory_stats()``: GPU and TPU). These are the real
  allocator's numbers: bytes in use, peak, reserved, limit.
- Otherwise (the CPU PJRT client keeps none) our own accounting of the live device buffers:
  the bytes of every ``jax.Array`` alive on the device (``jax.live_arrays()``), which is what the
  device really holds. The peak is the highest value seen by any statistics query,
  ``synchronize()``, or event record since the last ``reset_peak_memory_stats()``: a sampled
  peak, not an allocator-exact one (``memory_stats()["source"]`` says which source was used).
"""
from __future__ import annotations

import gc

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


def total_memory(index: int) -> int:
    """The device's memory size: PJRT's bytes_limit, else the host's physical memory (CPU)."""
    s = _pjrt_stats(index)
    if s is not None and "bytes_limit" in s:
        return int(s["bytes_limit"])
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


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
    if s is None:
        out["active.all.current"] = live_bytes(i)[1]
    else:
        out["pjrt"] = dict(s)
        if "num_allocs" in s:
            out["allocation.all.allocated"] = int(s["num_allocs"])
    return dict(sorted(out.items()))


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes."""
    i = _index(device)
    total = total_memory(i)
    return max(total - memory_reserved(i), 0), total


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
