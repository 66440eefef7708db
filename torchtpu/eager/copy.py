"""Moving values between tensors: host<->device transfers, device copies, out= writes.

``value_of(t)`` is the one way to read a tpu tensor's value as a jax array (views resolved).
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from ..runtime import buffer as _buffer
from ..runtime import devices as _devices
from ..runtime import launches as _launches
from ..runtime import memory as _memory
from ..runtime import program_cache as _program_cache
from ..runtime import sync_debug as _sync_debug
from ..runtime.dtypes import to_jax, to_torch
from ..runtime.dtypes import scalar_type_name as _tname
from ..runtime.metrics import COUNTERS, count
from . import checks as _checks
from . import views


@functools.lru_cache(maxsize=None)
def _reader(spec):
    return _program_cache.Program("eager", lambda arr, off: views.read(arr, spec, off),
                                  ("copy.read", spec))


@functools.lru_cache(maxsize=None)
def _writer(spec, shape, dtype, donate=False):
    """The program writing a value into a view of a storage array; ``donate``: the variant
    that reuses the old array's buffer (executor.py's donation)."""
    jd = to_jax(dtype)

    def write(arr, off, value):
        v = jnp.broadcast_to(value.astype(jd), shape)
        return views.write(arr, spec, off, v)

    if donate:
        return _program_cache.Program("eager", write, ("copy.write", spec, shape, dtype, "donate"),
                                      donate_argnums=(0,))
    return _program_cache.Program("eager", write, ("copy.write", spec, shape, dtype))


def _probe(holder):
    arr = holder.array
    return sys.getrefcount(arr)


class _Holder:
    __slots__ = ("array",)


def _sole_count() -> int:
    """The reference count ``assign`` reads for an array only its storage's Buffer holds."""
    h = _Holder()
    h.array = object()
    return _probe(h)


_SOLE = _sole_count()


def value_of(t: torch.Tensor):
    """The jax array holding tensor ``t``'s value (one dispatch for a strided view)."""
    arr = _buffer.buffer_of(t).array
    spec, off = views.spec_of(t, arr)
    if spec is None:
        return arr
    if spec[0] == "r":
        return arr.reshape(spec[1])
    try:
        return _reader(spec)(arr, off)
    except (RuntimeError, ValueError) as e:
        _raise_oom(e, t.device.index or 0)
        raise


from ..lowering import hops as _hops  # noqa: E402

_hops.register_tensor_value(value_of)


def _raise_oom(e, index, nbytes=None) -> None:
    """Raise ``torch.OutOfMemoryError`` (from ``e``) if ``e`` is XLA running out of memory."""
    oom = _memory.oom_error(e, index, nbytes)
    if oom is not None:
        raise oom from e


def assign(dst: torch.Tensor, value) -> None:
    """Write jax array ``value`` (cast, broadcast) into tpu tensor ``dst``, view-aware."""
    buf = _buffer.buffer_of(dst)
    arr = buf.array
    spec, off = views.spec_of(dst, arr)
    dt = to_jax(dst.dtype)
    if spec is None and value.shape == arr.shape and value.dtype == dt:
        buf.array = value  # immutable arrays: sharing is a copy
        return
    # donate the old array when only this storage holds it (see executor._donation)
    ex = _executor()
    if not ex.DONATE:
        reason = "disabled"
    elif sys.getrefcount(arr) > _SOLE or value is arr:
        reason = "shared"
    elif ex._multi_device() and len(arr.sharding.device_set) != 1:
        reason = "sharded"
    else:
        reason = None
    if reason is None:
        COUNTERS["eager_donated_writes"] += 1
    else:
        count("eager_copied_writes", op=reason)
    donate = reason is None
    try:
        buf.array = _writer(spec, tuple(dst.shape), dst.dtype, donate)(arr, off, value)
    except (RuntimeError, ValueError) as e:
        _raise_oom(e, dst.device.index or 0)
        raise


def _executor():
    return _EXECUTOR[0]


# eager/executor.py (which imports this module, so this one cannot import it), registered by
# eager/kernels.py when it binds the executors: bind_executor
_EXECUTOR = [None]


def bind_executor(executor) -> None:
    _EXECUTOR[0] = executor


def assign_out(out: torch.Tensor, value, op_name: str) -> None:
    """An ``out=`` write: resize ``out`` like PyTorch does, check the cast, then assign."""
    rdt = to_torch(value.dtype)
    if not torch.can_cast(rdt, out.dtype):
        raise RuntimeError(f"result type {_tname(rdt)} can't be cast to the desired output type "
                           f"{_tname(out.dtype)}")
    if tuple(out.shape) != tuple(value.shape):
        resize(out, list(value.shape))
    assign(out, value)


def resize(t: torch.Tensor, shape) -> None:
    """``resize_`` semantics: keep the storage prefix, grow it with zeros if needed."""
    n = 1
    for s in shape:
        n *= s
    need = t.storage_offset() + n
    st = t.untyped_storage()
    have = st.nbytes() // t.element_size()
    if need > have:
        # the storage grows in place, as PyTorch's resize_ does (UntypedStorage.resize_, the
        # device layer's: prefix kept, new fake data pointer swapped into the same storage), so
        # views taken before the resize_ keep sharing memory with the tensor; a new storage
        # left them reading and writing a stale copy
        st.resize_(need * t.element_size())
    _set_storage(t, st, t.storage_offset(), shape)


def _set_storage(t, st, offset, shape):
    strides = _buffer._contiguous_strides(shape)
    _buffer._set_storage(_buffer._CPU_KEYS, t, st, offset, list(shape), strides)


# ---- host <-> device ----

def to_numpy_dtype(dtype: torch.dtype):
    return np.dtype(to_jax(dtype))


def host_to_device(src: torch.Tensor, device_index: int = 0):
    """A jax array on tpu:index holding a CPU tensor's value (copied)."""
    src = src.detach().resolve_conj().resolve_neg()
    if src.dtype == torch.bfloat16:
        host = src.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    elif src.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        host = src.contiguous().view(torch.uint8).numpy().view(to_numpy_dtype(src.dtype))
    else:
        host = src.contiguous().numpy()
    count("bytes_host_to_device", host.nbytes)
    count("transfers_host_to_device")
    # A private copy: jax's CPU client aliases suitably aligned host memory on device_put (even
    # with may_alias=False, jax 0.10.2), so a later in-place change of ``src`` on CPU would
    # change the device value. (On the CPU platform that copy is the device allocation: a
    # host MemoryError is the device running out of memory.)
    try:
        return jax.device_put(np.array(host, copy=True), _devices.jax_device(device_index))
    except (MemoryError, RuntimeError, ValueError) as e:
        _raise_oom(e, device_index, host.nbytes)
        raise


def tensor_from_numpy(host: np.ndarray, device_index: int = 0) -> torch.Tensor:
    """A new tpu tensor holding a host array's value: ``torch.from_numpy(host).to(device)``
    in one transfer, with no empty tensor allocated and copied into first."""
    return _buffer.wrap(host_to_device(torch.from_numpy(host), device_index))


def device_to_host(value) -> torch.Tensor:
    """A CPU tensor holding a jax array's value (blocks: a host sync). Raises for a failed
    pending input check (eager/checks.py) first: the value may depend on the bad op. An
    allocation that failed while the value was computed raises ``torch.OutOfMemoryError``."""
    _devices.check_fork()
    _sync_debug.note("a device-to-host read")
    try:
        host = np.asarray(value)
    except (RuntimeError, ValueError) as e:
        _raise_oom(e, _index_of(value))
        if _launches.aborted is not None:  # an aborted collective (distributed/mpmd.py)
            raise _launches.Aborted(f"[tpu_dist] reading a value on the host failed after this "
                                    f"process's collectives were aborted: {_launches.aborted}"
                                    ) from e
        raise
    _checks.raise_pending()
    count("host_syncs")
    count("bytes_device_to_host", host.nbytes)
    dt = to_torch(host.dtype)
    if dt == torch.bfloat16:
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.from_numpy(host.view(np.uint8).copy()).view(dt)
    if not host.flags.writeable:
        host = host.copy()
    return torch.from_numpy(host)


def _index_of(value) -> int:
    try:
        return _devices.devices().index(next(iter(value.sharding.device_set)))
    except Exception:  # noqa: BLE001 - a deleted or foreign array: the message names tpu:0
        return 0


def _recording() -> bool:
    from . import modes

    return modes._state["mode"] is modes.EagerMode.DEFER_AND_FUSE


def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """aten::copy_ for every direction that involves a tpu tensor."""
    dst_tpu = dst.device.type == "tpu"
    src_tpu = src.device.type == "tpu"
    if dst_tpu and src_tpu:
        if _recording() and (src.device.index or 0) == (dst.device.index or 0):
            executor = _executor()  # a recorded copy keeps the fused graph uncut
            executor.run(executor.copy_lowering(), executor.DIRECT_INPLACE, (dst, src), {})
            return dst
        v = value_of(src)
        if (src.device.index or 0) != (dst.device.index or 0):
            v = jax.device_put(v, _devices.jax_device(dst.device.index or 0))
            count("transfers_device_to_device")
        assign(dst, v)
    elif dst_tpu:
        assign(dst, host_to_device(src, dst.device.index or 0))
    elif src_tpu:
        host = device_to_host(value_of(src))
        dst.copy_(host)
    else:
        raise RuntimeError("copy_: neither tensor is on tpu")
    return dst
