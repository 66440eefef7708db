"""``torch.tpu.set_sync_debug_mode``: warn about, or refuse, operations that make the host wait
for the device, as ``torch.cuda.set_sync_debug_mode`` does for synchronizing CUDA operations.

A host sync is whatever ``torch.tpu.metrics()`` counts as ``host_syncs``: a device-to-host
read (``.item()``, ``.cpu()``, ``.tolist()``, printing, ``bool(t)``), an op whose output shape
depends on the data (``nonzero``, ``unique``, boolean-mask indexing), an op run by PyTorch's
CPU kernel on the device's values, and a compiled graph's host-side values. Each calls
``note`` before it waits: in mode 1 ("warn") it warns, in mode 2 ("error") it raises
``RuntimeError`` and nothing waits. An explicit ``torch.tpu.synchronize()`` is what the user
asked for and is never reported (as on CUDA, where only implicit syncs are).
"""
from __future__ import annotations

import warnings

_NAMES = {"default": 0, "warn": 1, "error": 2}
_mode = [0]


def set_sync_debug_mode(debug_mode) -> None:
    """0 or "default": nothing; 1 or "warn": warn on each host sync; 2 or "error": raise."""
    if isinstance(debug_mode, str):
        if debug_mode not in _NAMES:
            raise RuntimeError(
                "invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = _NAMES[debug_mode]
    _mode[0] = int(debug_mode)


def get_sync_debug_mode() -> int:
    return _mode[0]


def note(what: str) -> None:
    """A host sync is about to happen (``what``: the op or read that needs it)."""
    if _mode[0]:
        msg = f"called a synchronizing TPU operation: {what}"
        if _mode[0] == 1:
            warnings.warn(msg, stacklevel=3)
        else:
            raise RuntimeError(msg)
