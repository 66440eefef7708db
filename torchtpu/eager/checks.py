"""Data-dependent input checks (indices in range, valid probabilities), reported like CUDA's
device-side asserts.

PyTorch checks such conditions on the host before a CPU kernel runs; checking them here before
dispatch would need a host sync per op. Instead, a lowering with a ``check`` (registry.py)
computes "inputs valid" inside the op's own XLA program, the flag joins a pending list, and the
next host sync (``.item()``, ``.cpu()``, printing, ``torch.tpu.synchronize()``) reads all pending
flags at once (but those of a Fused graph not run yet) and raises for the first failed one,
naming the op. As on CUDA, the error is
reported at a later call than the op's; Debug mode (``TORCH_TPU_LAUNCH_BLOCKING=1``) checks right
after each op, so the traceback points at the user's line.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime import memory as _memory
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
    if len(_pending) >= _FOLD_AT and len(_pending) % _FOLD_AT == 0:
        _fold()


_NAMES = "one of "
_KINDS = "one of these input checks failed: "


class _Group:
    """The flags of one compiled program's checks with the program's own AND of them
    (``compile/lower.py``, ``trace_fn(all_flag=True)``): a sync reads the one combined flag;
    only when it failed are the program's flags read, to raise for the first failed check as
    the flags one by one would. Looks like a computed Fused buffer to the pending list."""

    __slots__ = ("array", "flags", "infos")
    pending = False

    def __init__(self, ok, flags, infos):
        self.array = ok
        self.flags = flags
        self.infos = infos

    def first_failed(self):
        """(op name, exception type, message) of the first failed flag, read in one transfer."""
        for v, info in zip(jax.device_get(list(self.flags)), self.infos):
            if not bool(v):
                return info
        return None


_described: dict = {}  # id(infos) -> (infos, _describe(infos))


def add_program_flags(flags, infos) -> None:
    """Add the input-check flags of one compiled program, described by ``infos`` ((op name,
    exception type, message) each). ``flags`` may lead with the program's AND of the others
    (one more flag than ``infos``): then they join the list as one entry, read in one transfer."""
    if len(infos) >= 2 and len(flags) == len(infos) + 1:
        # a compiled program passes the same ``infos`` every call: described once
        held = _described.get(id(infos))
        if held is None or held[0] is not infos:
            if len(_described) > 256:
                _described.clear()
            held = _described[id(infos)] = (infos, _describe(infos))
        name, exc, msg = held[1]
        _pending.append((_Group(flags[0], tuple(flags[1:]), tuple(infos)), name, exc, msg))
        count("device_checks", len(infos))
        if len(_pending) >= _FOLD_AT and len(_pending) % _FOLD_AT == 0:
            _fold()
        return
    for ok, info in zip(flags, infos):
        add(ok, *info)


def _parts(text: str, prefix: str, sep: str) -> list:
    return text[len(prefix):].split(sep) if text.startswith(prefix) else [text]


def _fold() -> None:
    """Replace the oldest ``_FOLD_AT`` computed flags by one flag computed on device (always
    that many, so the fold compiles once), so a long asynchronous stretch keeps a short list
    and the sync reads a few scalars. Flags of a Fused graph not run yet (pending buffers) are
    left alone: reading them would cut the graph."""
    ready = []
    rest = []
    for it in _pending:
        v = _computed(it[0])
        if v is not None and len(ready) < _FOLD_AT:
            ready.append((v,) + it[1:])
        else:
            rest.append(it)
    if len(ready) < _FOLD_AT:
        return
    name, exc, msg = _describe([it[1:] for it in ready])
    _pending[:] = [(_all([it[0] for it in ready]), name, exc, msg)] + rest


def _describe(infos):
    """(name, exception type, message) of one flag standing for checks ``infos`` ((name,
    exception type, message) each): "one of" the names, and the kinds' messages."""
    # an entry folded before is split into its parts again, so folding the fold (a long run)
    # names each op and message once instead of nesting them without bound
    names = sorted({n for it in infos for n in _parts(it[0], _NAMES, ", ")})
    excs = {it[1] for it in infos}
    msgs = sorted({m for it in infos for m in _parts(it[2], _KINDS, "; ")})
    exc = excs.pop() if len(excs) == 1 else RuntimeError
    # folded checks of different kinds: one of them failed
    msg = msgs[0] if len(msgs) == 1 else _KINDS + "; ".join(msgs)
    name = names[0] if len(names) == 1 else _NAMES + ", ".join(names)
    return name, exc, msg


def _computed(ok):
    """The flag's array, or None while it is a Fused graph's pending (not yet run) value."""
    if isinstance(ok, jax.Array):
        return ok
    return None if ok.pending else ok.array


def raise_pending() -> None:
    """Read every pending flag (one transfer) and raise for the first failed check."""
    if not _pending:
        return
    # A flag of a Fused graph not run yet stays pending: its op has not executed, so nothing
    # has failed yet, and reading it would cut the graph (a read of an older value, such as
    # generate()'s stop flag of the step before, would end every graph there). It is read at the
    # first sync after its graph ran; ``synchronize`` runs it first, so it leaves none.
    items = [it for it in _pending if isinstance(it[0], jax.Array) or not it[0].pending]
    if len(items) == len(_pending):
        _pending.clear()
    else:
        _pending[:] = [it for it in _pending if not (isinstance(it[0], jax.Array)
                                                     or not it[0].pending)]
    if not items:
        return
    try:
        arrays = [ok if isinstance(ok, jax.Array) else ok.array for ok, *_ in items]
        # one flag (a compiled program's group, most often): no tree walk
        values = [np.asarray(arrays[0])] if len(arrays) == 1 else jax.device_get(arrays)
    except (RuntimeError, ValueError) as e:  # an op whose program failed: its flag too
        oom = _memory.oom_error(e)
        if oom is not None:
            raise oom from e
        raise
    for v, (ok, name, exc, msg) in zip(values, items):
        if not bool(v):
            if isinstance(ok, _Group):  # the program's first failed check, by its own name
                name, exc, msg = ok.first_failed() or (name, exc, msg)
            raise exc(f"{msg} (in {name} on device tpu; tpu ops run asynchronously, so this is "
                      f"reported at a later call: run with TORCH_TPU_LAUNCH_BLOCKING=1 to stop "
                      f"at the op)")


def check_now(ok, name: str, exc: type, message: str) -> None:
    """A check whose flag is concrete already (Debug mode, un-jitted ops): raise at once."""
    if not bool(ok):
        raise exc(f"{message} (in {name} on device tpu)")


_sync.on_synchronized(raise_pending)
