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
  is ready; the others are *deferred*: each is warmed later, once the scheduler has been fully
  idle (no running or waiting request) for ``IDLE_AFTER_S`` (2 s), one at a time, on a worker
  thread (``warm_if_idle``, from the scheduler's idle hook ``Scheduler.on_idle``), so a request
  never waits for a bucket's trace: the scheduler keeps receiving and serving while the
  worker traces (they share the interpreter: a step then runs slower, not later). The worker
  runs nothing on the device: a deferred bucket is warmed as a *dry run*
  (``torchtpu.compile.backend.dry_run``: Dynamo's trace and cache entry, the program built or
  loaded from the compile cache, no program run), so it neither races the scheduler's steps
  for the KV pages nor runs a tensor-parallel collective on one rank alone. SGLang's forward
  context is one process-wide global (``sglang.srt.model_executor.forward_context``): the
  worker never sets it; before a worker starts, the scheduler's thread publishes a context
  of the runner's attention backend (what ``ModelRunner._forward_raw`` would build itself;
  deferred buckets exist only where one model runner serves: no speculative decoding,
  graph_runner.inactive_reason), which the worker's trace reads and each step's own context
  replaces while it runs; the scheduler's thread takes it back once the worker is done. A step that meets a deferred bucket first traces it then
  (its program loads from the compile cache: no XLA compile).
  ``TORCHTPU_SGLANG_WARM_ALL=1`` warms every bucket at start-up as before.

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
import threading
import time
from collections import deque

from torchtpu.eager import deferred

logger = logging.getLogger(__name__)

# deferred warm-ups of this process: (name, callable), run one at a time on the worker thread
_PENDING: deque = deque()
_STATS = {"idle_warmed": 0, "idle_warm_s": 0.0}
# the worker thread now warming (or None), the warm-ups finished since ``take_finished``, and
# the forward context published for the worker's traces (``set_context``)
_WORKER = {"thread": None, "finished": 0, "context": None, "published": None}

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
    """Warm ``fn`` later, on the worker thread while the scheduler idles (``warm_if_idle``).
    ``fn`` runs beside the scheduler's steps: it may trace and build programs (``dry_run``),
    never run one, and it must not set SGLang's forward context (``set_context``)."""
    _PENDING.append((name, fn))


def set_context(make) -> None:
    """``make()``: the forward context the worker's traces read (the runner's attention
    backend); published by the scheduler's thread before the first worker starts."""
    _WORKER["context"] = make


def pending() -> list[str]:
    """The deferred warm-ups not finished yet (the one on the worker included)."""
    return [n for n, _ in _PENDING]


def _grad_mode():
    # the grad mode SGLang's scheduler runs steps in (Dynamo guards on it; thread-local)
    from sglang.srt.utils.common import DynamicGradMode

    return DynamicGradMode()


def run_one() -> bool:
    """Warm the next deferred bucket (in SGLang's grad mode); False when none is left. Runs on
    the worker thread (``warm_if_idle``); the bucket leaves ``pending`` when it is done."""
    if not _PENDING:
        return False
    name, fn = _PENDING[0]
    t0 = time.perf_counter()
    try:
        with _grad_mode():
            fn()
    except Exception:  # a step meeting this bucket raises it where a request can see it
        logger.exception("torchtpu: warming the deferred bucket %s failed", name)
    finally:
        _PENDING.popleft()
    _STATS["idle_warmed"] += 1
    _STATS["idle_warm_s"] += time.perf_counter() - t0
    if not _PENDING:
        logger.info("torchtpu: deferred buckets warmed while idle (%d in %.1f s)",
                    _STATS["idle_warmed"], _STATS["idle_warm_s"])
    return True


# A deferred bucket is warmed only once the scheduler has been fully idle this long: a client
# sending its next requests right after the last ones finished (a benchmark's rounds, a chat's
# turns) finds the interpreter free, not shared with a bucket's trace (the worker's trace
# slows the scheduler's steps while both run). ``TORCHTPU_SGLANG_IDLE_WARM_AFTER_S``.
IDLE_AFTER_S = float(os.environ.get("TORCHTPU_SGLANG_IDLE_WARM_AFTER_S", "2"))
# ``on_idle`` is polled repeatedly while idle: a longer gap between two polls means the
# scheduler ran a step (or was not idle) in between, and the idle time starts again
_GAP_S = 0.5
_IDLE = {"since": None, "last": 0.0}


def warming(name: str | None = None) -> bool:
    """Whether the worker thread is warming now (``name``: that deferred warm-up)."""
    t = _WORKER["thread"]
    if t is None or not t.is_alive():
        return False
    return name is None or bool(_PENDING) and _PENDING[0][0] == name


def join(timeout: float | None = None) -> bool:
    """Wait for the worker's warm-up (tests, shut-down); whether none is running now."""
    t = _WORKER["thread"]
    if t is not None:
        t.join(timeout)
    return not warming()


def take_finished() -> int:
    """Warm-ups finished since the last call (their counters are no step's: metrics_file)."""
    n, _WORKER["finished"] = _WORKER["finished"], 0
    return n


def _work() -> None:
    try:
        # buckets first; then the eager programs of ops served on the host (eager/deferred.py)
        if not run_one():
            deferred.build_held(1)
    finally:
        _WORKER["finished"] += 1


def _publish_context() -> None:
    """A forward context for the worker's traces while it runs, where none is active (on the
    scheduler's thread, between its steps: each step's own context replaces it while it
    runs and restores it after); taken back by ``_unpublish`` once the worker is done."""
    make = _WORKER["context"]
    if make is None:
        return
    from sglang.srt.model_executor import forward_context as fc

    if not fc.has_forward_context():
        ctx = _WORKER["published"] = make()
        fc.set_forward_context(ctx)


def _unpublish() -> None:
    """On the scheduler's thread between steps, the worker done: no forward context left
    active (a later step builds its own from the runner's attention backend of then)."""
    ctx = _WORKER.get("published")
    if ctx is None:
        return
    from sglang.srt.model_executor import forward_context as fc

    if fc._current is ctx:
        fc.set_forward_context(None)
    _WORKER["published"] = None


def warm_if_idle(scheduler, now=None) -> bool:
    """Start one deferred warm-up on the worker thread, only once no request has run or waited
    for ``IDLE_AFTER_S`` and none is running; whether one was started. Never waits: a request
    arriving while the worker traces is received and served by the scheduler meanwhile."""
    if not warming():
        _unpublish()
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
    if now - _IDLE["since"] < IDLE_AFTER_S or warming():
        return False
    if _PENDING:
        _publish_context()
    t = threading.Thread(target=_work, name="torchtpu-sglang-warm-up", daemon=True)
    _WORKER["thread"] = t
    t.start()
    return True
