"""Compiling a growing program's next shape ahead of time, on background threads.

An eager op on a growing tensor misses its program cache at every call: generate() with a
dynamic KV cache grows the cache, the position ids and the token ids by one each token (~12
programs per token), minGPT-style sampling without a cache grows every activation of the
forward; each program is traced, lowered and compiled on the critical path. When a Program's
misses form a progression (``predict``: three signatures whose growing dimensions all grew by
the same step d, twice), its next call very likely has them grown by d again
(``next_signature``): that program is looked up in the disk cache or compiled now, on a worker
thread, while the model runs. XLA releases the GIL while it compiles, so the host's other core
works in the meantime; the call that needs the program then finds it done, waits for it, or,
when no worker has started it yet, builds it itself.

The results cannot change: the program built ahead is the one the call would build (same
function, signature, XLA options and disk key; traced under the submitting thread's matmul
precision). A guess not used within ``HISTORY`` misses of its Program is dropped and counted
(``<kind>_prefetch_wasted``; the last guess of every growing run, e.g. each generate() call, is
one); a Program whose unused guesses exceed its used ones by ``MAX_WASTED`` stops guessing for
``PAUSE`` misses (then its record is cleared: a new growing workload may follow).
Counted per kind: ``<kind>_prefetches`` (submitted), ``<kind>_prefetch_hits``,
``<kind>_prefetch_wait_ms`` (time calls waited for a worker). ``TORCHTPU_PREFETCH_THREADS``:
worker threads (default: the CPU count, at most 2; 0 turns prediction off); they run at a lower
priority (``TORCHTPU_PREFETCH_NICE``, default 10). At interpreter exit, jobs not started are
dropped; a forked child starts with an empty pool.
"""
from __future__ import annotations

import atexit
import collections
import os
import threading

from jax.core import ShapedArray

THREADS = int(os.environ.get("TORCHTPU_PREFETCH_THREADS", str(min(2, os.cpu_count() or 1))))
NICE = int(os.environ.get("TORCHTPU_PREFETCH_NICE", "10"))  # the workers' scheduling priority
MAX_WASTED = 2  # a Program stops predicting when its unused guesses exceed its used ones by this
HISTORY = 16  # misses a Program remembers; a guess not used within as many misses is dropped
WORKER_NAME = "torchtpu-prefetch"  # the workers' thread name
PAUSE = 64  # misses a Program that stopped guessing waits before it guesses again


def next_signature(prev: tuple, cur: tuple):
    """The signature after ``cur`` if ``prev`` -> ``cur`` grew some dimensions by one step d
    (all others equal), else None."""
    if len(prev) != len(cur):
        return None
    step = 0
    out = []
    for a, b in zip(prev, cur):
        if a == b:
            out.append(b)
            continue
        if (type(a) is not ShapedArray or type(b) is not ShapedArray or a.dtype != b.dtype
                or a.weak_type != b.weak_type or len(a.shape) != len(b.shape)):
            return None
        shape = []
        for x, y in zip(a.shape, b.shape):
            d = y - x
            if d:
                if d < 0 or (step and d != step):
                    return None
                step = d
                y += d
            shape.append(y)
        nxt = b.update(shape=tuple(shape))
        if nxt == b:  # a difference outside the shape: not a growing dimension
            return None
        out.append(nxt)
    return tuple(out) if step else None


def predict(history: list, sig: tuple):
    """The next signature when ``sig`` continues an arithmetic progression of three misses in
    ``history`` (the same dimensions grown by the same step twice), else None. Several call
    sites may share a Program (one matmul program for every projection of a model), so the
    progression is looked for among the recent misses, not only the latest."""
    for prev in reversed(history):
        nxt = next_signature(prev, sig)
        if nxt is not None:
            for older in history:
                if older is not prev and next_signature(older, prev) == sig:
                    return nxt
    return None


class Job:
    """One program built ahead: ``result()`` returns what ``fn`` returned (or raises what it
    raised), running it on the calling thread if no worker has started it."""

    __slots__ = ("fn", "args", "state", "value", "error", "done")

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.state = "queued"  # -> "running" -> "done" | "dropped"
        self.value = self.error = None
        self.done = threading.Event()

    def run(self):
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
            self.error = e
        self.fn = self.args = None
        self.state = "done"
        self.done.set()

    def result(self):
        if _pool.claim(self):
            self.run()
        else:
            self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value

    def drop(self) -> None:
        """A queued job never runs; a running one finishes unseen."""
        if _pool.claim(self):
            self.fn = self.args = None
            self.state = "dropped"
            self.done.set()


class _Pool:
    def __init__(self):
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.queue: collections.deque = collections.deque()
        self.threads: list = []
        self.running = 0
        self.closed = False

    def submit(self, fn, *args) -> Job | None:
        return self.add(Job(fn, args))

    def add(self, job: Job) -> Job | None:
        with self.lock:
            if self.closed:
                return None
            self.queue.append(job)
            if len(self.threads) < THREADS:
                t = threading.Thread(target=self._work, name=WORKER_NAME, daemon=True)
                self.threads.append(t)
                t.start()
            self.ready.notify()
        return job

    def claim(self, job: Job) -> bool:
        """Take a job not started yet off the queue (the caller runs or drops it)."""
        with self.lock:
            if job.state != "queued":
                return False
            job.state = "running"
            try:
                self.queue.remove(job)
            except ValueError:
                pass
            return True

    def _work(self):
        try:  # guesses yield the CPU to the threads doing work that is certainly needed
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self.lock:
                while not self.queue and not self.closed:
                    self.ready.wait()
                if self.closed:
                    return
                job = self.queue.popleft()
                job.state = "running"
                self.running += 1
            try:
                job.run()
            finally:
                with self.lock:
                    self.running -= 1
                    self.ready.notify_all()

    def _drop_queued(self) -> None:
        for job in self.queue:
            job.fn = job.args = None
            job.state = "dropped"
            job.done.set()
        self.queue.clear()

    def drain(self) -> None:
        """Drop the jobs not started and wait for the running ones."""
        with self.lock:
            self._drop_queued()
            while self.running:
                self.ready.wait()

    def close(self):
        with self.lock:
            self.closed = True
            self._drop_queued()
            self.ready.notify_all()
            threads = list(self.threads)
        for t in threads:
            t.join(timeout=5)


_pool = _Pool()
atexit.register(lambda: _pool.close())


def _after_fork_in_child() -> None:
    # a forked child has none of the parent's threads, and maybe a lock one of them held
    global _pool
    _pool = _Pool()


os.register_at_fork(after_in_child=_after_fork_in_child)


def drain() -> None:
    """Drop the guesses not started and wait for those being built (their counters settle):
    for measurements and tests that read counters."""
    _pool.drain()


def submit(fn, *args) -> Job | None:
    """Run ``fn(*args)`` on a worker thread; None when prediction is off or shutting down."""
    if THREADS <= 0:
        return None
    return _pool.submit(fn, *args)


_held: collections.deque = collections.deque()  # builds kept for run_held
_running_held = threading.local()


def hold(fn, *args) -> Job:
    """A build kept until ``run_held`` runs it on the calling thread (a server builds while it
    is idle: a worker compiling beside its requests takes their cores and the GIL), or until
    ``release`` hands it to a worker."""
    job = Job(fn, args)
    _held.append(job)
    return job


def held() -> int:
    return len(_held)


def release(job: Job) -> None:
    """A held build wanted again: queued for a worker now (no-op if not held)."""
    try:
        _held.remove(job)
    except ValueError:
        return
    if THREADS <= 0 or _pool.add(job) is None:
        _held.appendleft(job)


def run_held(n: int = 1) -> int:
    """Run up to ``n`` held builds here (skipping those dropped or taken); how many ran."""
    ran = 0
    while _held and ran < n:
        job = _held.popleft()
        if _pool.claim(job):
            _running_held.on = True
            try:
                job.run()
            finally:
                _running_held.on = False
            ran += 1
    return ran


def off_path() -> bool:
    """Whether this thread builds off a caller's path: a worker, or ``run_held``."""
    return (threading.current_thread().name == WORKER_NAME
            or getattr(_running_held, "on", False))

