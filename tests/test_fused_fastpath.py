"""Fused recording in C++ (eager/fastpath.cpp "Fused recording", eager/fused.py ``_offer``).

In ``DEFER_AND_FUSE`` mode a Kernel whose (key, inputs' abstract values) ``record`` recorded
before appends the node and makes the pending outputs itself. Every comparison here records
the same calls through ``record`` alone (``fastpath.set_enabled(False)``, the reference) and
through the C++ path, and compares bit for bit (values, dtypes, shapes, strides, storage
sharing, gradients) and the graphs' structure (the C++ path's graph has the fingerprint of
the Python path's: it is a graph cache hit, nothing compiles).
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch

from torchtpu.eager import fastpath, fused
from helpers import counter
from test_fastpath import _detach, _opinfo_keys, _same, _sharing

pytestmark = pytest.mark.skipif(not fastpath.available(),
                                reason="the fast path is not bound (TORCHTPU_FASTPATH=0)")

FUSE = torch.tpu.EagerMode.DEFER_AND_FUSE


_c = counter  # helpers.counter


@pytest.fixture(autouse=True)
def _restore():
    old = fastpath.set_enabled(True)
    mode = torch.tpu.get_eager_mode()
    torch.tpu.synchronize()
    yield
    fastpath.set_enabled(old)
    torch.tpu.set_eager_mode(mode)


def _rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to("tpu")


def both(make, fn):
    """fn(*make()) recorded by Python, then twice with the C++ path (the first installs, the
    second replays); each ends with a cut. Compares results, storage sharing and that the
    replayed graph is the Python path's (a graph cache hit)."""
    def run(enabled):
        fastpath.set_enabled(enabled)
        ins = make()
        with torch.tpu.set_eager_mode(FUSE):
            out = fn(*ins)
        return ins, out

    ins, ref = run(False)
    ref_share = _sharing(ins, ref)
    run(True)
    compiles, recs = _c("fused_graph_compiles"), _c("fused_fastpath_records")
    ins, got = run(True)
    assert _c("fused_fastpath_records") > recs, "no op was recorded in C++"
    assert _c("fused_graph_compiles") == compiles, "the replayed graph differs from record's"
    _same(ref, got)
    assert _sharing(ins, got) == ref_share
    return got


def test_chain_views_offsets_and_scalars():
    a, b = _rand(6, 8), _rand(6, 8, seed=1)

    def fn(a, b):
        c = a + b * 2.5
        d = c.t() @ a          # a transposed view input
        e = d[2:5, 1:7] * c[3, :6]  # views at storage offsets
        m = torch.max(d, 1)    # a tuple of outputs
        return (e.relu() - 0.5, m.values, m.indices, c.sum(0, keepdim=True))

    got = both(lambda: (a, b), fn)
    cpu = fn(a.cpu(), b.cpu())
    for x, y in zip(got, cpu):
        assert torch.allclose(x.cpu(), y, atol=1e-5)


def test_dead_values_inplace_and_aliasing():
    """Intermediates that die are not outputs, in-place writes (recorded by ``record``) see the
    replayed ops' values, and views share storage as on the Python path."""
    a = _rand(4, 4)

    def fn(a):
        x = a * 3.0
        y = x + 1.0       # dies: not an output of the graph
        z = y.exp()
        del y
        v = z[1]          # a view of a replayed output
        z.mul_(2.0)       # in-place: record's own path
        w = z + a
        return v, w, z

    both(lambda: (a.clone(),), fn)


def test_graph_inputs_keep_record_semantics():
    """An input array used twice is one graph input; a pending value of an earlier graph
    computed by a cut is an input array next time: both replay as record builds them."""
    a = _rand(5)

    def fn(a):
        b = a + a
        c = b * a
        c.cpu()            # cut: b and c computed
        d = c + b          # arrays of computed PendingBuffers as graph inputs
        return d, (d * d).sum()

    both(lambda: (a,), fn)


def test_size_limit_and_backward_cut_are_honoured(monkeypatch):
    a = _rand(3)
    fastpath.set_enabled(True)
    monkeypatch.setattr(fused, "MAX_NODES", 4)
    with torch.tpu.set_eager_mode(FUSE):
        x = a
        for _ in range(3):
            x = x + 1.0
        torch.tpu.synchronize()
        recs = _c("fused_fastpath_records")
        cuts = torch.tpu.metrics()["per_op"].get("fused_graph_cuts", {}).get("size_limit", 0)
        x = a
        for _ in range(8):
            x = x + 1.0
        assert _c("fused_fastpath_records") >= recs + 7
        assert torch.tpu.metrics()["per_op"]["fused_graph_cuts"]["size_limit"] >= cuts + 2
        assert torch.equal(x.cpu(), a.cpu() + 8.0)


def test_autograd_bitwise():
    w0 = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    x0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))

    def make():
        return (w0.to("tpu").requires_grad_(), x0.to("tpu"))

    def fn(w, x):
        loss = ((x @ w).tanh() * 1.5).sum()
        loss.backward()
        return loss.detach(), w.grad

    both(make, fn)


@pytest.mark.parametrize("max_nodes", [None, 3])
def test_sdpa_restrided_results_bitwise(monkeypatch, max_nodes):
    """SDPA's fused op lays its output out like the query (registry meta
    ``eager_layout_like``) and its backward its gradients like q, k, v: the C++ recording
    restrides them as the Python kernel does with ``record``'s results (the same permuted copy
    recorded after the node, also when the node's size-limit cut comes first), and the
    recorded graphs are the Python path's. Queries laid out as transformers makes them
    (``(B, L, H, E)`` transposed), grouped-query heads, a float mask, no dropout."""
    if max_nodes is not None:
        monkeypatch.setattr(fused, "MAX_NODES", max_nodes)
    g = torch.Generator().manual_seed(7)
    q0, k0, v0 = (torch.randn(2, 5, h, 8, generator=g) for h in (4, 2, 2))
    mask0 = torch.randn(2, 1, 5, 5, generator=g)

    def make():
        return tuple(t.to("tpu").requires_grad_() for t in (q0, k0, v0)) + (mask0.to("tpu"),)

    def fn(q, k, v, mask):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=True)
        assert not out.is_contiguous()  # laid out like the transposed query
        (out * out).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    got = both(make, fn)
    misses, falls = _c("fused_fastpath_misses"), _c("fused_fastpath_fallbacks")
    fastpath.set_enabled(True)
    ins = make()
    with torch.tpu.set_eager_mode(FUSE):
        again = fn(*ins)
    assert (_c("fused_fastpath_misses"), _c("fused_fastpath_fallbacks")) == (misses, falls)
    _same(got, again)
    ref = fn(*(t.detach().requires_grad_() if t.dtype.is_floating_point and t is not mask0
               else t for t in (q0, k0, v0, mask0)))
    for x, y in zip(got, ref):
        assert x.stride() == y.stride()
        assert torch.allclose(x.cpu(), y, atol=1e-5)


def test_checked_ops_hand_over_their_flag():
    """A checked op (registry ``check``: embedding's index bounds) replayed in C++ appends the
    node with its flag output and hands the flag to the pending checks as ``record`` does: the
    same graph, results bit for bit, one device check each; an out-of-range index recorded by
    the C++ entry raises the Python path's error at the sync."""
    w = _rand(10, 4)
    ok = torch.tensor([[1, 3, 9]]).to("tpu")

    def fn(w, i):
        return torch.nn.functional.embedding(i, w) * 2.0

    both(lambda: (w, ok), fn)
    bad = torch.tensor([[1, 10, 3]]).to("tpu")
    errors = []
    for enabled in (False, True, True):
        fastpath.set_enabled(enabled)
        checks, falls = _c("device_checks"), _c("fused_fastpath_fallbacks")
        recs, misses = _c("fused_fastpath_records"), _c("fused_fastpath_misses")
        with torch.tpu.set_eager_mode(FUSE):
            out = fn(w, bad)
            with pytest.raises(IndexError) as e:
                out.cpu()
        errors.append(str(e.value))
        assert _c("device_checks") == checks + 1
        if enabled:  # the entry installed with `ok` replays this call
            assert (_c("fused_fastpath_misses"), _c("fused_fastpath_fallbacks")) == (misses, falls)
            assert _c("fused_fastpath_records") >= recs + 1
    assert errors[0] == errors[1] == errors[2]
    assert "index out of range" in errors[0]


def test_entries_are_cleared_with_the_fast_path():
    a = _rand(3)
    with torch.tpu.set_eager_mode(FUSE):
        (a * 7.25).cpu()
    assert fastpath.fused_entries() > 0
    fastpath.clear()
    assert fastpath.fused_entries() == 0


# ---- OpInfo samples recorded by Python and by C++, bit for bit ----

def _opinfo_fused_case(key):
    from torchtpu import coverage
    from torchtpu.coverage import _tensors

    opinfo = coverage.op_db()[key]
    grad = coverage.supports_grad(opinfo)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            samples = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=grad))[:2]
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"no samples: {e}")

        def run(sample):
            inp, args, kwargs = coverage._move_sample(sample, "tpu", key)
            with torch.tpu.set_eager_mode(FUSE):
                try:
                    out = opinfo(inp, *args, **kwargs)
                    res = [out]
                    targets = coverage._grad_targets(out)
                    ins = [t for t in _tensors((inp, args, kwargs), []) if t.requires_grad]
                    if targets and ins:
                        go = [torch.ones_like(t) for t in targets]
                        res.append(torch.autograd.grad(targets, ins, go, allow_unused=True))
                    res = _detach(res)
                    torch.tpu.synchronize()
                except Exception as e:  # noqa: BLE001 - must fail the same way on both paths
                    return ("raised", type(e).__name__)
            return res

        for sample in samples:
            fastpath.set_enabled(False)
            ref = run(sample)
            fastpath.set_enabled(True)
            run(sample)
            got = run(sample)
            _same(ref, got, key)


FAST_KEYS = _opinfo_keys(30)


@pytest.mark.parametrize("key", FAST_KEYS)
def test_opinfo_fused_both_paths(key):
    _opinfo_fused_case(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(set(_opinfo_keys(1)) - set(FAST_KEYS)))
def test_opinfo_fused_both_paths_all(key):
    _opinfo_fused_case(key)


def test_opinfo_subset_is_replayed():
    r = _c("fused_fastpath_records")
    for key in FAST_KEYS[:6]:
        _opinfo_fused_case(key)
    gc.collect()
    assert _c("fused_fastpath_records") > r
