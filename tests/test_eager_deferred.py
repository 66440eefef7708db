"""Novel exact eager ops served on the host while their program builds (eager/deferred.py)."""
import time

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.eager import deferred


@pytest.fixture
def defer_on():
    old = deferred.enabled()
    deferred.enable(True)
    yield
    deferred.enable(old)


def _per_op(name):
    return dict(torch.tpu.metrics()["per_op"].get(name, {}))


def _counter(name):
    return torch.tpu.metrics()["counters"].get(name, 0)


def _bookkeeping(dev, n):
    """A serving loop's kind of step: integer bookkeeping, a free list, a sampler's argmax, a
    row of a large table, an in-place write into a small map; shapes follow ``n``."""
    g = torch.Generator().manual_seed(n)
    lens = torch.randint(0, 50, (n,), generator=g)
    free = torch.randperm(4000, generator=g)[: 1000 + n]
    temps = torch.rand(n, generator=g)
    logits = torch.randn(n, 67, generator=g)
    table = torch.arange(300 * 700, dtype=torch.int32).reshape(300, 700)
    fmap = torch.zeros(257, dtype=torch.int64)
    slots = torch.randperm(257, generator=g)[:n]

    # a table past MAX_BYTES written in place (SGLang's req_to_token): on XLA:CPU too
    big = torch.zeros(1100, 1000, dtype=torch.int32)

    def step(lens, free, temps, logits, table, fmap, slots, big):
        out = [lens + 1, torch.cat([free, lens]), torch.cat([temps, temps[:1]]),
               torch.argmax(logits, -1), table[n, 3:3 + 5 * n].clone(), lens[slots % n]]
        fmap[slots] = lens
        big[slots, slots + 1] = lens.to(torch.int32)
        out += [fmap.clone(), big]
        return out

    want = step(lens, free, temps, logits, table, fmap.clone(), slots, big.clone())
    got = step(*(t.to(dev) for t in (lens, free, temps, logits, table, fmap, slots, big)))
    for w, o in zip(want, got):
        assert o.device.type == "tpu"
        assert o.dtype == w.dtype and o.shape == w.shape
        assert torch.equal(o.cpu(), w)


def _runs_programs_once_built(dev, n):
    """Repeat the step until no call of it is served on the host (its programs built), then
    once more: nothing on the host, no compile in the call."""
    deadline = time.monotonic() + 300
    while True:
        before = _counter("eager_deferred_calls")
        _bookkeeping(dev, n)
        if _counter("eager_deferred_calls") == before:
            break
        assert time.monotonic() < deadline, "deferred builds never finished"
        time.sleep(0.2)
    c0 = _counter("eager_xla_compiles") - _counter("eager_xla_compiles_off_path")
    _bookkeeping(dev, n)
    assert _counter("eager_deferred_calls") == before
    assert _counter("eager_xla_compiles") - _counter("eager_xla_compiles_off_path") == c0


def test_novel_exact_ops_run_on_the_host_then_their_programs(defer_on):
    dev = torch.device("tpu")
    n = 23  # shapes no other test compiles
    d0 = _per_op("eager_deferred_calls")
    _bookkeeping(dev, n)
    d1 = _per_op("eager_deferred_calls")
    served = {op for op in d1 if d1[op] > d0.get(op, 0)}
    # the integer add, the free-list and float cats, the argmax, the row of the large table,
    # the gather and the in-place write: none compiled in the call
    for op in ("aten.add.Tensor", "aten.cat.default", "aten.argmax.default",
               "aten.clone.default", "aten.index.Tensor", "aten.index_put.default"):
        assert op in served, (op, served)
    # the builds finish on a worker; then the same step runs the programs, compiling nothing
    _runs_programs_once_built(dev, n)


def test_held_builds_wait_for_build_held_or_a_recurring_shape():
    """A server's mode: a new shape's build is held (run by ``build_held`` while the server
    idles, not beside its requests); met again before that, it goes to a worker. Until built,
    the calls stay on the host."""
    old = deferred.enabled()
    deferred.enable(True, hold=True)
    try:
        dev = torch.device("tpu")
        for n in (19, 17):
            d0 = _counter("eager_deferred_calls")
            _bookkeeping(dev, n)
            d1 = _counter("eager_deferred_calls")
            assert d1 > d0 and deferred.held() > 0
            if n == 17:  # met again: handed to a worker; served on the host until built
                _bookkeeping(dev, n)
                assert _counter("eager_deferred_calls") > d1
                assert deferred.held() == 0
            else:
                while deferred.held():
                    deferred.build_held(1)
            _runs_programs_once_built(dev, n)
    finally:
        deferred.enable(old)


def test_float_arithmetic_and_big_tensors_compile_as_before(defer_on):
    dev = torch.device("tpu")
    a, b = torch.randn(29, 3), torch.randn(29, 3)
    d0 = _counter("eager_deferred_calls")
    got = (a.to(dev) * b.to(dev) + 0.5).cpu()  # rounding: the program's, not the host's
    big = torch.arange((deferred.MAX_BYTES // 8) + 31, dtype=torch.int64)
    got_big = (big.to(dev) + 1).cpu()
    # an accumulating index_put adds; an integer true division rounds
    idx, vals = torch.tensor([1, 4, 1]), torch.randn(3)
    acc = torch.zeros(37).to(dev).index_put_((idx.to(dev),), vals.to(dev), accumulate=True)
    q = torch.arange(1, 38).to(dev) / 7
    assert _counter("eager_deferred_calls") == d0
    torch.testing.assert_close(got, a * b + 0.5)
    assert torch.equal(got_big, big + 1)
    torch.testing.assert_close(acc.cpu(), torch.zeros(37).index_put_((idx,), vals,
                                                                      accumulate=True))
    torch.testing.assert_close(q.cpu(), torch.arange(1, 38) / 7)


def test_off_unless_enabled():
    assert not deferred.enabled()  # only a platform that serves requests turns it on
    d0 = _counter("eager_deferred_calls")
    x = torch.arange(31, device="tpu")
    assert torch.equal(torch.cat([x, x + 2]).cpu(), torch.cat([torch.arange(31),
                                                                torch.arange(31) + 2]))
    assert _counter("eager_deferred_calls") == d0
