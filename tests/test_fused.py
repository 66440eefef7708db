"""Fused eager mode (``DEFER_AND_FUSE``): what it records, where it cuts, what it materialises.

The model-level checks (models train in Fused mode and match CPU) live in test_model_zoo.py and
test_hf_models.py; these test the executor's own contract.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from torchtpu.eager import fused

FUSE = torch.tpu.EagerMode.DEFER_AND_FUSE
STRICT = torch.tpu.EagerMode.DEFER_NEVER


def _counters():
    return torch.tpu.metrics()["counters"]


def _cuts():
    return dict(torch.tpu.metrics()["per_op"].get("fused_graph_cuts", {}))


def _pending(t) -> bool:
    buf = t.untyped_storage()._tpu_buffer
    return type(buf) is fused.PendingBuffer and buf.pending


@pytest.fixture(autouse=True)
def _clean():
    torch.tpu.synchronize()
    torch.tpu.reset_metrics()
    yield
    torch.tpu.set_eager_mode(STRICT)


def test_ops_record_until_a_read_cuts():
    a = torch.arange(12.0).reshape(3, 4).to("tpu")
    with torch.tpu.set_eager_mode(FUSE):
        b = (a * 2 + 1).relu()
        assert _pending(b)
        assert _counters()["fused_ops_recorded"] == 3
        assert not _cuts()
        assert b.sum().item() == pytest.approx(((torch.arange(12.0) * 2 + 1).relu()).sum().item())
        assert _cuts() == {"read": 1}
        assert not _pending(b)  # still referenced: computed by the cut


@pytest.mark.parametrize("cut", ["synchronize", "mode_switch", "cpu", "print"])
def test_every_cut_point(cut, capsys):
    a = torch.ones(4, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        b = a + 1
        assert _pending(b)
        if cut == "synchronize":
            torch.tpu.synchronize()
        elif cut == "cpu":
            assert b.cpu().tolist() == [2.0] * 4
        elif cut == "print":
            print(b)
    assert not _pending(b)
    reason = {"cpu": "read", "print": "read"}.get(cut, cut)
    # printing runs a few ops of its own on the values it reads: one cut each
    assert _cuts().get(reason) == 1 or (cut == "print" and _cuts().get(reason, 0) > 1)


def test_mode_property_switch_flushes():
    a = torch.ones(3, device="tpu")
    torch.tpu.eager_mode = FUSE
    try:
        b = a * 3
        assert _pending(b)
    finally:
        torch.tpu.eager_mode = STRICT
    assert not _pending(b)
    assert _cuts() == {"mode_switch": 1}
    assert b.cpu().tolist() == [3.0] * 3


def test_size_limit_cuts(monkeypatch):
    monkeypatch.setattr(fused, "MAX_NODES", 10)
    x = torch.zeros(2, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(25):
            x = x + 1
        assert _cuts() == {"size_limit": 2}
        assert _pending(x)
        assert x.cpu().tolist() == [25.0, 25.0]


def test_data_dependent_shape_op_cuts_and_runs():
    a = torch.tensor([0.0, 1.0, 0.0, 2.0]).to("tpu")
    with torch.tpu.set_eager_mode(FUSE):
        b = a * 3
        nz = torch.nonzero(b)
        assert _cuts().get("dynamic_shape") == 1
        assert nz.cpu().tolist() == [[1], [3]]


def test_dead_values_are_not_materialised(monkeypatch):
    live_ids = []
    real_live = fused._live

    def spy(pending):
        live = real_live(pending)
        live_ids.extend(id(pb) for pb in live)
        return live

    monkeypatch.setattr(fused, "_live", spy)
    a = torch.ones(8, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        mid = a * 2
        mid_id = id(mid.untyped_storage()._tpu_buffer)  # no reference kept: it may die
        out = mid + 1
        out_id = id(out.untyped_storage()._tpu_buffer)
        del mid
        gc.collect()
        torch.tpu.synchronize()
    # the graph held the intermediate's buffer until the cut, so its id was still its own there:
    # it was not an output of the program; the tensor still referenced was
    assert out_id in live_ids and mid_id not in live_ids
    assert out.cpu().tolist() == [3.0] * 8


def test_live_intermediate_and_check_flag_are_materialised():
    a = torch.arange(6.0).to("tpu")
    idx = torch.tensor([5, 0, 2]).to("tpu")
    with torch.tpu.set_eager_mode(FUSE):
        mid = a * 10
        g = mid[idx]  # a gather: its bounds-check flag is one more output of the graph
        torch.tpu.synchronize()
    assert not _pending(mid) and not _pending(g)
    assert g.cpu().tolist() == [50.0, 0.0, 20.0]
    assert mid.cpu().tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]


def _same_views_and_inplace(device, mode):
    base = torch.arange(24.0).reshape(4, 6).to(device)
    with torch.tpu.set_eager_mode(mode):
        col = base[:, 1]
        col.mul_(-1)  # writes the base through a view
        row = base[2]
        row += base[0]  # reads the already-written base
        t = base.t()
        t[1:3, :2] = 7.0
        out = (base.sum(0), col.clone(), row.clone())
        base.add_(1)  # later write: earlier clones keep their values, views see it
        return [x.cpu() for x in out] + [col.cpu(), base.cpu()]


def test_views_and_inplace_inside_one_graph_match_cpu():
    want = _same_views_and_inplace("cpu", STRICT)
    got = _same_views_and_inplace("tpu", FUSE)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def _train(mode, steps=6, dropout=0.1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Dropout(dropout), torch.nn.Linear(32, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(steps)]
    losses, compiles = [], []
    torch.tpu.manual_seed(3)
    with torch.tpu.set_eager_mode(mode):
        for x, y in data:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to("tpu")), y.to("tpu"))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            compiles.append(_counters().get("fused_graph_compiles", 0))
    return losses, compiles


def test_training_matches_strict_and_steady_state_compiles_nothing():
    strict, _ = _train(STRICT)
    torch.tpu.reset_metrics()
    fused_losses, compiles = _train(FUSE)
    torch.testing.assert_close(fused_losses, strict, rtol=1e-5, atol=1e-6)
    assert compiles[0] > 0
    assert compiles[-1] == compiles[2], compiles  # nothing compiled after the third step
    c = _counters()
    assert c["fused_graph_cache_hits"] > 0
    assert c["fused_donated_buffers"] > 0  # parameters and optimizer state updated in place
    assert c["fused_ops_executed"] == c["fused_ops_recorded"]


def test_recording_traces_each_op_kind_once():
    # a shape no other test records (traces and C++ recording entries outlive a test)
    x = torch.ones(4, 19, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        for _ in range(3):
            y = x
            for _ in range(5):
                y = y * 1.5 + 0.25
            torch.tpu.synchronize()
    traces = torch.tpu.metrics()["per_op"]["fused_op_traces"]
    assert sum(traces.values()) == 2, traces  # mul and add, traced once each
    assert _counters()["fused_graph_compiles"] == 1
    assert _counters()["fused_graph_cache_hits"] == 2
    torch.testing.assert_close(y.cpu(), _chain_on_cpu((4, 19)))


def _chain_on_cpu(shape=(4, 4)):
    y = torch.ones(*shape)
    for _ in range(5):
        y = y * 1.5 + 0.25
    return y


def test_random_ops_record_with_one_trace_and_match_strict():
    def draw(mode):
        torch.tpu.manual_seed(11)
        with torch.tpu.set_eager_mode(mode):
            outs = [torch.randn(3, 3, device="tpu") for _ in range(4)]
            return [o.cpu() for o in outs]

    want = draw(STRICT)
    torch.tpu.reset_metrics()
    got = draw(FUSE)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)
    assert sum(torch.tpu.metrics()["per_op"]["fused_op_traces"].values()) <= 2


def test_error_in_a_recorded_op_names_the_op():
    a = torch.ones(2, 3, device="tpu")
    b = torch.ones(4, 5, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        with pytest.raises(RuntimeError, match="size of tensor a"):
            a + b
        c = a * 2  # the graph keeps recording after the error
        assert c.cpu().tolist() == [[2.0] * 3] * 2


def test_backward_starts_a_new_program(monkeypatch):
    """A large enough graph is cut where a backward pass starts: the forward and its backward
    run as different programs (the optimizer joins the backward's); the losses do not change.
    Small graphs (this model's, by default) and TORCHTPU_FUSED_CUT_AT_BACKWARD=0 are not cut."""
    whole, _ = _train(FUSE, steps=4, dropout=0.0)
    assert "backward_boundary" not in _cuts()
    torch.tpu.reset_metrics()
    monkeypatch.setattr(fused, "BACKWARD_CUT_MIN_OPS", 1)
    split, _ = _train(FUSE, steps=4, dropout=0.0)
    assert _cuts().get("backward_boundary") == 4
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    torch.tpu.reset_metrics()
    monkeypatch.setattr(fused, "CUT_AT_BACKWARD", False)
    _train(FUSE, steps=2, dropout=0.0)
    assert "backward_boundary" not in _cuts()


def test_values_of_a_failed_graph_raise_instead_of_referring_to_it(monkeypatch):
    """A graph that fails to run leaves its live values uncomputed: using one raises (it must
    not be wired into the next graph as a node that no longer exists); other work goes on."""
    # a shape no other test uses: the graph must be new (scalars are traced, so ``a * 2`` of
    # a common shape may already be compiled)
    a = torch.ones(3, 11, 7, device="tpu")
    with torch.tpu.set_eager_mode(FUSE):
        b = a * 2
        real = fused._make_program

        def broken(*args, **kwargs):
            def run(*inputs):
                raise ValueError("simulated XLA failure")
            return run

        monkeypatch.setattr(fused, "_make_program", broken)
        with pytest.raises(RuntimeError, match="simulated XLA failure"):
            torch.tpu.synchronize()
        monkeypatch.setattr(fused, "_make_program", real)
        with pytest.raises(RuntimeError, match="never computed"):
            b + 1
        with pytest.raises(RuntimeError, match="never computed"):
            b.cpu()
        c = a * 3
        assert c.cpu().eq(3).all()
        d = a * 2  # the failed graph's shape again: its broken program was not kept
        assert d.cpu().eq(2).all()


def test_view_offsets_are_device_scalars_and_do_not_recompile():
    """A view's storage offset enters the graph as the cached device scalar Strict passes
    (not a host number, which cost a transfer per offset at each run), one input per offset:
    a window moving along a buffer (a KV cache's position) reuses one program, and two views
    whose offsets happen to be equal do not make another."""
    from torchtpu.eager import executor

    base = torch.arange(40.0).reshape(10, 4)
    dev = base.to("tpu")
    got, want = [], []
    for i, j in ((1, 5), (2, 6), (3, 3), (4, 8)):  # (3, 3): equal offsets
        with torch.tpu.set_eager_mode(FUSE):
            y = dev[i] * 2 + dev[j]
            g = fused._graph[0]
            offs = [x for x in g.inputs if getattr(x, "shape", None) == ()
                    and getattr(x, "dtype", None) == "int64"]
            expect = [executor.offset_value(4 * i), executor.offset_value(4 * j)]
            assert len(offs) == 2 and all(a is b for a, b in zip(offs, expect)), offs
            got.append(y.cpu())
        want.append(base[i] * 2 + base[j])
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert _counters().get("fused_graph_compiles", 0) <= 1


def test_threads_recording_at_once_get_their_own_results():
    """Fused mode's pending graph is one for every thread: recording and cutting own it in
    turn. Four threads recording at once broke it (a thread's cut returned while another's ran,
    leaving its value None; nodes of one thread's op interleaved with another's)."""
    import threading

    errors = []

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            for i in range(60):
                n = 3 + (i % 5)
                a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
                ta, tb = a.to("tpu"), b.to("tpu")
                got = ((ta @ tb).relu() + ta * 2).sum(0)
                v = ta[1:, ::2].clone()
                v.add_(1)
                if not torch.allclose(got.cpu(), ((a @ b).relu() + a * 2).sum(0), atol=1e-5):
                    errors.append((seed, i, "values"))
                if not torch.equal(v.cpu(), a[1:, ::2] + 1):
                    errors.append((seed, i, "view"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((seed, repr(e)))

    with torch.tpu.set_eager_mode(FUSE):
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
