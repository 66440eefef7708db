"""Work still being computed, whoever holds its results.

PJRT keeps computing a program after every array it returns has been dropped, and
``jax.live_arrays()`` no longer lists those arrays: a ``torch.tpu.synchronize()`` or an
``Event`` built only from live arrays would return while the device is still busy, and a loop
like ``for _ in range(n): y = model(x)`` followed by a synchronize would be timed at its
dispatch cost. CUDA's synchronize waits for every queued kernel; so does ours.

Every array a program returns (``program_cache.Program``, ``buffer.wrap``) is ``note``d here as
it is made. One that is already computed (small programs run on the calling thread) costs one
``is_ready`` call and is not kept. One still being computed is kept in a FIFO as a second
handle on the same device buffer (a distinct Python object that no tensor holds, so the
reference counts that decide donation (eager/executor.py, copy.py, fused.py, compile/backend.py)
do not see it, and a donation deletes it along with the array), until a later ``note``,
``pending`` or ``clear`` finds it done. Nothing runs when an array is freed (no ``__del__``, no
thread). Keeping an unfinished buffer costs no memory PJRT would not hold anyway (it cannot free
an output before the program writing it finishes); a finished one is let go of at the next op
that finds it at the FIFO's head (the whole FIFO is scanned when it grows long, after a
synchronize, an Event's completion and before memory is counted). ``pending`` gives what
``synchronize``/``Event.record`` wait for; ``holds`` tells memory accounting which live arrays
are these handles. Arrays whose program failed are ready (their error reaches whoever reads
them), so they leave at once.

Counted: ``inflight_max`` (the most unfinished arrays kept at a full scan).
"""
from __future__ import annotations

import atexit
import collections
from weakref import ref as _weakref

from jax._src.array import ArrayImpl as _Array

from .metrics import COUNTERS

_SEQ = (list, tuple)
_held: collections.deque = collections.deque()  # second handles on unfinished buffers
_ids: set = set()  # their ids
_last = [lambda: None]  # a weak reference to the last unfinished array kept
# let go before JAX tears its clients down (atexit runs the last registered first)
atexit.register(_held.clear)
# The FIFO is scanned whole (not only its head) once it holds this many, then again each time it
# has doubled: programs can finish out of order (XLA:CPU runs independent ones concurrently), and
# a long one at the head must not keep many finished buffers behind it alive. A scan costs one
# is_ready call per entry (~0.25 us), so about that much per op while work queues up.
_SCAN_AT = 8
_scan_at = [_SCAN_AT]


def note(out) -> None:
    """``out`` (a jax array, or a list/tuple whose first element is one) was just made."""
    if type(out) is not _Array:
        if type(out) not in _SEQ or not out:  # a tracer, or no outputs
            return
        out = out[0]  # a program's outputs finish together
    try:
        if out.is_ready():
            return
    except Exception:  # noqa: BLE001 - deleted/donated, a tracer: nothing to wait on
        return
    try:
        if _last[0]() is out:  # a Program's output, then wrapped: kept once
            return
        _last[0] = _weakref(out)  # weak: a reference would count against donating it
        h = _handle(out)
        _ids.add(id(h))
        _held.append(h)
    except Exception:  # noqa: BLE001 - deleted/donated, a tracer: nothing to wait on
        return
    _let_go_of_finished_head()
    if len(_held) >= _scan_at[0]:
        _scan()


def _handle(out):
    """A new array object on ``out``'s buffers (all of this process's shards). Not
    ``addressable_data``: jax caches that object on ``out`` (it would outlive the handle and be
    counted as memory), and for a sharded array returns the shard objects tensors hold."""
    try:
        return out._rewrap_with_aval_and_sharding(out.aval, out.sharding)  # ~1.7 us
    except AttributeError:  # a jax without it
        return _Array(out.aval, out.sharding, list(out._arrays), committed=out.committed,
                      _skip_checks=True)


def _done(arr) -> bool:
    try:
        return arr.is_ready()
    except Exception:  # noqa: BLE001 - deleted or donated: nothing to wait on
        return True


def _drop_head() -> None:
    _ids.discard(id(_held.popleft()))


def _let_go_of_finished_head() -> None:
    held = _held
    try:
        while held and _done(held[0]):
            _drop_head()
    except IndexError:  # another thread emptied it meanwhile
        pass


def _scan() -> None:
    """Let go of every finished array, not only those at the head. One pass around the FIFO
    (another thread's ``note`` meanwhile lands behind it and is kept)."""
    held = _held
    for _ in range(len(held)):
        try:
            a = held.popleft()
        except IndexError:
            break
        if _done(a):
            _ids.discard(id(a))
        else:
            held.append(a)
    n = len(held)
    if n > COUNTERS.get("inflight_max", 0):
        COUNTERS["inflight_max"] = n
    # the next full scan when the FIFO has grown by as much again
    _scan_at[0] = max(_SCAN_AT, 2 * n)


def holds(arr) -> bool:
    """Whether ``arr`` is one of the handles kept here (not an array of anyone's)."""
    return id(arr) in _ids


def pending(dev=None) -> list:
    """The held arrays still being computed (on jax device ``dev`` when given)."""
    _let_go_of_finished_head()
    out = []
    for a in list(_held):
        if _done(a):
            continue
        if dev is not None:
            try:
                if dev not in a.devices():
                    continue
            except Exception:  # noqa: BLE001
                continue
        out.append(a)
    return out


def clear() -> None:
    """Let go of everything finished (after a synchronize; before memory is counted)."""
    _scan()
