"""Synchronisation: wait for all queued device work."""
from __future__ import annotations

import gc

import jax

from .metrics import count

_sync_hooks: list = []  # called first (the fused executor flushes its pending graph)


def on_synchronize(fn) -> None:
    _sync_hooks.append(fn)


def synchronize(device=None) -> None:
    for fn in _sync_hooks:
        fn()
    count("synchronize_calls")
    # every live array: block on each (cheap for ready ones)
    for arr in jax.live_arrays():
        try:
            arr.block_until_ready()
        except Exception:
            pass
