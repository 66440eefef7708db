"""``torch.tpu.amp``: the names of ``torch.cuda.amp`` for device "tpu", so a script written
against ``torch.cuda.amp.autocast()`` / ``GradScaler()`` runs with only the device string
changed. Each is PyTorch's device-generic ``torch.amp`` object bound to "tpu"."""
import functools as _functools

import torch as _torch

__all__ = ["autocast", "GradScaler", "custom_fwd", "custom_bwd"]


class autocast(_torch.amp.autocast):
    """``torch.amp.autocast("tpu", ...)`` (the dtype defaults to the tpu autocast dtype)."""

    def __init__(self, enabled: bool = True, dtype: _torch.dtype | None = None,
                 cache_enabled: bool = True):
        super().__init__("tpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class GradScaler(_torch.amp.GradScaler):
    """``torch.amp.GradScaler("tpu", ...)``."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        super().__init__("tpu", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)


custom_fwd = _functools.partial(_torch.amp.custom_fwd, device_type="tpu")
custom_bwd = _functools.partial(_torch.amp.custom_bwd, device_type="tpu")
