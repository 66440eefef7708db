"""The garbage collector during Dynamo compiles.

Dynamo's tracing allocates hundreds of thousands of objects; those that survive push CPython
into full (oldest-generation) collections, and each full collection walks every object the
process holds: ~470k after importing torch, transformers and JAX, 0.3-0.5 s per pass on this
host, two passes in a warm start's first static-cache generate (0.6-1.1 s of it). While a
compile runs, the objects that existed before it are moved to the permanent generation
(``gc.freeze``) and put back when it ends (``gc.unfreeze``, into the oldest generation): the
passes during the compile walk only what the compile made. Nothing is lost: garbage among the
older objects that a compile's collections skip is collected by a later pass, and nothing is
collected that is still reachable. The freeze spans overlapping compiles (Dynamo runs its
start/end callbacks when the first starts and the last ends), and a process that froze objects
itself (``gc.get_freeze_count()`` > 0 at a compile's start) is left alone: our unfreeze would
release its objects too. ``TORCHTPU_COMPILE_GC_FREEZE=0`` turns this off.
"""
from __future__ import annotations

import gc
import os
import threading

GC_FREEZE = os.environ.get("TORCHTPU_COMPILE_GC_FREEZE", "1") != "0"
_state = {"frozen": False}
_lock = threading.Lock()


def _compile_start(args=None) -> None:
    with _lock:
        if GC_FREEZE and not _state["frozen"] and gc.isenabled() \
                and gc.get_freeze_count() == 0:
            gc.freeze()
            _state["frozen"] = True
            from ..runtime.metrics import count

            count("compile_gc_freezes")


def _compile_end(args=None) -> None:
    with _lock:
        if _state["frozen"]:
            _state["frozen"] = False
            gc.unfreeze()


def install() -> None:
    """Install the callbacks (again: ``torch._dynamo.reset()`` clears Dynamo's callbacks); run
    at every ``torch.compile`` for "tpu" and every graph our backend takes."""
    from torch._dynamo.callback import callback_handler

    if _compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_compile_start)
    if _compile_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_compile_end)
