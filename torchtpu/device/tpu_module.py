"""``torch.tpu``: the device module PyTorch finds for device type "tpu" (TorchTPU's names)."""

import os as _os
import threading as _threading

import jax as _jax
import torch as _torch

from ..eager import fallback as _fallback
from ..eager import fastpath as _fastpath
from ..eager import modes as _modes
from ..eager import rng as _rng
from ..runtime import devices as _devices
from ..runtime import metrics as _metrics
from ..compile import compiler  # noqa: F401  (torch.tpu.compiler; installs backend "tpu")

EagerMode = _modes.EagerMode
set_eager_mode = _modes.set_eager_mode
get_eager_mode = _modes.get_eager_mode
metrics = _metrics.metrics
reset_metrics = _metrics.reset_metrics

_current = [0]


def is_available() -> bool:
    """Whether "tpu" has a device. Like CUDA's, it does not create the runtime: before the
    JAX backend exists the answer is True when JAX picks the platform (it always has one, its
    CPU backend at least), so a process of a multi-process job that asks (libraries do at
    import) can still join its job before the backend is created; a named platform
    (TORCHTPU_PLATFORM=tpu/gpu) is checked by creating it."""
    if not _devices.backend_created() and _os.environ.get(
            "TORCHTPU_PLATFORM", "").strip().lower() in ("", "cpu"):
        return True
    try:
        return _devices.device_count() > 0
    except Exception:
        return False


def is_initialized() -> bool:
    return not _devices.in_bad_fork()


# torch.utils.checkpoint saves and restores a device's RNG state only when its module says it
# is initialized (dropout inside a checkpointed block must draw the same mask when recomputed)
_initialized = True


def _is_in_bad_fork() -> bool:
    """Forked from a process whose backend existed: the device cannot be used here (as CUDA;
    ``torch.manual_seed`` then leaves its generators alone)."""
    return _devices.in_bad_fork()


def _lazy_init() -> None:
    _devices.check_fork()


def device_count() -> int:
    return _devices.visible_device_count()


def current_device() -> int:
    return _current[0]


def _index(device) -> int:
    if device is None:
        return _current[0]
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = _torch.device(device)
    if isinstance(device, _torch.device):
        if device.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        return _current[0] if device.index is None else device.index
    raise TypeError(f"invalid device {device!r}")


_devices.register_index_hooks(current_device, _index)


def set_device(device) -> None:
    idx = _index(device)
    _devices.jax_device(idx)
    _current[0] = _devices.canonical_index(idx)
    _fastpath.set_current_device(_current[0])


class device:
    """Context manager that changes the current tpu device."""

    def __init__(self, device):
        self.idx = _index(device) if device is not None else -1
        self.prev = -1

    def __enter__(self):
        self.prev = _current[0]
        if self.idx >= 0:
            set_device(self.idx)

    def __exit__(self, *exc):
        if self.idx >= 0:
            _current[0] = self.prev
            _fastpath.set_current_device(self.prev)
        return False


class device_of(device):
    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "tpu" else None)


def get_device_name(device=None) -> str:
    return _devices.device_name(_index(device))


def get_device_capability(device=None):
    return (0, 0)


# Peak dense bfloat16 matmul throughput per PJRT device (FLOP/s), from the vendors' published
# figures, keyed by a lower-case substring of ``device_kind`` (first match wins, so specific
# names come before their prefixes). TPU v2/v3 show each TensorCore as a device: half a chip.
_PEAK_BF16_FLOPS = (
    ("tpu v2", 22.5e12), ("tpu v3", 61.5e12), ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12), ("tpu v5e", 197e12), ("tpu v5p", 459e12), ("tpu v5", 459e12),
    ("tpu v6 lite", 918e12), ("tpu v6e", 918e12),
    ("a100", 312e12), ("h100 pcie", 756e12), ("h100", 989e12), ("h200", 989e12),
    ("b200", 2250e12), ("l40s", 362e12), ("l4", 121e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Published peak dense bf16 FLOP/s of a device kind, or None where unknown (CPU)."""
    kind = device_kind.lower()
    for key, flops in _PEAK_BF16_FLOPS:
        if key in kind:
            return flops
    return None


class _DeviceProperties:
    """What ``get_device_properties`` returns (CUDA-like attribute names where they apply).

    ``total_memory`` is the device's memory (PJRT's limit; the host's on the CPU platform,
    where ``is_integrated`` is True as the memory is shared); ``peak_flops`` the published
    peak dense bfloat16 FLOP/s of the device kind, None where unknown.
    """

    def __init__(self, index: int):
        d = _devices.jax_device(index)
        from ..runtime import memory

        self.index = index
        self.name = _devices.device_name(index)
        self.platform = d.platform
        self.platform_version = getattr(d.client, "platform_version", "")
        self.device_kind = getattr(d, "device_kind", d.platform)
        self.id = d.id
        self.process_index = d.process_index
        self.total_memory = memory.total_memory(index)
        self.type = "tpu"
        self.major, self.minor = get_device_capability(index)
        self.multi_processor_count = getattr(d, "core_count", 1) or 1
        self.is_integrated = d.platform == "cpu"
        self.peak_flops = peak_flops(self.device_kind)

    def __repr__(self):
        flops = "" if self.peak_flops is None else f", peak_flops={self.peak_flops:.4g}"
        return (f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', "
                f"total_memory={self.total_memory // (1024 * 1024)}MB{flops}, "
                f"index={self.index})")


def get_device_properties(device=None) -> _DeviceProperties:
    return _DeviceProperties(_index(device))


def get_amp_supported_dtype():
    return [_torch.bfloat16, _torch.float16]


def _get_device_index(device, optional=False):
    return _index(device)


def synchronize(device=None) -> None:
    """Block until all work queued on the device(s) is done."""
    from ..runtime import sync

    sync.synchronize(device)


# ---- streams, events, memory (runtime/sync.py, runtime/memory.py) ----

from ..runtime import memory as _memory  # noqa: E402
from ..runtime import sync as _sync  # noqa: E402

Stream = _sync.Stream
Event = _sync.Event
memory_allocated = _memory.memory_allocated
max_memory_allocated = _memory.max_memory_allocated
memory_reserved = _memory.memory_reserved
max_memory_reserved = _memory.max_memory_reserved
memory_stats = _memory.memory_stats
reset_peak_memory_stats = _memory.reset_peak_memory_stats
mem_get_info = _memory.mem_get_info
empty_cache = _memory.empty_cache
reset_max_memory_allocated = _memory.reset_peak_memory_stats  # CUDA's older name for it
OutOfMemoryError = _torch.OutOfMemoryError  # torch.cuda.OutOfMemoryError is the same class

from ..runtime import sync_debug as _sync_debug  # noqa: E402

set_sync_debug_mode = _sync_debug.set_sync_debug_mode
get_sync_debug_mode = _sync_debug.get_sync_debug_mode


def init() -> None:
    """Create the device runtime now (``torch.cuda.init``); every use does so on demand."""
    _lazy_init()
    _devices.device_count()


def ipc_collect() -> None:
    """``torch.cuda.ipc_collect``: nothing to collect (no tensor is shared through device IPC
    handles here; processes exchange values through collectives or the host)."""


def reset_accumulated_memory_stats(device=None) -> None:
    pass


def memory_summary(device=None, abbreviated: bool = False) -> str:
    st = memory_stats(device)
    return "\n".join(f"{k}: {v}" for k, v in st.items() if k != "pjrt")


_streams: dict = {}  # device index -> its default stream (stream_id 0)
_tls = _threading.local()  # .current: {device index: stream} (per thread, as CUDA's)


def default_stream(device=None) -> Stream:
    """The device's default stream (the current device when None)."""
    i = _index(device)
    s = _streams.get(i)
    if s is None:
        s = _streams.setdefault(i, Stream(stream_id=0, device_index=i))
    return s


def _current_map() -> dict:
    cur = getattr(_tls, "current", None)
    if cur is None:
        cur = _tls.current = {}
    return cur


def current_stream(device=None) -> Stream:
    """The stream selected on the device (this thread): its default stream unless
    ``set_stream`` / ``stream(s)`` / ``with s:`` selected another."""
    i = _index(device)
    s = _current_map().get(i)
    return s if s is not None else default_stream(i)


def _as_tpu_stream(stream) -> Stream:
    if isinstance(stream, Stream):
        return stream
    if isinstance(stream, _torch.Stream) and stream.device.type == "tpu":
        return Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                      device_type=stream.device_type)
    raise ValueError(f"Expected a tpu stream, but got: {stream!r}")


def set_stream(stream) -> None:
    """Select ``stream`` as its device's current stream and make its device the current one,
    as ``torch.cuda.set_stream``; None does nothing. Prefer ``torch.tpu.stream(s)``."""
    if stream is None:
        return
    stream = _as_tpu_stream(stream)
    i = stream.device_index
    if i != _current[0]:
        set_device(i)
    _current_map()[i] = stream


class StreamContext:
    """``torch.tpu.stream(s)``: selects ``s`` inside the block and restores the streams (and
    device) that were current, as ``torch.cuda.StreamContext``. Reusable and re-entrant on
    the same object; with ``None`` it does nothing. ``__enter__`` returns None, as CUDA's."""

    def __init__(self, stream):
        self.stream = stream
        self.idx = current_device()
        self.src_prev_stream = None
        self.dst_prev_stream = None
        self._saved: list = []

    def __enter__(self):
        cur = self.stream
        if cur is None:
            return
        cur = _as_tpu_stream(cur)
        src_prev = current_stream(None)
        dst_prev = current_stream(cur.device_index) if src_prev.device != cur.device else None
        self._saved.append((src_prev, dst_prev))
        self.src_prev_stream, self.dst_prev_stream = src_prev, dst_prev
        set_stream(cur)

    def __exit__(self, *exc):
        if self.stream is None:
            return False
        src_prev, dst_prev = self._saved.pop()
        if dst_prev is not None:
            set_stream(dst_prev)
        set_stream(src_prev)
        return False


def stream(stream) -> StreamContext:
    """Context manager that selects ``stream`` (``torch.cuda.stream``'s semantics)."""
    return StreamContext(stream)


def _enter_stream(s: Stream) -> Stream:
    """``with s:`` (torch.Stream's context protocol): select ``s`` and its device."""
    stack = getattr(_tls, "with_stack", None)
    if stack is None:
        stack = _tls.with_stack = []
    i = s.device_index
    stack.append((_current[0], i, _current_map().get(i)))
    set_stream(s)
    return s


def _exit_stream(s: Stream) -> None:
    prev_device, i, prev = _tls.with_stack.pop()
    if prev is None:
        _current_map().pop(i, None)
    else:
        _current_map()[i] = prev
    if _current[0] != prev_device:
        set_device(prev_device)


_sync.set_stream_hooks(_enter_stream, _exit_stream)


def is_current_stream_capturing() -> bool:
    """No graph capture on tpu (compiled programs are XLA's): always False."""
    return False


def manual_seed(seed: int) -> None:
    _rng.manual_seed(int(seed), _current[0])


def manual_seed_all(seed: int) -> None:
    _rng.manual_seed(int(seed))
    for i in range(device_count()):
        _rng.manual_seed(int(seed), i)


def seed() -> None:
    _rng.seed(_current[0])


def seed_all() -> None:
    s = _rng.seed(0)
    manual_seed_all(s)


def initial_seed() -> int:
    return _rng.default_state(_current[0]).seed


def get_rng_state(device="tpu") -> _torch.Tensor:
    return _rng.default_state(_index(device)).get_state()


def set_rng_state(new_state, device="tpu") -> None:
    _rng.default_state(_index(device)).set_state(new_state)


def get_rng_state_all():
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states) -> None:
    for i, s in enumerate(states):
        set_rng_state(s, i)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def default_generator(index: int = 0):
    from . import extras

    return extras.default_generator(index)


class _DefaultGenerators:
    def __getitem__(self, i):
        return default_generator(range(device_count())[i])

    def __len__(self):
        return device_count()

    def __iter__(self):
        return (default_generator(i) for i in range(device_count()))


default_generators = _DefaultGenerators()


# ---- matmul precision, as TorchTPU names it ----

import enum as _enum  # noqa: E402


class Precision(_enum.Enum):
    """Matmul/conv precision on the device (XLA's PrecisionConfig): DEFAULT is the backend's
    fastest (one bf16 pass on TPU), HIGH three bf16 passes (~tf32), HIGHEST full float32."""

    DEFAULT = "default"
    HIGH = "high"
    HIGHEST = "highest"


_TORCH_PRECISION = {"medium": Precision.DEFAULT, "high": Precision.HIGH,
                    "highest": Precision.HIGHEST}


class precision:
    """``torch.tpu.precision()`` returns the current Precision; ``torch.tpu.precision(p)``
    sets it, and restores the previous one when used as a context manager."""

    def __new__(cls, p=None):
        if p is None:
            cur = _jax.config.jax_default_matmul_precision
            if cur is None:
                return Precision.DEFAULT
            for m in Precision:
                if m.value == str(cur).lower():
                    return m
            return Precision.DEFAULT
        self = object.__new__(cls)
        self.prev = _jax.config.jax_default_matmul_precision
        self.new = Precision(p) if not isinstance(p, Precision) else p
        _jax.config.update("jax_default_matmul_precision", self.new.value)
        return self

    def __enter__(self):
        return self.new

    def __exit__(self, *exc):
        _jax.config.update("jax_default_matmul_precision", self.prev)
        return False


def _get_enable_cpu_fallback() -> bool:
    return _fallback.enabled()


class _Module(type(_torch)):
    """Module type that gives ``torch.tpu`` settable properties."""

    @property
    def enable_cpu_fallback(self) -> bool:
        return _fallback.enabled()

    @enable_cpu_fallback.setter
    def enable_cpu_fallback(self, v: bool) -> None:
        _fallback.set_enabled(v)

    @property
    def eager_mode(self):
        return _modes.get_eager_mode()

    @eager_mode.setter
    def eager_mode(self, mode) -> None:
        _modes._set(mode)


from .. import pallas  # noqa: E402  (torch.tpu.pallas.jax_op)
from . import amp  # noqa: E402  (torch.tpu.amp: torch.cuda.amp's names)
from .. import profiler  # noqa: E402  (torch.tpu.profiler; hooks torch.profiler for "tpu")
from .. import export  # noqa: E402  (torch.tpu.export: ExportedProgram -> StableHLO)

import sys as _sys

_sys.modules[__name__].__class__ = _Module
