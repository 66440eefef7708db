"""torch.compile with dynamic sizes: one XLA program per bucket where padding is provably exact
(compile/buckets.py), one per size with a one-time warning elsewhere; results equal CPU."""
from __future__ import annotations

import copy
import warnings

import pytest
import sympy
import torch

from torchtpu.compile import buckets
from torchtpu.runtime.metrics import COUNTERS

TPU = torch.device("tpu")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", "")  # count real compiles
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _rowwise():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4)).eval()


def _run_sizes(model, sizes, **compile_kw):
    tpu = copy.deepcopy(model).to(TPU)
    f = torch.compile(tpu, backend="tpu", **compile_kw)
    before = COUNTERS["compile_cache_misses"]  # programs this graph needed (memory or built)
    for n in sizes:
        x = torch.randn(3, n, 8, generator=torch.Generator().manual_seed(n))
        xt = x.to(TPU)
        torch._dynamo.mark_dynamic(xt, 1)
        with torch.no_grad():
            got = f(xt)
            assert got.shape == (3, n, 4)
            torch.testing.assert_close(got.cpu(), model(x))
    return COUNTERS["compile_cache_misses"] - before


def test_rowwise_graph_compiles_once_per_bucket():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "compiled per size" warning
        n = _run_sizes(_rowwise(), [17, 18, 25, 31, 33, 47, 64, 100])
    assert n == 3  # buckets 32, 64, 128 (powers of two)
    assert COUNTERS["compile_bucket_pads"] > 0


@pytest.mark.parametrize("opts, expected", [
    ({"bucket_size": 16}, 2),                              # 32, 48
    ({"bucket_size": 16, "num_dynamic_buckets": 2}, 2),   # 16, 32, then multiples of 32: 64
    ({"bucket_size": 0}, 5),                               # off: one program per size
])
def test_bucket_options(opts, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _run_sizes(_rowwise(), [17, 20, 31, 33, 40], options=opts) == expected


def test_process_wide_bucket_setting():
    torch.tpu.compiler.set_dynamic_buckets(bucket_size=64)
    try:
        assert _run_sizes(_rowwise(), [17, 40, 63]) == 1
    finally:
        torch.tpu.compiler.set_dynamic_buckets()


def test_bucket_sizes():
    assert [buckets.bucket(n, {}) for n in (1, 8, 9, 17, 100)] == [8, 8, 16, 32, 128]
    assert [buckets.bucket(n, {"bucket_size": 10}) for n in (1, 10, 11)] == [10, 10, 20]
    assert [buckets.bucket(n, {"bucket_size": 16, "num_dynamic_buckets": 2})
            for n in (5, 17, 33, 65)] == [16, 32, 64, 96]


def test_view_analysis():
    s = sympy.Symbol("s", positive=True, integer=True)
    i = sympy.Integer
    assert buckets._view_ok([i(4), s, i(8)], [4 * s, i(8)])   # (b, s, h) -> (b*s, h)
    assert buckets._view_ok([4 * s, i(8)], [i(4), s, i(8)])   # and back
    assert buckets._view_ok([s, i(8)], [s, i(2), i(4)])
    assert not buckets._view_ok([s, i(4)], [i(4), s])         # moves the padding inside
    assert not buckets._view_ok([s, i(4)], [4 * s])


class _SeqModel(torch.nn.Module):
    """A loss averaged over a dynamic sequence dim: padding it would change the mean."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, ids, targets):
        logits = self.lin(torch.tanh(self.emb(ids)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_variable_length_training_matches_cpu_and_says_it_specialises():
    torch.manual_seed(0)
    cpu = _SeqModel()
    tpu = copy.deepcopy(cpu).to(TPU)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.1)
    step = torch.compile(tpu, backend="tpu")
    lengths = [17, 23, 17, 40]
    bucketed = COUNTERS["compile_bucket_programs"]
    programs = COUNTERS["compile_cache_misses"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for n in lengths:
            g = torch.Generator().manual_seed(n)
            ids = torch.randint(0, 32, (2, n), generator=g)
            tgt = torch.randint(0, 32, (2, n), generator=g)
            it, tt = ids.to(TPU), tgt.to(TPU)
            torch._dynamo.mark_dynamic(it, 1)
            torch._dynamo.mark_dynamic(tt, 1)
            loss_c = cpu(ids, tgt)
            loss_c.backward()
            opt_c.step()
            opt_c.zero_grad()
            loss_t = step(it, tt)
            loss_t.backward()
            opt_t.step()
            opt_t.zero_grad()
            torch.testing.assert_close(loss_t.cpu(), loss_c.detach())
    msgs = [str(x.message) for x in w if "once per distinct size" in str(x.message)]
    assert len(msgs) >= 1 and ("mixes positions along a dynamic dimension" in msgs[0]
                               or "not known to keep" in msgs[0])
    for p, q in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach())
    # the loss averages over the sequence and the weight gradients sum over it: forward and
    # backward are compiled per length (17, 23, 40), none padded
    assert COUNTERS["compile_bucket_programs"] - bucketed == 0
    assert COUNTERS["compile_cache_misses"] - programs == 6


def test_reduction_over_dynamic_dim_is_not_padded():
    def f(x):
        return torch.softmax(x, dim=1) * x.shape[1]

    g = torch.compile(f, backend="tpu")
    with pytest.warns(UserWarning, match="once per distinct size"):
        for n in (17, 19):
            x = torch.randn(2, n)
            xt = x.to(TPU)
            torch._dynamo.mark_dynamic(xt, 1)
            torch.testing.assert_close(g(xt).cpu(), f(x))


def test_rowwise_forward_of_a_training_step_is_bucketed():
    """The compiled part is row-wise (embedding, tanh, linear); the loss runs eagerly. The
    forward graph returns the sizes its backward needs: their real values, not the bucket's."""
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 32))
    tpu = copy.deepcopy(cpu).to(TPU)
    f = torch.compile(tpu, backend="tpu")
    bucketed = COUNTERS["compile_bucket_programs"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (17, 23, 40):
            ids = torch.randint(0, 32, (2, n), generator=torch.Generator().manual_seed(n))
            it = ids.to(TPU)
            torch._dynamo.mark_dynamic(it, 1)
            out_c, out_t = cpu(ids), f(it)
            assert out_t.shape == out_c.shape
            loss_c = out_c.square().mean()
            loss_t = out_t.square().mean()
            loss_c.backward()
            loss_t.backward()
            torch.testing.assert_close(loss_t.cpu(), loss_c.detach())
            for p, q in zip(tpu.parameters(), cpu.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad)
                p.grad = q.grad = None
    assert COUNTERS["compile_bucket_programs"] - bucketed == 2  # forward: buckets 32, 64
