"""Work still running whose results nobody holds any more.

PJRT keeps computing a program after every array it returns has been dropped, but
``jax.live_arrays()`` no longer lists those arrays: a ``torch.tpu.synchronize()`` or an
``Event`` built only from live arrays would return while the device is still busy, and a loop
like ``for _ in range(n): model(x)`` followed by a synchronize would be timed at its dispatch
cost. CUDA's synchronize waits for every queued kernel; so does ours.

When a tpu storage lets go of an array that is not ready (the storage is freed, or its array
is replaced), ``drop`` hands it to one waiter thread that blocks on it and then releases it:
the memory goes back when the program finishes, as it would have without us (PJRT cannot free
an array's memory before the program writing it is done). ``wait`` blocks until every such
array is done (while held they are live arrays, so ``Event.record`` sees them); ``holds`` lets
memory accounting and ``synchronize``'s error check leave them out (PyTorch counts a freed block as freed). A program that fails (runs out of
memory) with only dropped results is not reported: nothing can read what it would have made,
and the same failure reaches whoever reads a result that depends on it.
"""
from __future__ import annotations

import collections
import os
import threading

from .metrics import COUNTERS

_cv = threading.Condition(threading.RLock())  # RLock: a drop can run inside a gc under it
_queue: collections.deque = collections.deque()
_ids: set = set()
# arrays whose program failed: released on the thread that synchronizes, never on the waiter
# (freeing a failed XLA:CPU array on the waiter thread after an out-of-memory crashed the
# process in a later allocation of CPython's frame stack: tests/test_out_of_memory.py)
_failed: list = []
_thread: list = [None]


def drop(arr) -> None:
    """``arr`` is no longer held by any storage; wait for it in the background if it is still
    being computed. Cheap when it is ready (one ``is_ready`` call)."""
    try:
        if arr.is_ready():
            return
    except Exception:  # not a jax.Array (a placeholder), deleted or donated: nothing to wait on
        return
    COUNTERS["inflight_dropped_arrays"] += 1
    with _cv:
        if _thread[0] is None and not _start_waiter():
            inline = True  # no thread can start (address space exhausted): wait right here
        else:
            inline = False
            _queue.append(arr)
            _ids.add(id(arr))
            if len(_queue) == 1:  # the waiter sleeps only on an empty queue
                _cv.notify_all()
    if inline:
        try:
            arr.block_until_ready()
        except Exception:
            pass


def _start_waiter() -> bool:
    t = threading.Thread(target=_waiter, daemon=True, name="torchtpu-inflight")
    try:
        t.start()
    except RuntimeError:
        return False
    _thread[0] = t
    return True


def _after_fork_in_child() -> None:  # the waiter thread does not exist in a forked child
    global _cv
    _cv = threading.Condition(threading.RLock())
    _queue.clear()
    _ids.clear()
    _failed.clear()
    _thread[0] = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _waiter() -> None:
    while True:
        with _cv:
            while not _queue:
                _cv.wait()
            arr = _queue[0]
        try:
            arr.block_until_ready()
        except Exception:  # failed: see the module docstring; released by ``wait``
            _failed.append(arr)
        with _cv:
            _queue.popleft()
            _ids.discard(id(arr))
            del arr
            if not _queue:
                _cv.notify_all()


def wait() -> None:
    """Block until every dropped array is computed (or failed)."""
    with _cv:
        while _queue:
            _cv.wait()
        _failed.clear()


def holds(arr) -> bool:
    """Whether ``arr`` is only here (freed by PyTorch, still being computed)."""
    return id(arr) in _ids
