"""``torch.tpu``: the device module PyTorch finds for device type "tpu" (TorchTPU's names)."""
from __future__ import annotations

import contextlib
import functools

import jax
import torch

from ..eager import fallback as _fallback
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
    try:
        return _devices.device_count() > 0
    except Exception:
        return False


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    pass


def device_count() -> int:
    return _devices.device_count()


def current_device() -> int:
    return _current[0]


def _index(device) -> int:
    if device is None:
        return _current[0]
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        return _current[0] if device.index is None else device.index
    raise TypeError(f"invalid device {device!r}")


def set_device(device) -> None:
    idx = _index(device)
    _devices.jax_device(idx)
    _current[0] = idx


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
        return False


class device_of(device):
    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "tpu" else None)


def get_device_name(device=None) -> str:
    return _devices.device_name(_index(device))


def get_device_capability(device=None):
    return (0, 0)


def synchronize(device=None) -> None:
    """Block until all work queued on the device(s) is done."""
    from ..runtime import sync

    sync.synchronize(device)


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


def get_rng_state(device="tpu") -> torch.Tensor:
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


def _get_enable_cpu_fallback() -> bool:
    return _fallback.enabled()


class _Module(type(torch)):
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


import sys as _sys

_sys.modules[__name__].__class__ = _Module
