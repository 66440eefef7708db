"""Synchronisation, streams and events.

JAX has no user-visible streams: PJRT runs each device's programs in order and orders work by
data dependencies, so every op behaves as if on one in-order stream per device. The honest
model, then:

- ``Stream`` objects have CUDA's Python semantics (a new ``Stream()`` has its own id; the
  device's default stream is id 0; ``torch.tpu.stream(s)``, ``set_stream`` and ``with s:``
  select the current one, device/tpu_module.py), but all of a device's work runs on that one
  in-order queue whichever is selected. ``wait_event``/``wait_stream`` need no work: later ops
  already see the results they depend on.
- ``synchronize()`` waits for every device array still being computed: the live ones, and
  those whose tensors were freed first, which runtime/inflight.py holds until they are done.
- ``Event.record()`` snapshots the device arrays still being computed at that moment. The
  event is complete when all of them are ready. With ``enable_timing=True`` a helper thread
  waits for them and stamps the time they became ready, so ``elapsed_time`` measures real
  device completion times (to within a thread wake-up, microseconds), not call times.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref

import jax
import torch

from . import devices, inflight
from .metrics import count

# PyTorch's own classes (torchtpu.device.extras later puts device-dispatching ones in their place)
_BaseEvent = torch.Event.__mro__[-2]
_BaseStream = torch.Stream.__mro__[-2]

_sync_hooks: list = []  # called first (the fused executor flushes its pending graph)


def on_synchronize(fn) -> None:
    _sync_hooks.append(fn)


_done_hooks: list = []


def on_synchronized(fn) -> None:
    """Call ``fn`` after ``synchronize`` has waited (the eager checks raise from there)."""
    _done_hooks.append(fn)


def _flush() -> None:
    for fn in _sync_hooks:
        fn()


# Programs that exchange data with other processes (collectives, compiled graphs holding
# collectives) must reach the transport in the order they were issued, on every process: XLA:CPU
# runs independent programs concurrently. Each such program takes and returns this device's
# order token: {jax device: (owner, the last such program's token output)}, the output a global
# jax.Array whose one addressable shard is this process's token; the owner (the program's mesh)
# lets its next program take the global array as is.
order_tokens: dict = {}


def _device_filter(index):
    if index is None:
        return None
    from . import devices

    return devices.jax_device(index)


# Live arrays already found computed, by id: an array stays computed, so a later scan skips it
# with a dict lookup instead of ``is_ready`` (a PJRT call, ~3.7 us an array on the loaded 2-core
# host: ``Event.record``, ``Stream.query`` and ``synchronize`` scanned every live array, ~0.9 ms
# a call with 200 of them; SGLang records an event every step). The entry (a weak reference,
# removed when the array dies, before its id can be reused) is checked by identity.
_computed: dict = {}


def _forget(key):
    return lambda _ref: _computed.pop(key, None)


def _arrays(index=None, pending_only=True) -> list:
    """Live arrays on tpu:index (every device when None), not inflight.py's handles on results
    that were freed; ``pending_only``: those still being computed."""
    dev = _device_filter(index)
    out = []
    computed = _computed
    for arr in jax.live_arrays():
        if pending_only:
            r = computed.get(id(arr))
            if r is not None and r() is arr:
                continue
        try:
            if arr.is_deleted() or inflight.holds(arr):
                continue
            if dev is not None and dev not in arr.devices():
                continue
            if pending_only and arr.is_ready():
                k = id(arr)
                computed[k] = weakref.ref(arr, _forget(k))
                continue
        except Exception:
            continue
        out.append(arr)
    return out


def _block(arrays, raise_oom: bool = False) -> None:
    oom = None
    for arr in arrays:
        try:
            arr.block_until_ready()
        except Exception as e:  # deleted/donated meanwhile: nothing left to wait for
            if raise_oom and oom is None:
                from . import memory

                oom = memory.oom_error(e)
                if oom is not None:
                    oom.__cause__ = e
    if oom is not None:  # a program that ran out of memory while it ran (CUDA raises here too)
        raise oom


def _index_of(device):
    if device is None:
        return None
    from . import devices

    return devices.index_of(device)


def synchronize(device=None) -> None:
    """Block until all queued work on ``device`` (all devices when None) is done."""
    devices.check_fork()
    _flush()
    count("synchronize_calls")
    idx = _index_of(device)
    _block(_arrays(idx), raise_oom=True)
    # and work whose results were all freed: nothing can read what a failed one made, and the
    # same failure reaches whoever reads a result that depends on it, so it is not raised here
    _block(inflight.pending(_device_filter(idx)))
    inflight.clear()
    from . import memory

    memory.sample_peak(idx)
    for fn in _done_hooks:
        fn()


class Event(_BaseEvent):
    """A point in the device's work (see the module docstring for the model). A
    ``torch.Event`` subclass: ``torch.Event(device="tpu")`` returns one too."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False, device=None):
        return _BaseEvent.__new__(cls, device="tpu", enable_timing=enable_timing,
                                   blocking=blocking, interprocess=interprocess)

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, device=None):
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._device_arg = device
        self._arrays = None  # None: never recorded
        self._time = None
        self._thread = None
        self._lock = threading.Lock()

    def record(self, stream=None) -> None:
        _flush()
        idx = stream.device_index if stream is not None else _index_of(self._device_arg)
        arrays = _arrays(idx) + inflight.pending(_device_filter(idx))
        self._arrays = arrays
        self._time = None
        self._thread = None
        if not self.enable_timing:
            return
        if not arrays:
            self._time = time.perf_counter()
            return

        def waiter():
            _block(arrays)
            t = time.perf_counter()
            with self._lock:
                if self._arrays is arrays:
                    self._time = t
                    self._arrays = []  # done: keep no result alive past its tensors

        self._thread = threading.Thread(target=waiter, daemon=True, name="torchtpu-event")
        self._thread.start()

    def query(self) -> bool:
        """True when all work captured by the last ``record()`` has completed."""
        if not self._arrays:
            return True
        done = all(a.is_deleted() or a.is_ready() for a in self._arrays)
        if done and not self.enable_timing:
            self._arrays = []
        if done:
            inflight.clear()  # what finished is let go of (memory like CUDA's)
        return done

    def synchronize(self) -> None:
        if self._arrays:
            _block(self._arrays)
        if self._thread is not None:
            self._thread.join()
        elif self._arrays:
            self._arrays = []
        inflight.clear()

    def wait(self, stream=None) -> None:
        """Make ``stream``'s later work wait for this event: already true (data order)."""

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between this event's completion and ``end_event``'s."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._arrays is None or end_event._arrays is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        self.synchronize()
        end_event.synchronize()
        return (end_event._time - self._time) * 1000.0

    def ipc_handle(self):
        raise RuntimeError("tpu events do not support interprocess handles")

    def __repr__(self):
        return f"<torch.tpu.Event enable_timing={self.enable_timing}>"


# (enter, exit) of ``with stream:``: the device layer selects streams (device/tpu_module.py
# installs these when it loads; runtime never imports it)
_stream_hooks: list = [None, None]


def set_stream_hooks(enter, exit_) -> None:
    _stream_hooks[0], _stream_hooks[1] = enter, exit_


_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)
_stream_ids = itertools.count(1)  # 0: each device's default stream
_stream_ids_lock = threading.Lock()


class Stream(_BaseStream):
    """A stream on a tpu device, with CUDA's Python semantics: ``Stream()`` is a new stream
    (its own ``stream_id``, unequal to the others), ``default_stream()`` the device's stream 0,
    ``current_stream()`` the one selected by ``set_stream`` / ``torch.tpu.stream(s)`` / ``with
    s:``. What runs is the same whichever is selected: PJRT orders each device's work by data
    (see the module docstring), so every wait a stream API asks for already holds. A
    ``torch.Stream`` subclass: ``torch.Stream(device="tpu")`` returns one too."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs and "device_index" in kwargs:  # an existing stream, by id
            kwargs.setdefault("device_type", _PRIVATEUSE1)
            return _BaseStream.__new__(cls, priority=priority, **kwargs)
        from . import devices

        idx = devices.index_of(device)

        devices.jax_device(idx)  # validates the ordinal
        with _stream_ids_lock:
            sid = next(_stream_ids)
        # the id and index live in the C++ base only (no Python attribute): Dynamo wraps a
        # Stream as soon as the base exists (compiled DDP creates one inside a compiled frame)
        return _BaseStream.__new__(cls, stream_id=sid, device_index=idx,
                                   device_type=_PRIVATEUSE1, priority=priority)

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    def query(self) -> bool:
        _flush()
        return not _arrays(self.device_index)

    def synchronize(self) -> None:
        synchronize(self.device_index)

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        """Nothing to do: the device's work is ordered by data."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __enter__(self):
        """``with s:`` selects ``s`` (and its device) until the block ends, as torch.Stream."""
        return _stream_hooks[0](self)

    def __exit__(self, *exc):
        _stream_hooks[1](self)
        return False

    def __repr__(self):
        return (f"<torch.tpu.Stream device=tpu:{self.device_index} "
                f"stream_id={self.stream_id}>")
