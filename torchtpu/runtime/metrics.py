"""Counters for everything that costs time: compiles, cache hits, host syncs, fallbacks, bytes."""
from __future__ import annotations

import collections
import logging
import os
import threading

_log = logging.getLogger("torchtpu")
if os.environ.get("TORCHTPU_DEBUG_METRICS", "0") not in ("", "0"):
    logging.basicConfig()
    _log.setLevel(logging.DEBUG)
_DEBUG = _log.isEnabledFor(logging.DEBUG)

COUNTERS: collections.Counter = collections.Counter()
PER_OP: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


_lock = threading.Lock()  # programs built ahead count on worker threads (runtime/prefetch.py)


def count(name: str, n: int = 1, op: str | None = None) -> None:
    """Increment counter ``name`` (and its per-op breakdown when ``op`` is given)."""
    with _lock:
        COUNTERS[name] += n
        if op is not None:
            PER_OP[name][op] += n
    if _DEBUG:
        _log.debug("%s += %d%s", name, n, f" ({op})" if op else "")


def metrics() -> dict:
    """A snapshot: {"counters": {...}, "per_op": {counter: {op: n}}}."""
    return {"counters": dict(COUNTERS), "per_op": {k: dict(v) for k, v in PER_OP.items()}}


def reset_metrics() -> None:
    COUNTERS.clear()
    PER_OP.clear()


def short_report() -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(COUNTERS.items()))
