"""PJRT devices through JAX: which platform, which devices, x64 semantics."""
from __future__ import annotations

import functools
import os

import jax

# PyTorch semantics need int64/float64 (DESIGN fact 9).
jax.config.update("jax_enable_x64", True)

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


@functools.lru_cache(maxsize=None)
def devices() -> tuple:
    """The local PJRT devices that tpu:0, tpu:1, ... name."""
    return tuple(jax.local_devices(backend=platform()))


def device_count() -> int:
    return len(devices())


def jax_device(index: int | None):
    """The jax device for tpu:index, raising like CUDA for an invalid ordinal."""
    devs = devices()
    i = 0 if index is None else index
    if not 0 <= i < len(devs):
        raise RuntimeError(
            f"Invalid device ordinal: tpu:{i} does not exist (device_count() is {len(devs)})")
    return devs[i]


def device_name(index: int | None = None) -> str:
    d = jax_device(index)
    kind = getattr(d, "device_kind", "") or d.platform
    return kind
