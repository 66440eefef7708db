"""Eager execution modes, named as in TorchTPU."""
from __future__ import annotations

import contextlib
import enum
import os


class EagerMode(enum.Enum):
    DEFER_NEVER = "strict"  # default: async, one cached XLA program per op
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "debug"  # block after every op
    DEFER_AND_FUSE = "fused"  # record ops, compile and run the recorded graph at a cut


def _initial_mode() -> EagerMode:
    if os.environ.get("TORCH_TPU_LAUNCH_BLOCKING", "0") not in ("", "0"):
        return EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    if os.environ.get("TORCH_TPU_DEFER_AND_FUSE", "0") not in ("", "0"):
        return EagerMode.DEFER_AND_FUSE
    return EagerMode.DEFER_NEVER


_state = {"mode": _initial_mode()}
_listeners: list = []  # called with (old, new) before a switch (the fused executor flushes)


def get_eager_mode() -> EagerMode:
    return _state["mode"]


def _set(mode: EagerMode) -> None:
    mode = EagerMode(mode)
    old = _state["mode"]
    if old is mode:
        return
    for fn in _listeners:
        fn(old, mode)
    _state["mode"] = mode


@contextlib.contextmanager
def _switch(mode):
    old = get_eager_mode()
    _set(mode)
    try:
        yield
    finally:
        _set(old)


class set_eager_mode:
    """``torch.tpu.set_eager_mode(mode)``: sets the mode; also usable as a context manager
    that restores the previous mode on exit."""

    def __init__(self, mode):
        self._old = get_eager_mode()
        _set(mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _set(self._old)
        return False


def on_switch(fn) -> None:
    _listeners.append(fn)
