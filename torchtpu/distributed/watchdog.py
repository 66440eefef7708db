"""The collective watchdog: enforces a process group's timeout, as NCCL's watchdog does.

XLA:CPU runs a small collective inline in the thread that dispatches it, so a hung peer blocks
that thread inside the transport; only another thread can notice. Every collective is
registered before it is launched; a daemon thread checks the in-flight ones twice a second. A
collective still unfinished after the group's timeout is reported on stderr (group, collective,
sequence number, how long) and the process exits (code ``EXIT_CODE``), so torchrun or
``mp.spawn`` sees the failure instead of a silent hang. A collective that failed is reported on
stderr too (its ``Work.wait`` raises the RuntimeError).

``TORCHTPU_DIST_WATCHDOG=0`` turns the watchdog off.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time

EXIT_CODE = 6  # what the process exits with after a timeout (SIGABRT's number, no core)

_inflight: dict = {}
_lock = threading.Lock()
_ids = itertools.count()
_thread: list = []


def _enabled() -> bool:
    return os.environ.get("TORCHTPU_DIST_WATCHDOG", "1") not in ("", "0")


def start(pg, coll: str, seq: int, timeout) -> int:
    """Register a collective about to launch; returns its token."""
    tok = next(_ids)
    if not _enabled():
        return tok
    secs = timeout.total_seconds() if timeout is not None else 1800.0
    with _lock:
        _inflight[tok] = [pg, coll, seq, time.monotonic(), secs, None]
    if not _thread:
        t = threading.Thread(target=_loop, name="torchtpu-dist-watchdog", daemon=True)
        _thread.append(t)
        t.start()
    return tok


def finish(tok: int, arrays) -> None:
    """The collective was launched: watch its result arrays until they are computed."""
    with _lock:
        e = _inflight.get(tok)
        if e is not None:
            if arrays:
                e[5] = list(arrays)
            else:
                del _inflight[tok]


def _report(msg: str) -> None:
    try:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass


def _loop() -> None:
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        with _lock:
            items = list(_inflight.items())
        for tok, (pg, coll, seq, t0, secs, arrays) in items:
            if arrays is not None and all(a.is_ready() for a in arrays):
                err = None
                for a in arrays:
                    try:
                        a.block_until_ready()
                    except Exception as ex:  # noqa: BLE001
                        err = ex
                        break
                with _lock:
                    _inflight.pop(tok, None)
                if err is not None:
                    _report(f"{pg._where(coll, seq)} failed: {str(err).splitlines()[0]}")
                continue
            if now - t0 > secs:
                _report(f"{pg._where(coll, seq)} timed out: not finished after "
                        f"{now - t0:.1f} s (timeout {secs:.1f} s). Watchdog: the process "
                        f"exits with code {EXIT_CODE}.")
                os._exit(EXIT_CODE)
