"""Data-dependent input checks (indices in range), reported like CUDA's device-side asserts.

PyTorch checks index bounds on the host before a CPU kernel runs; checking them here before
dispatch would need a host sync per op. Instead, a lowering with a ``check`` (registry.py)
computes "inputs valid" inside the op's own XLA program, the flag joins a pending list, and the
next host sync (``.item()``, ``.cpu()``, printing, ``torch.tpu.synchronize()``) reads all pending
flags at once and raises for the first failed one, naming the op. As on CUDA, the error is
reported at a later call than the op's; Debug mode (``TORCH_TPU_LAUNCH_BLOCKING=1``) checks right
after each op, so the traceback points at the user's line.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..runtime import sync as _sync
from ..runtime.metrics import count

_pending: list = []  # (flag array, op name, exception type, message)
_FOLD_AT = 64  # fold the list into one flag on device when it grows past this


@jax.jit
def _all(flags):
    return jnp.all(jnp.stack(flags))


def add(ok, name: str, exc: type, message: str) -> None:
    _pending.append((ok, name, exc, message))
    count("device_checks")
    if len(_pending) >= _FOLD_AT:
        _fold()


def _fold() -> None:
    """Replace the computed flags of one (op, error) by one flag computed on device, so a long
    asynchronous stretch keeps a short list (and the sync reads a few scalars). Flags of a
    Fused graph not run yet (pending buffers) stay as they are: reading them would cut it."""
    global _FOLD_AT
    groups: dict = {}
    keep = []
    for ok, name, exc, msg in _pending:
        if isinstance(ok, jax.Array):
            groups.setdefault((name, exc, msg), []).append(ok)
        else:
            keep.append((ok, name, exc, msg))
    _pending[:] = keep
    for (name, exc, msg), oks in groups.items():
        _pending.append((_all(oks) if len(oks) > 1 else oks[0], name, exc, msg))
    _FOLD_AT = max(64, 2 * len(_pending))


def raise_pending() -> None:
    """Read every pending flag (one transfer) and raise for the first failed check."""
    if not _pending:
        return
    global _FOLD_AT
    items = list(_pending)
    _pending.clear()
    _FOLD_AT = 64
    # a Fused graph's flag is a pending buffer: reading it runs the graph (at a sync, it has run)
    values = jax.device_get([ok if isinstance(ok, jax.Array) else ok.array for ok, *_ in items])
    for v, (_, name, exc, msg) in zip(values, items):
        if not bool(v):
            raise exc(f"{msg} (in {name} on device tpu; tpu ops run asynchronously, so this is "
                      f"reported at a later call: run with TORCH_TPU_LAUNCH_BLOCKING=1 to stop "
                      f"at the op)")


def check_now(ok, name: str, exc: type, message: str) -> None:
    """A check whose flag is concrete already (Debug mode, un-jitted ops): raise at once."""
    if not bool(ok):
        raise exc(f"{message} (in {name} on device tpu)")


_sync.on_synchronized(raise_pending)
