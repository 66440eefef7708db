"""``torch.tpu.synchronize()`` and events wait for work whose results were dropped before it
finished (runtime/inflight.py), as CUDA's do for every queued kernel.

Deterministic: the work is a program whose host callback blocks until the test releases it,
so "still running" is a fact, not a timing.
"""
from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu.runtime import buffer, inflight, memory


def _gated(n: int):
    """(a tpu tensor of n float32 ones whose program blocks in a host callback until the
    returned gate is set, the gate). The program's input is a matmul still being computed when
    it is dispatched, so XLA:CPU queues it instead of running it on the calling thread."""
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


def _in_thread(fn):
    done = threading.Event()
    err = []

    def run():
        try:
            fn()
        except BaseException as e:  # pragma: no cover - reported below
            err.append(e)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, err

def test_synchronize_waits_for_dropped_results():
    t, gate = _gated(1 << 10)
    del t  # the only holder: the array is freed while its program still runs
    done, err = _in_thread(torch.tpu.synchronize)
    time.sleep(0.5)
    assert not done.is_set(), "synchronize returned while dropped work was still running"
    gate.set()
    assert done.wait(30) and not err, err

def test_overwritten_value_is_waited_for_too():
    t, gate = _gated(1 << 10)
    t.copy_(torch.zeros(1 << 10))  # from the host: replaces the running program's array
    done, err = _in_thread(torch.tpu.synchronize)
    time.sleep(0.5)
    assert not done.is_set()
    gate.set()
    assert done.wait(30) and not err, err
    assert torch.equal(t.cpu(), torch.zeros(1 << 10))


def test_gated_work_really_runs_after_the_drop():
    """The premise of the tests above: without a holder, nothing but inflight.py waits."""
    t, gate = _gated(1 << 10)
    del t
    assert len(inflight._queue) == 1
    gate.set()
    inflight.wait()
    assert not inflight._queue

def test_event_records_dropped_work_and_memory_counts_it_freed():
    torch.tpu.synchronize()
    base = memory.memory_allocated(0)
    t, gate = _gated(16 << 20)  # 64 MiB
    assert memory.memory_allocated(0) - base >= 64 << 20
    del t
    # PyTorch counts a freed block as freed at once, whatever still runs
    assert memory.memory_allocated(0) - base < 1 << 20
    ev = torch.tpu.Event()
    ev.record()
    time.sleep(0.2)
    assert not ev.query()
    gate.set()
    ev.synchronize()
    assert ev.query()
    torch.tpu.synchronize()
    assert not inflight._queue

def test_ready_arrays_are_not_queued():
    x = torch.ones(8, device="tpu") * 2
    torch.tpu.synchronize()
    n = torch.tpu.metrics()["counters"].get("inflight_dropped_arrays", 0)
    del x
    assert torch.tpu.metrics()["counters"].get("inflight_dropped_arrays", 0) == n
