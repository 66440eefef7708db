"""The device layer beyond registration: what PyTorch's Python hooks cannot provide.

PyTorch's PrivateUse1 Python hooks only forward ``is_available``/``is_built``/
``has_primary_context`` (torch/csrc/acc/Module.cpp), so generators, allocators, storages and
pinned memory for "tpu" do not exist in C++. We provide them in Python, each by wrapping the
one PyTorch entry point a user (or PyTorch itself) calls, and only when the device is "tpu":
CPU (and every other device) keeps PyTorch's own behaviour.

- ``torch.Generator(device="tpu")``: a Generator subclass carrying a seed+offset state of
  eager/rng.py; ``isinstance(g, torch.Generator)`` keeps working for every generator.
- ``torch.UntypedStorage(n, device="tpu")`` (reached by torch.load, deepcopy, storage
  ``clone``/``.tpu()``) and ``UntypedStorage.copy_`` between tpu and anything.
- torch.save/torch.load location tags "tpu:N" (``register_package``), ``map_location="tpu"``.
- ``torch.accelerator`` memory/sync functions when the accelerator is tpu.
- CPU ``pin_memory()``/``is_pinned()`` with tpu as the accelerator.
- autocast rules for "tpu" (CUDA's lists).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import torch

from ..eager import copy as _copy
from ..eager import executor as _executor
from ..eager import rng as _rng
from ..runtime import buffer as _buffer
from ..runtime import devices as _devices


def _tpu_index(device, default_current=True):
    """The tpu index named by ``device``, or None when it names another device type."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == "tpu":
        if device.index is None:
            tpu_module = _device_module[0]

            return tpu_module.current_device() if default_current else 0
        return device.index
    return None


# ---------------------------------------------------------------- torch.Generator

_BaseGenerator = torch._C.Generator


class _GeneratorMeta(type(_BaseGenerator)):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _BaseGenerator)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _BaseGenerator)


class Generator(_BaseGenerator, metaclass=_GeneratorMeta):
    """``torch.Generator``: PyTorch's own for every device but "tpu"; for "tpu" a generator
    whose state is the (seed, offset) pair the device's random ops consume."""

    def __new__(cls, device="cpu"):
        dev = torch.device(device) if isinstance(device, (str, int)) else device
        if not isinstance(dev, torch.device) or dev.type != "tpu":
            return _BaseGenerator(device)
        idx = _tpu_index(dev)
        _devices.jax_device(idx)  # invalid ordinal -> RuntimeError
        self = _BaseGenerator.__new__(cls, "cpu")
        self._tpu_device = torch.device("tpu", idx)
        self._tpu_state = _rng.GeneratorState(_rng._DEFAULT_SEED)
        _rng.register_generator(self)
        return self

    @property
    def device(self):
        return self._tpu_device

    def manual_seed(self, seed):
        seed = int(seed)
        if seed < -(1 << 63) or seed >= (1 << 64):
            raise RuntimeError(f"Overflow when unpacking long long, seed {seed}")
        self._tpu_state.seed = seed & 0xFFFFFFFFFFFFFFFF
        self._tpu_state.offset = 0
        return self

    def seed(self):
        import random

        s = random.getrandbits(63)
        self.manual_seed(s)
        return s

    def initial_seed(self):
        return self._tpu_state.seed

    def get_state(self):
        return self._tpu_state.get_state()

    def set_state(self, new_state):
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            raise TypeError(f"expected a torch.ByteTensor, but got {type(new_state).__name__}")
        self._tpu_state.set_state(new_state)
        return self

    def get_offset(self):
        return self._tpu_state.offset

    def set_offset(self, offset):
        self._tpu_state.offset = int(offset)
        return self

    def clone_state(self):
        g = Generator(self._tpu_device)
        g.set_state(self.get_state())
        return g

    def graphsafe_get_state(self):
        return self.clone_state()

    def graphsafe_set_state(self, other):
        self.set_state(other.get_state())
        return self

    def __reduce__(self):
        return (_new_tpu_generator, (str(self._tpu_device), self.get_state()))

    def __deepcopy__(self, memo):
        return self.clone_state()

    def __repr__(self):
        return f"<torch.Generator device={self._tpu_device} seed={self._tpu_state.seed}>"


def _new_tpu_generator(device, state):
    g = Generator(device)
    g.set_state(state)
    return g


def default_generator(index: int) -> Generator:
    """The Generator object of tpu:index whose state is the device's default RNG state."""
    g = _defaults.get(index)
    if g is None:
        g = Generator(torch.device("tpu", index))
        g._tpu_state = _rng.default_state(index)
        _defaults[index] = g
    return g


_defaults: dict = {}


# ---------------------------------------------------------------- torch.Event / torch.Stream

_BaseEvent = torch.Event
_BaseStream = torch.Stream


class _EventMeta(type(_BaseEvent)):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _BaseEvent)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _BaseEvent)


class _StreamMeta(type(_BaseStream)):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _BaseStream)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _BaseStream)


def _means_tpu(device) -> bool:
    if device is None:
        return _acc_is_tpu()
    if isinstance(device, int):
        return _acc_is_tpu()
    return torch.device(device).type == "tpu"


class Event(_BaseEvent, metaclass=_EventMeta):
    """``torch.Event``: torch.tpu.Event (runtime/sync.py) for "tpu", PyTorch's otherwise."""

    def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        if _means_tpu(device):
            from ..runtime import sync

            return sync.Event(enable_timing, blocking, interprocess, device=device)
        return _BaseEvent(device, enable_timing=enable_timing, blocking=blocking,
                          interprocess=interprocess)


class Stream(_BaseStream, metaclass=_StreamMeta):
    """``torch.Stream``: torch.tpu.Stream (runtime/sync.py) for "tpu", PyTorch's otherwise."""

    def __new__(cls, device=None, *, priority=0, **kwargs):
        from ..runtime import sync

        tpu = (kwargs["device_type"] == sync._PRIVATEUSE1 if "device_type" in kwargs
               else _means_tpu(device))
        if tpu:
            return sync.Stream(device, priority, **kwargs)
        if device is None:
            return _BaseStream(priority=priority, **kwargs)
        return _BaseStream(device, priority=priority, **kwargs)


# ---------------------------------------------------------------- storages

_StorageNew = torch._C.StorageBase.__new__
_StorageCopy = torch._C.StorageBase.copy_


@functools.lru_cache(maxsize=None)
def _zeros_u8(n: int, device):
    return jax.jit(lambda: jax.numpy.zeros((n,), jax.numpy.uint8),
                   out_shardings=jax.sharding.SingleDeviceSharding(device))


def _storage_new(cls, *args, **kwargs):
    dev = kwargs.get("device")
    idx = _tpu_index(dev) if dev is not None else None
    if idx is None or cls is not torch.UntypedStorage:
        return _StorageNew(cls, *args, **kwargs)
    jdev = _devices.jax_device(idx)
    extra = set(kwargs) - {"device"}
    if extra:
        raise TypeError(f"UntypedStorage(): unexpected arguments {sorted(extra)} for device tpu")
    if not args:
        data = np.zeros((0,), np.uint8)
    elif isinstance(args[0], int) and len(args) == 1:
        data = None
        n = args[0]
    elif len(args) == 1:
        data = np.asarray(list(args[0]), dtype=np.int64)
        if ((data < 0) | (data > 255)).any():
            raise RuntimeError("UntypedStorage(): values must be in [0, 255]")
        data = data.astype(np.uint8)
    else:
        raise TypeError(f"UntypedStorage(): unsupported arguments {args!r} for device tpu")
    if data is not None:
        n = data.size
        arr = jax.device_put(data, jdev)
    else:
        arr = _zeros_u8(n, jdev)()
    st = _buffer.new_storage(n, idx)
    _buffer.buffer_of_storage(st, arr)
    return st


def _host_bytes(st) -> np.ndarray:
    """The bytes of a tpu storage as a host uint8 array (a host sync)."""
    from ..eager import copy as _copy

    arr = _buffer.buffer_of_storage(st).array
    if arr is None:
        return np.zeros((st.nbytes(),), np.uint8)
    if arr.dtype != np.uint8:
        arr = _bitcast_to("uint8", arr.shape)(arr)
    return _copy.device_to_host(arr.reshape(-1)).numpy()


def _storage_copy(self, src, non_blocking=False):
    dst_tpu = self.device.type == "tpu"
    src_tpu = src.device.type == "tpu"
    if not (dst_tpu or src_tpu):
        return _StorageCopy(self, src, non_blocking)
    if self.nbytes() != src.nbytes():
        raise RuntimeError(f"size mismatch, {self.nbytes()} vs {src.nbytes()}")
    if dst_tpu and src_tpu:
        arr = _buffer.buffer_of_storage(src).array
        if (self.device.index or 0) != (src.device.index or 0):
            arr = jax.device_put(arr, _devices.jax_device(self.device.index or 0))
        _buffer.buffer_of_storage(self, arr)  # arrays are immutable: sharing is a copy
    elif dst_tpu:
        host = torch.empty((0,), dtype=torch.uint8).set_(src).numpy().copy()
        from ..eager import copy as _copy

        arr = _copy.host_to_device(torch.from_numpy(host), self.device.index or 0)
        _buffer.buffer_of_storage(self, arr)
    else:
        host = torch.from_numpy(_host_bytes(src))
        _StorageCopy(self, host.untyped_storage(), False)
    return self


_StorageWriteFile = torch._C.StorageBase._write_file


def _storage_write_file(self, f, is_real_file, save_size, element_size):
    # the C++ writer reads device memory through data_ptr(), which a tpu storage only fakes
    if self.device.type == "tpu":
        self = self.cpu()
    return _StorageWriteFile(self, f, is_real_file, save_size, element_size)


_StorageSetFromFile = torch._C.StorageBase._set_from_file


def _storage_set_from_file(self, f, offset, is_real_file, element_size):
    if self.device.type != "tpu":
        return _StorageSetFromFile(self, f, offset, is_real_file, element_size)
    host = torch.UntypedStorage(self.nbytes())
    _StorageSetFromFile(host, f, offset, is_real_file, element_size)
    return self.copy_(host)


def _storage_tpu(self, device=None, non_blocking=False):
    """``UntypedStorage.tpu()``: a copy on tpu (self if it is there already)."""
    idx = _tpu_index(torch.device("tpu") if device is None else
                     (torch.device("tpu", device) if isinstance(device, int) else device))
    if self.device.type == "tpu" and (self.device.index or 0) == idx:
        return self
    return torch.UntypedStorage(self.nbytes(), device=torch.device("tpu", idx)).copy_(self)


_StorageResize = torch._C.StorageBase.resize_


@functools.lru_cache(maxsize=None)
def _grow(n_old: int, n_new: int, dtype, device):
    """The storage array resized from ``n_old`` to ``n_new`` elements: the prefix kept, the
    rest zeros (PyTorch leaves it uninitialised)."""
    def grow(old):
        flat = old.reshape(-1)[:min(n_old, n_new)]
        return jax.numpy.concatenate([flat, jax.numpy.zeros((n_new - flat.shape[0],), dtype)])

    return jax.jit(grow, out_shardings=jax.sharding.SingleDeviceSharding(device))


def _storage_resize(self, nbytes):
    """``UntypedStorage.resize_`` on a tpu storage (FSDP2 frees unsharded parameters with
    ``resize_(0)`` and re-allocates them with ``resize_(n)``). C++ would call the hooks'
    ``resizePrivateUse1Bytes``, which Python cannot provide; instead the storage takes a new
    fake data pointer of the new size (``_swap_data_ptr_`` with a fresh storage, so every
    tensor and view on it sees the new size) and its buffer a new array: the old one is
    dropped at size 0 (``memory_allocated`` falls), the prefix kept otherwise."""
    if self.device.type != "tpu":
        return _StorageResize(self, nbytes)
    nbytes = int(nbytes)
    if nbytes < 0:
        raise RuntimeError(f"Storage size calculation overflowed with sizes=[{nbytes}]")
    old_bytes = self.nbytes()
    if nbytes == old_bytes:
        return self
    idx = self.device.index or 0
    buf = _buffer.buffer_of_storage(self)
    if nbytes == 0 and getattr(buf, "pending", False):
        arr = buf.aval  # freeing a value the Fused graph has not computed yet: no cut
    else:
        arr = buf.array
    if arr is None:
        arr = np.zeros((0,), np.uint8)
    dt = np.dtype(arr.dtype)
    if nbytes % dt.itemsize or old_bytes % dt.itemsize:
        if dt != np.uint8:
            arr = _bitcast_to("uint8", arr.shape)(arr)
        dt = np.dtype(np.uint8)
    jdev = _devices.jax_device(idx)
    if nbytes == 0:
        new = jax.device_put(np.zeros((0,), dt), jdev)
    else:
        if not isinstance(arr, jax.Array):
            arr = jax.device_put(np.asarray(arr), jdev)
        new = _grow(old_bytes // dt.itemsize, nbytes // dt.itemsize, dt, jdev)(arr)
    swap = torch._C.StorageBase._swap_data_ptr_  # needs equal sizes or one of them 0
    if old_bytes and nbytes:
        swap(self, _buffer.new_storage(0, idx))
    swap(self, _buffer.new_storage(nbytes, idx))
    buf.array = new
    return self


def _install_storage() -> None:
    torch.UntypedStorage.__new__ = _storage_new
    torch.UntypedStorage.copy_ = _storage_copy
    torch.UntypedStorage.resize_ = _storage_resize
    torch.UntypedStorage._write_file = _storage_write_file
    torch.UntypedStorage._set_from_file = _storage_set_from_file
    if not hasattr(torch.UntypedStorage, "tpu"):
        torch.UntypedStorage.tpu = _storage_tpu


def retype_storage(t: torch.Tensor) -> None:
    """Store a raw-bytes (uint8) tpu storage as ``t``'s dtype, so later ops need no bitcast.
    Views of other dtypes stay correct: they bitcast (eager/views.py, spec "b")."""
    if t.device.type != "tpu" or t.dtype == torch.uint8:
        return
    st = t.untyped_storage()
    buf = getattr(st, "_tpu_buffer", None)
    if buf is None or buf.array is None or buf.array.dtype != np.uint8:
        return
    if st.nbytes() % t.element_size():
        return
    from ..runtime.dtypes import to_jax

    buf.array = _bitcast_to(np.dtype(to_jax(t.dtype)).name, buf.array.shape)(buf.array)


@functools.lru_cache(maxsize=None)
def _bitcast_to(dtype_name, shape):
    from ..eager import views

    return jax.jit(lambda a: views.bitcast_flat(a, np.dtype(dtype_name)))


# ---------------------------------------------------------------- serialization

def _tag(obj):
    if getattr(obj, "device", None) is not None and obj.device.type == "tpu":
        return f"tpu:{obj.device.index or 0}"
    return None


def _deserialize(obj, location):
    if not location.startswith("tpu"):
        return None
    idx = _tpu_index(torch.device(location))
    if obj.device.type == "tpu" and (obj.device.index or 0) == idx:
        return obj
    st = torch.UntypedStorage(obj.nbytes(), device=torch.device("tpu", idx))
    return st.copy_(obj)


_orig_rebuild_tensor = torch._utils._rebuild_tensor


def _rebuild_tensor(storage, storage_offset, size, stride):
    t = _orig_rebuild_tensor(storage, storage_offset, size, stride)
    if t.device.type == "tpu":
        retype_storage(t)
    return t


def _install_serialization() -> None:
    torch.serialization.register_package(5, _tag, _deserialize)
    torch._utils._rebuild_tensor = _rebuild_tensor


# ---------------------------------------------------------------- torch.accelerator

def _acc_is_tpu():
    acc = torch._C._get_accelerator()
    return acc.type == "tpu"


def _wrap_accelerator() -> None:
    from ..runtime import memory, sync

    acc = torch.accelerator
    impl = {
        "synchronize": lambda i: sync.synchronize(i),
        "memory_allocated": memory.memory_allocated,
        "max_memory_allocated": memory.max_memory_allocated,
        "memory_reserved": memory.memory_reserved,
        "max_memory_reserved": memory.max_memory_reserved,
        "memory_stats": memory.memory_stats,
        "reset_peak_memory_stats": memory.reset_peak_memory_stats,
        "reset_accumulated_memory_stats": lambda i: None,
        "get_memory_info": memory.mem_get_info,
        "current_stream": lambda i: _tpu_stream(i),
    }
    for name, fn in impl.items():
        orig = getattr(acc, name, None)
        if orig is None:
            continue
        wrapped = _acc_wrapper(orig, fn)
        setattr(acc, name, wrapped)
        mod = getattr(acc, "memory", None)
        if mod is not None and getattr(mod, name, None) is orig:
            setattr(mod, name, wrapped)
    orig_set_stream = getattr(acc, "set_stream", None)
    if orig_set_stream is not None:
        @functools.wraps(orig_set_stream)
        def set_stream(stream):
            if getattr(stream, "device_type", None) == sync._PRIVATEUSE1:
                tpu_module = _device_module[0]

                return tpu_module.set_stream(stream)
            return orig_set_stream(stream)

        from ..eager.dynamo_skip import skip

        acc.set_stream = skip(set_stream)
    orig_empty = acc.empty_cache

    @functools.wraps(orig_empty)
    def empty_cache():
        if _acc_is_tpu():
            return memory.empty_cache()
        return orig_empty()

    acc.empty_cache = empty_cache
    orig_host = getattr(acc, "empty_host_cache", None)
    if orig_host is not None:
        @functools.wraps(orig_host)
        def empty_host_cache():
            # tpu "pinned" host buffers are ordinary CPU tensors: no host cache to empty
            # (PyTorch's own would reach a pinned allocator that does not exist: a crash)
            if _acc_is_tpu():
                return None
            return orig_host()

        acc.empty_host_cache = empty_host_cache
        if getattr(acc, "memory", None) is not None and getattr(acc.memory, "empty_host_cache", None) is orig_host:
            acc.memory.empty_host_cache = empty_host_cache
    orig_cap = acc.get_device_capability

    @functools.wraps(orig_cap)
    def get_device_capability(device=None, /):
        if _acc_is_tpu() and (device is None or isinstance(device, int) or _means_tpu(device)):
            from ..runtime.dtypes import TORCH_TO_JAX

            return {"supported_dtypes": set(TORCH_TO_JAX)}
        return orig_cap(device)

    acc.get_device_capability = get_device_capability
    if getattr(acc, "memory", None) is not None and getattr(acc.memory, "empty_cache", None) is orig_empty:
        acc.memory.empty_cache = empty_cache


def _tpu_stream(index):
    tpu_module = _device_module[0]

    return tpu_module.current_stream(index)


def _acc_wrapper(orig, fn):
    @functools.wraps(orig)
    def wrapper(device_index=None, *args, **kwargs):
        if _acc_is_tpu():
            if isinstance(device_index, (str, torch.device)):
                device_index = _tpu_index(device_index)
            tpu_module = _device_module[0]

            idx = tpu_module.current_device() if device_index is None else device_index
            return fn(idx)
        return orig(device_index, *args, **kwargs)

    # Dynamo calls torch.accelerator.current_stream() while compiling; without the skip it
    # tries to compile this frame too, recursing until RecursionError (DESIGN fact 4)
    from ..eager.dynamo_skip import skip

    return skip(wrapper)


# ---------------------------------------------------------------- pinned memory

_orig_pin = torch.Tensor.pin_memory
_orig_is_pinned = torch.Tensor.is_pinned


def _pin_memory(self, device=None):
    """CPU pinned memory for tpu transfers. PJRT stages host buffers itself, so "pinning" is a
    contiguous host copy, marked pinned (``is_pinned()`` is True for it, as CUDA's is)."""
    target = device if device is not None else None
    if self.device.type != "cpu" or not (
            (target is None and _acc_is_tpu()) or (target is not None and torch.device(target).type == "tpu")):
        return _orig_pin(self) if device is None else _orig_pin(self, device)
    if _is_pinned(self):
        return self
    out = torch.empty_like(self, memory_format=torch.contiguous_format)
    out.copy_(self)
    out.untyped_storage()._tpu_pinned = True
    return out


def _is_pinned(self, device=None):
    if self.device.type == "cpu" and getattr(self.untyped_storage(), "_tpu_pinned", False):
        return True
    if self.device.type == "tpu":
        return False
    return _orig_is_pinned(self) if device is None else _orig_is_pinned(self, device)


def _install_pin_memory() -> None:
    torch.Tensor.pin_memory = _pin_memory
    torch.Tensor.is_pinned = _is_pinned


# ---------------------------------------------------------------- non_blocking copies

def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None,
             non_blocking=False, memory_format=None):
    """aten::_to_copy to or from tpu. PyTorch's composite allocates a pinned CPU output
    for ``non_blocking`` device-to-host copies, which needs a C++ pinned allocator we cannot
    provide. A device-to-host copy of a jax array completes before it returns anyway, so the
    result is ready (and correct) whatever ``non_blocking`` says; host-to-device copies
    (jax.device_put) stay asynchronous."""
    if layout not in (None, torch.strided):
        raise RuntimeError(f"_to_copy: layout {layout} is not supported on tpu")
    dt = self.dtype if dtype is None else dtype
    dev = self.device if device is None else torch.device(device)
    mf = torch.preserve_format if memory_format is None else memory_format
    if dev.type == "tpu" and self.device.type == "tpu" \
            and _executor._device_index(dev) == self.device.index \
            and mf in (torch.preserve_format, torch.contiguous_format):
        # same device: one cached dtype-conversion program, no allocate-then-copy
        return torch.ops.prims.convert_element_type.default(self, dt)
    if dev.type == "tpu" and self.device.type == "cpu" and dt == self.dtype \
            and self.layout == torch.strided and not (self.is_conj() or self.is_neg()) \
            and (mf is torch.contiguous_format
                 or (mf is torch.preserve_format and self.is_contiguous())):
        # host to device: one transfer into a new tensor. Allocating the tpu tensor first
        # and copying into it ran a zeros program per new shape (an XLA compile each: every
        # batch shape a data loader makes)
        return _buffer.wrap(_copy.host_to_device(self, _executor._device_index(dev)))
    out = torch.empty_like(self, dtype=dt, device=dev, memory_format=mf)
    out.copy_(self)
    if pin_memory and dev.type == "cpu":
        out.untyped_storage()._tpu_pinned = True
    return out


_kernel_libs: list = []


def _install_kernels() -> None:
    from ..eager.dynamo_skip import skip

    lib = torch.library.Library("aten", "IMPL")
    _kernel_libs.append(lib)
    try:
        lib.impl("_to_copy", skip(_to_copy), "PrivateUse1")
    except RuntimeError:
        pass  # a kernel of the eager layer already handles it


# ---------------------------------------------------------------- install

# torch.tpu (device/tpu_module.py), passed in by device/registration.py: tpu_module imports this
# module (its default generators), so this one cannot import it
_device_module: list = [None]


def install(device_module) -> None:
    _device_module[0] = device_module
    torch.Generator = Generator
    torch.Event = Event
    torch.Stream = Stream
    _install_storage()
    _install_serialization()
    _wrap_accelerator()
    _install_pin_memory()
    _install_kernels()
    from . import multidevice

    multidevice.install()
    from . import autocast

    autocast.install()
    torch.set_autocast_dtype("tpu", torch.bfloat16)  # the TPU's native low precision
