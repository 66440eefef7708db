"""Start-up of the compiled buckets: the working set first, the rest while the server idles.

Every decode and prefill bucket is a ``torch.compile(backend="tpu")`` program. A start that
finds them in the compile cache (``TORCHTPU_CACHE_DIR``) compiles nothing, but Dynamo still
traces each bucket's forward again (~1-3 s each: SGLang's model code, the attention metadata,
the guards), which made a warm server start 57 s for 5 decode + 14 prefill buckets.

So the start-up warms only what it must:

- no record for this plan of buckets (the first start, another model, other bucket sizes,
  other torchtpu source): every bucket, as before (their programs compile into the cache);
  then an empty record is written: ``<cache dir>/sglang-working-set/<hash>.json``, the hash
  over the kind of runner, the plan of buckets, the model, the rank and torchtpu's source
  fingerprint (the one the compile cache's entries are keyed with);
- with a record: the buckets the last run served (the record's ``used``), before the server
  is ready; the others are *deferred*: each is warmed later, one per call of the scheduler's
  idle hook (``Scheduler.on_idle``) once it has been fully idle (no running or waiting request)
  for ``IDLE_AFTER_S`` (2 s), so a request that arrives meanwhile waits for at most one
  bucket's trace; a step that meets
  a deferred bucket first traces it then (its program loads from the compile cache: no XLA
  compile). ``TORCHTPU_SGLANG_WARM_ALL=1`` warms every bucket at start-up as before.

A process records each bucket it serves (the file is rewritten when a bucket is served for
the first time in the process, so ``used`` is the last run's working set), the planned ones and
those outside the plan that steps met (decode buckets at a wider KV width, extend steps with
more requests or a longer cached prefix): a start with a record warms those too (``extra``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque

from torchtpu.eager import deferred

logger = logging.getLogger(__name__)

# deferred warm-ups of this process: (name, callable), run one per idle hook call
_PENDING: deque = deque()
_STATS = {"idle_warmed": 0, "idle_warm_s": 0.0}


def _folder() -> str | None:
    from torchtpu.runtime.disk_cache import cache_dir

    d = cache_dir()
    return None if d is None else os.path.join(d, "sglang-working-set")


class WorkingSet:
    """The record of one runner's plan of buckets (keys: strings)."""

    def __init__(self, kind: str, model_runner, plan: list[str]):
        from sglang.srt.runtime_context import get_parallel

        from torchtpu.runtime.program_cache import source_fingerprint

        sa, p = model_runner.server_args, get_parallel()
        ident = [kind, sorted(plan), str(sa.model_path), str(sa.dtype),
                 str(getattr(sa, "revision", None)), p.tp_rank, p.tp_size, p.pp_rank,
                 source_fingerprint()]
        h = hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:24]
        folder = _folder()
        self.path = None if folder is None else os.path.join(folder, f"{kind}-{h}.json")
        self.plan = list(plan)
        self.recorded = self._read()  # the last run's used keys, or None: no record
        self.used: set = set()

    def _read(self):
        if self.path is None or os.environ.get("TORCHTPU_SGLANG_WARM_ALL", "0") == "1":
            return None
        try:
            with open(self.path) as f:
                return set(json.load(f)["used"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def split(self) -> tuple[list[str], list[str]]:
        """(warm at start-up, deferred): all at start-up without a record."""
        if self.recorded is None:
            return list(self.plan), []
        now = [k for k in self.plan if k in self.recorded]
        return now, [k for k in self.plan if k not in self.recorded]

    def extra(self) -> list[str]:
        """The last run's buckets outside the plan (a decode bucket at a wider KV width, an
        extend step with more requests or a longer prefix): warmed at start-up too, so the
        first requests after a warm start trace nothing the last run met."""
        if self.recorded is None:
            return []
        return sorted(k for k in self.recorded if k not in self.plan)

    def started(self) -> None:
        """After the start-up warm-up: every planned program is in the compile cache now
        (warmed now or by the run that wrote the record)."""
        if self.recorded is None:
            self._write()

    def served(self, key: str) -> None:
        """A step ran through bucket ``key`` (cheap after its first time)."""
        if key in self.used:
            return
        self.used.add(key)
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"used": sorted(self.used)}, f)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache folder: every start warms all buckets
            logger.warning("torchtpu: cannot write the SGLang working set %s: %s", self.path, e)
            self.path = None


def defer(name: str, fn) -> None:
    """Warm ``fn`` later, when the scheduler is idle (``run_one``)."""
    _PENDING.append((name, fn))


def pending() -> list[str]:
    return [n for n, _ in _PENDING]


def run_one() -> bool:
    """Warm the next deferred bucket (in SGLang's grad mode); False when none is left."""
    if not _PENDING:
        return False
    from sglang.srt.utils.common import DynamicGradMode

    name, fn = _PENDING.popleft()
    t0 = time.perf_counter()
    try:
        with DynamicGradMode():
            fn()
    except Exception:  # a step meeting this bucket raises it where a request can see it
        logger.exception("torchtpu: warming the deferred bucket %s failed", name)
    _STATS["idle_warmed"] += 1
    _STATS["idle_warm_s"] += time.perf_counter() - t0
    if not _PENDING:
        logger.info("torchtpu: deferred buckets warmed while idle (%d in %.1f s)",
                    _STATS["idle_warmed"], _STATS["idle_warm_s"])
    return True


# A deferred bucket is warmed only once the scheduler has been fully idle this long: a client
# sending its next requests right after the last ones finished (a benchmark's rounds, a chat's
# turns) does not find the scheduler inside a bucket's trace (measured: warm-start TTFTs of
# ~7 s on a loaded host when every idle poll started one). ``TORCHTPU_SGLANG_IDLE_WARM_AFTER_S``.
IDLE_AFTER_S = float(os.environ.get("TORCHTPU_SGLANG_IDLE_WARM_AFTER_S", "2"))
# ``on_idle`` is polled repeatedly while idle: a longer gap between two polls means the
# scheduler ran a step (or was not idle) in between, and the idle time starts again
_GAP_S = 0.5
_IDLE = {"since": None, "last": 0.0}


def warm_if_idle(scheduler, now=None) -> bool:
    """One deferred bucket, only once no request has run or waited for ``IDLE_AFTER_S`` (a
    request arriving during it waits for this one bucket at most); whether one was warmed."""
    if not _PENDING and not deferred.held():
        return False
    now = time.monotonic() if now is None else now
    if not scheduler.is_fully_idle():
        _IDLE["since"] = None
        _IDLE["last"] = now
        return False
    if _IDLE["since"] is None or now - _IDLE["last"] > _GAP_S:
        _IDLE["since"] = now
    _IDLE["last"] = now
    if now - _IDLE["since"] < IDLE_AFTER_S:
        return False
    # buckets first; then the eager programs of ops served on the host (eager/deferred.py)
    ok = run_one() if _PENDING else deferred.build_held(1) > 0
    _IDLE["last"] = time.monotonic() if ok else now  # the warm-up is not a gap in the polls
    return ok
