"""torch.tpu's stream and event API against torch.cuda's documented Python semantics
(torch/cuda/streams.py, torch/cuda/__init__.py): ``torch.tpu.stream(s)`` returns a reusable
``StreamContext`` (SGLang keeps one and enters it every batch), a new ``Stream()`` is a stream
of its own, ``set_stream``/``with s:`` select the current stream (and device) per thread,
``torch.Stream``/``torch.Event``/``torch.accelerator`` reach the same objects. All of a
device's work still runs in one data-ordered queue (runtime/sync.py), so results are CPU's
whichever stream is selected."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

tpu = torch.tpu


def test_stream_context_is_reusable_in_a_loop():
    """The issue's reproduction: one stored context, entered every iteration."""
    s = tpu.Stream()
    ctx = tpu.stream(s)
    assert isinstance(ctx, tpu.StreamContext) and ctx.stream is s
    a = torch.arange(8.0)
    x = a.to("tpu")
    for i in range(4):
        with ctx as entered:
            assert entered is None  # as CUDA's StreamContext.__enter__
            assert tpu.current_stream() == s
            x = x * 2 + i
        assert tpu.current_stream() == tpu.default_stream()
    want = a
    for i in range(4):
        want = want * 2 + i
    torch.testing.assert_close(x.cpu(), want)


def test_stream_identity_and_selection():
    d = tpu.default_stream()
    s1, s2 = tpu.Stream(), tpu.Stream(priority=-1)
    assert d == tpu.default_stream(0) == tpu.current_stream() and hash(d) == hash(
        tpu.default_stream("tpu:0"))
    assert s1 != d and s1 != s2 and len({d, s1, s2}) == 3
    assert s1.device == torch.device("tpu", 0) and s1.device_type == d.device_type
    # nested contexts restore the stream that was current, the same context re-entered too
    ctx = tpu.stream(s1)
    with ctx:
        with tpu.stream(s2):
            assert tpu.current_stream() == s2
            with ctx:
                assert tpu.current_stream() == s1
            assert tpu.current_stream() == s2
        assert tpu.current_stream() == s1
    assert tpu.current_stream() == d
    with tpu.stream(None):  # a no-op, as CUDA's
        assert tpu.current_stream() == d
    # torch.Stream's own protocol: ``with s:`` selects s and returns it
    with s1 as entered:
        assert entered is s1 and tpu.current_stream() == s1
        assert torch.accelerator.current_stream() == s1
    assert tpu.current_stream() == d
    tpu.set_stream(s2)
    try:
        assert tpu.current_stream() == s2 and tpu.current_stream(0) == s2
        tpu.set_stream(None)  # a no-op
        assert tpu.current_stream() == s2
    finally:
        tpu.set_stream(d)
    torch.accelerator.set_stream(s1)
    try:
        assert tpu.current_stream() == s1
    finally:
        torch.accelerator.set_stream(d)
    assert tpu.current_stream() == d
    with pytest.raises(ValueError, match="Expected a tpu stream"):
        tpu.set_stream(torch.Stream(device="cpu"))


def test_current_stream_is_per_thread():
    s = tpu.Stream()
    seen = []
    with tpu.stream(s):
        t = threading.Thread(target=lambda: seen.append(tpu.current_stream()))
        t.start()
        t.join()
        assert tpu.current_stream() == s
    assert seen == [tpu.default_stream()]


def test_generic_torch_stream_and_event_give_tpu_objects():
    d = tpu.default_stream()
    g = torch.Stream(device="tpu")
    assert isinstance(g, tpu.Stream) and g != d  # a new stream, as torch.Stream("cuda")
    again = torch.Stream(stream_id=g.stream_id, device_index=0, device_type=g.device_type)
    assert isinstance(again, tpu.Stream) and again == g and hash(again) == hash(g)
    with tpu.stream(again):
        assert tpu.current_stream() == g
    assert type(torch.Stream(device="cpu")) is not tpu.Stream
    e = torch.Event(device="tpu", enable_timing=True)
    assert isinstance(e, tpu.Event)
    assert tpu.is_current_stream_capturing() is False


def test_events_and_waits():
    s = tpu.Stream()
    x = torch.randn(64, 64, device="tpu")
    start, end = tpu.Event(enable_timing=True), tpu.Event(enable_timing=True)
    with tpu.stream(s):
        start.record()
        y = torch.tanh(x @ x)
        end.record()
    # the default stream waits for s, as CUDA code does before using y elsewhere
    tpu.current_stream().wait_stream(s)
    end.wait()
    tpu.current_stream().wait_event(end)
    y.record_stream(tpu.current_stream())
    end.synchronize()
    assert end.query() and start.query() and s.query()
    assert start.elapsed_time(end) >= 0.0
    ev = s.record_event()
    ev.synchronize()
    assert ev.query()
    torch.testing.assert_close(y.cpu(), torch.tanh(x.cpu() @ x.cpu()), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="enable_timing"):
        tpu.Event().elapsed_time(tpu.Event())
    with pytest.raises(RuntimeError, match="recorded"):
        tpu.Event(enable_timing=True).elapsed_time(tpu.Event(enable_timing=True))


_TWO_DEVICES = r'''
import torch
tpu = torch.tpu
assert tpu.device_count() == 2
d0, d1 = tpu.default_stream(0), tpu.default_stream(1)
s1 = tpu.Stream("tpu:1")
assert s1.device_index == 1 and d1.device_index == 1 and d0 != d1
ctx = tpu.stream(s1)
for _ in range(2):
    with ctx:
        # as CUDA: selecting a stream of another device makes that device current
        assert tpu.current_device() == 1 and tpu.current_stream() == s1
        assert tpu.current_stream(0) == d0
        y = torch.ones(3, device="tpu") * 2
        assert y.device == torch.device("tpu", 1)
    assert tpu.current_device() == 0 and tpu.current_stream() == d0
    assert tpu.current_stream(1) == d1
with s1:
    assert tpu.current_device() == 1
assert tpu.current_device() == 0 and tpu.current_stream(1) == d1
tpu.set_stream(s1)
assert tpu.current_device() == 1
tpu.set_stream(d0)
assert tpu.current_device() == 0 and tpu.current_stream(1) == s1
print("STREAMS-OK")
'''


def test_stream_of_another_device_selects_that_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", TORCHTPU_PLATFORM="cpu")
    out = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0 and "STREAMS-OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("timing", [False, True])
def test_a_completed_event_keeps_no_result_alive(timing):
    """An event snapshots the arrays being computed at record(); once it has completed it
    must not keep them alive after their tensors are freed (memory like CUDA's)."""
    import gc
    import weakref

    from torchtpu.runtime import buffer

    x = torch.randn(2048, 2048, device="tpu")
    y = x @ x  # ~0.1 s of work: still running when the event is recorded
    ref = weakref.ref(buffer.buffer_of(y).array)
    ev = torch.tpu.Event(enable_timing=timing)
    ev.record()
    assert ref() is not None and not ref().is_ready()  # the snapshot holds it
    ev.synchronize()
    del y
    gc.collect()
    assert ref() is None
    assert ev.query()
    if timing:
        end = torch.tpu.Event(enable_timing=True)
        end.record()
        assert ev.elapsed_time(end) >= 0
