"""The collective watchdog: enforces a process group's timeout, as NCCL's watchdog does.

XLA:CPU runs a small collective inline in the thread that dispatches it, so a hung peer blocks
that thread inside the transport; only another thread can notice. Every collective is
registered before it is launched; a daemon thread checks the in-flight ones twice a second. A
collective still unfinished after the group's timeout is reported on stderr (group, collective,
sequence number, how long) and the process exits (code ``EXIT_CODE``), so torchrun or
``mp.spawn`` sees the failure instead of a silent hang. A collective that failed is reported on
stderr too (its ``Work.wait`` raises the RuntimeError).

``TORCHTPU_DIST_WATCHDOG=0`` turns the watchdog off.

The thread is stopped and joined at interpreter exit (``atexit``): a daemon thread still inside
a jaxlib call when Python finalizes is killed by unwinding through C++ frames, which aborts the
process ("terminate called after throwing an instance of ''  FATAL: exception not rethrown",
seen on rank 0 after ``destroy_process_group``).
"""
from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time

EXIT_CODE = 6  # what the process exits with after a timeout (SIGABRT's number, no core)

# In-flight collectives, oldest first. They finish in issue order (every program threads the
# order token), so the thread only ever looks at the oldest: registering costs an append.
_inflight: collections.deque = collections.deque()
_thread: list = []
_on = [None]
_stop = threading.Event()


class _Entry:
    __slots__ = ("pg", "coll", "seq", "t0", "secs", "arrays")

    def __init__(self, pg, coll, seq, secs):
        self.pg, self.coll, self.seq, self.secs = pg, coll, seq, secs
        self.t0 = time.monotonic()
        self.arrays = None  # None: still being launched


def _enabled() -> bool:
    if _on[0] is None:
        _on[0] = os.environ.get("TORCHTPU_DIST_WATCHDOG", "1") not in ("", "0")
    return _on[0]


def start(pg, coll: str, seq: int, timeout):
    """Register a collective about to launch; returns its token."""
    if not _enabled():
        return None
    e = _Entry(pg, coll, seq, timeout.total_seconds() if timeout is not None else 1800.0)
    _inflight.append(e)
    if not _thread:
        t = threading.Thread(target=_loop, name="torchtpu-dist-watchdog", daemon=True)
        _thread.append(t)
        t.start()
        atexit.register(_shutdown)
    return e


def _shutdown() -> None:
    _stop.set()
    for t in _thread:
        t.join(timeout=5.0)


def finish(e, arrays) -> None:
    """The collective was launched: watch its result arrays until they are computed."""
    if e is not None:
        e.arrays = list(arrays)


def _report(msg: str) -> None:
    try:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass


def _done(e) -> bool:
    """Whether the oldest entry finished (reporting a failure on stderr)."""
    if e.arrays is None or not all(a.is_ready() for a in e.arrays):
        return False
    for a in e.arrays:
        try:
            a.block_until_ready()
        except Exception as ex:  # noqa: BLE001  (Work.wait raises it, named)
            _report(str(e.pg._failure(e.coll, e.seq, ex)))
            break
    return True


def _loop() -> None:
    while not _stop.wait(0.5):
        while _inflight and not _stop.is_set():
            e = _inflight[0]
            if _done(e):
                _inflight.popleft()
                continue
            waited = time.monotonic() - e.t0
            if waited > e.secs:
                _report(f"{e.pg._where(e.coll, e.seq)} timed out: not finished after "
                        f"{waited:.1f} s (timeout {e.secs:.1f} s). Watchdog: the process "
                        f"exits with code {EXIT_CODE}.")
                os._exit(EXIT_CODE)
            break
