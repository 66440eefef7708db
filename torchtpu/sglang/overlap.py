"""SGLang's overlap scheduler on "tpu": the step's result read back off the scheduler thread.

With overlap scheduling (SGLang's default) the scheduler launches step ``N``'s forward, then
copies its sampled tokens to the host "asynchronously" (``GenerationBatchResult.copy_to_cpu``:
a pinned host tensor filled by a non-blocking copy on a copy stream, waited for through a
``copy_done`` event only when step ``N``'s results are processed, after step ``N + 1`` is
launched). On "tpu" a copy to the host is a host sync (there is no pinned memory to fill
later), so the scheduler thread waited for step ``N``'s program right after launching it, and
its bookkeeping of step ``N - 1`` (and the building of step ``N + 1``) ran after that program
instead of beside it: a decode step cost the program *plus* the host work.

SGLang offloads that copy to a thread where its copies block at issue (NVIDIA Confidential
Computing: ``Scheduler.enable_async_d2h_copy`` with an ``AsyncD2HCopyWorker``, whose
``submit(copy_fn)`` returns the ``copy_done`` that ``process_batch_result`` waits on).
``enable`` (after SGLang's ``Scheduler.init_overlap``, wherever overlap scheduling is on)
turns that path on with ``CopyThread``: the same interface, SGLang's ``HostCopyDone``, but no
events or stream synchronization around the copy (SGLang's worker synchronizes its copy
stream, on "tpu" a wait for *all* queued work, step ``N + 1``'s program included): reading a
tensor on the host already waits for exactly the program that computes it.

Opt-in (``TORCHTPU_SGLANG_ASYNC_D2H=1``): on the 2-core development host, loaded, a decode
step took longer with it (94 vs 72 ms, 16 requests; the program and the host work compete for
the same cores, so there is nothing to overlap), and as long at load 3-5 (23.0 vs 23.1 ms).
"""
from __future__ import annotations

import logging
import os
import queue
import threading

from ..runtime.metrics import count

logger = logging.getLogger(__name__)


class CopyThread:
    """``AsyncD2HCopyWorker``'s interface: ``submit(copy_fn)`` runs ``copy_fn`` on a daemon
    thread, in submission order; the returned ``HostCopyDone`` is set when it has run (with
    its exception, which ``synchronize()`` raises on the scheduler's thread)."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="torchtpu-d2h-copy",
                                        daemon=True)
        self._thread.start()

    def submit(self, copy_fn):
        from sglang.srt.managers.async_d2h_copy_worker import HostCopyDone

        done = HostCopyDone()
        self._queue.put((copy_fn, done))
        return done

    def _loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            copy_fn, done = item
            error = None
            try:
                copy_fn()
                count("sglang_thread_result_copies")
            except BaseException as e:  # noqa: BLE001 - handed to the waiting scheduler
                logger.exception("torchtpu: reading a step's result on the host failed")
                error = e
            finally:
                done.set_done(error=error)

    def shutdown(self, timeout: float = 2.0):
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)


def enable(result, scheduler, *args, **kwargs):
    """After ``Scheduler.init_overlap``: the step's result copied on ``CopyThread``
    (``TORCHTPU_SGLANG_ASYNC_D2H=1``)."""
    if (os.environ.get("TORCHTPU_SGLANG_ASYNC_D2H", "0") != "1"
            or not getattr(scheduler, "enable_overlap", False)
            or getattr(scheduler, "enable_async_d2h_copy", False)
            or not hasattr(scheduler, "copy_stream")):
        return None
    scheduler.async_d2h_worker = CopyThread()
    scheduler.enable_async_d2h_copy = True
    logger.info("torchtpu: overlap scheduling reads step results on a copy thread")
    return None
