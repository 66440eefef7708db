"""Known gap: ``torch.tpu.synchronize()`` and ``Event`` wait only for work whose results are
still held. A program whose every output was freed before it finished keeps running in PJRT,
but ``jax.live_arrays()`` (what runtime/sync.py blocks on) no longer lists it, so a loop like
``for _ in range(n): y = x @ x`` timed with a synchronize at the end measures dispatch, not
work (CUDA's synchronize waits for every queued kernel). Strict xfails: they pass, and fail the
suite, once synchronize waits for such work.

Deterministic: the work is a program whose host callback blocks until the test releases it
(its input is a matmul still being computed when it is dispatched, so XLA:CPU queues it rather
than running it on the calling thread).
"""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu.runtime import buffer

_GAP = ("synchronize/Event wait only for live arrays: work whose results were all freed is "
        "not waited for (a fix that held such arrays crashed tests/test_out_of_memory.py's "
        "recovery after out-of-memory; see docs/ARCHITECTURE.md, runtime)")


def _gated(n: int):
    """(a tpu tensor of n float32 ones whose program blocks until the gate is set, gate)."""
    gate = threading.Event()

    def host(x):
        gate.wait(20)
        return np.ones((n,), np.float32)

    f = jax.jit(lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct((n,), jnp.float32),
                                            x[:1, 0]))
    mm = jax.jit(lambda a: a @ a)
    a = jnp.ones((1024, 1024), jnp.float32)
    gate.set()
    f(mm(a)).block_until_ready()  # compiled: the next call only dispatches
    gate.clear()
    out = f(mm(a))
    assert not out.is_ready()
    return buffer.wrap(out), gate


def _returns_before_release(fn) -> bool:
    t, gate = _gated(1 << 10)
    try:
        del t  # the only holder: freed while its program still runs
        done = threading.Event()
        threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
        time.sleep(0.5)
        return done.is_set()
    finally:
        gate.set()
        torch.tpu.synchronize()


def test_the_gated_program_really_runs_after_its_tensor_is_freed():
    """The premise of the xfails below (not itself a gap)."""
    t, gate = _gated(1 << 10)
    arr = buffer.buffer_of(t).array
    del t
    time.sleep(0.3)
    assert not arr.is_ready()
    gate.set()
    arr.block_until_ready()


def test_synchronize_waits_for_work_whose_results_were_freed():
    assert not _returns_before_release(torch.tpu.synchronize)


def test_event_waits_for_work_whose_results_were_freed():
    def record_and_wait():
        ev = torch.tpu.Event()
        ev.record()
        ev.synchronize()

    assert not _returns_before_release(record_and_wait)
