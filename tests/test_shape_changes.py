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


def _count(name):
    return COUNTERS.get(name, 0)


def _specialised(w):
    return [str(x.message) for x in w if "once per distinct size" in str(x.message)]


def test_variable_length_training_matches_cpu_with_one_program_per_bucket():
    """The loss averages over the sequence (nll_loss mean) and the weight gradients sum over
    batch x sequence (mm, sum, embedding_dense_backward): masked, so forward and backward are
    compiled once per bucket (32, 64), not per length, and equal CPU's."""
    torch.manual_seed(0)
    cpu = _SeqModel()
    tpu = copy.deepcopy(cpu).to(TPU)
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.1)
    step = torch.compile(tpu, backend="tpu")
    lengths = [17, 23, 17, 40, 29]
    bucketed = _count("compile_bucket_programs")
    programs = _count("compile_cache_misses")
    masked = _count("compile_masked_graphs")
    reused = _count("compile_bucket_pads_reused")
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
    assert _specialised(w) == []
    for p, q in zip(tpu.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach())
    assert _count("compile_masked_graphs") - masked == 2  # forward and backward
    assert _count("compile_bucket_programs") - bucketed == 4  # 2 graphs x buckets 32, 64
    assert _count("compile_cache_misses") - programs == 4
    # the saved activation tanh(emb(ids)) reaches the backward as the forward's padded array
    assert _count("compile_bucket_pads_reused") - reused == len(lengths)


def test_shifted_language_model_loss_is_masked(monkeypatch):
    """The next-token loss: logits[:, :-1] against ids[:, 1:] (sizes s - 1, slices whose real
    positions stay a prefix) and its backward's slice_scatter: per bucket, equal to CPU, with
    NaN in every padded float input."""
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 32))
    tpu = copy.deepcopy(cpu).to(TPU)

    def loss_of(model, ids):
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 ids[:, 1:].flatten())

    f = torch.compile(lambda ids: loss_of(tpu, ids), backend="tpu")
    _losses_and_grads_match(lambda ids: loss_of(cpu, ids), f, cpu, tpu, (17, 30, 21), batch=3)


def _losses_and_grads_match(cpu_loss, tpu_loss, cpu, tpu, lengths, batch):
    """Each length (mark_dynamic on the sequence): loss and every parameter gradient equal to
    CPU's, nothing specialised per size, 2 programs in all (bucket 32: forward, backward)."""
    programs = _count("compile_cache_misses")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for n in lengths:
            ids = torch.randint(0, 32, (batch, n), generator=torch.Generator().manual_seed(n))
            it = ids.to(TPU)
            torch._dynamo.mark_dynamic(it, 1)
            lc, lt = cpu_loss(ids), tpu_loss(it)
            torch.testing.assert_close(lt.cpu(), lc.detach())
            lc.backward()
            lt.backward()
            for p, q in zip(tpu.parameters(), cpu.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad)
                p.grad = q.grad = None
    assert _specialised(w) == []
    assert _count("compile_cache_misses") - programs == 2


_WARM = """
import json, torch, torchtpu, warnings
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 32)).to("tpu")
def step(ids):
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
f = torch.compile(step, backend="tpu")
losses = []
for n in (17, 25):
    ids = torch.randint(0, 32, (2, n), generator=torch.Generator().manual_seed(n)).to("tpu")
    torch._dynamo.mark_dynamic(ids, 1)
    loss = f(ids)
    loss.backward()
    losses.append(float(loss))
c = torch.tpu.metrics()["counters"]
print(json.dumps([losses, c.get("xla_compiles", 0), c.get("compile_masked_graphs", 0)]))
"""


def test_masked_graphs_warm_start_from_the_caches(tmp_path):
    """A second process finds the masked graphs in the AOT cache (with the metadata the
    analysis reads) and their per-bucket programs on disk: nothing compiled, still masked."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _WARM], env=env, capture_output=True,
                             text=True, timeout=300, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (cold_losses, cold_compiles, cold_masked), (warm_losses, warm_compiles, warm_masked) = runs
    assert cold_compiles == 2 and cold_masked == 2  # bucket 32: forward, backward
    assert warm_compiles == 0 and warm_masked == 2
    assert warm_losses == cold_losses


class _TinyGPT(torch.nn.Module):
    """Token and position embeddings, layer norm, causal attention written out, residual,
    head, next-token loss: every op family a variable-length language model needs."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(32, 16)
        self.pos = torch.nn.Embedding(64, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids):
        b, n = ids.shape
        h = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
        q, k, v = self.qkv(self.ln(h)).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / 8 ** 0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v
        logits = self.head(h + a.transpose(1, 2).reshape(b, n, 16))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 ids[:, 1:].flatten())


def test_tiny_gpt_trains_on_variable_lengths_per_bucket(monkeypatch):
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))
    torch.manual_seed(0)
    cpu = _TinyGPT()
    tpu = copy.deepcopy(cpu).to(TPU)
    f = torch.compile(tpu, backend="tpu")
    _losses_and_grads_match(cpu, f, cpu, tpu, (17, 30, 23), batch=2)


def _fwd_bwd(f, sizes, dyn_dim=1, shape=(3, None, 8), grad=True):
    """Run ``f`` compiled and on CPU over inputs whose ``dyn_dim`` takes each of ``sizes``
    (mark_dynamic), compare outputs and input gradients; return (programs, warnings)."""
    g = torch.compile(f, backend="tpu")
    before = _count("compile_cache_misses")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for n in sizes:
            shp = [n if s is None else s for s in shape]
            x = torch.randn(*shp, generator=torch.Generator().manual_seed(n))
            x.requires_grad_(grad)
            xt = x.detach().to(TPU).requires_grad_(grad)
            torch._dynamo.mark_dynamic(xt, dyn_dim)
            out_c, out_t = f(x), g(xt)
            assert out_t.shape == out_c.shape
            torch.testing.assert_close(out_t.cpu(), out_c.detach())
            if grad:
                go = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(n + 1))
                out_c.backward(go)
                out_t.backward(go.to(TPU))
                torch.testing.assert_close(xt.grad.cpu(), x.grad)
    return _count("compile_cache_misses") - before, w


_W = torch.randn(8, 5, generator=torch.Generator().manual_seed(3))

# op families that reduce or contract over the dynamic dim 1 of a (3, n, 8) input
MASKED = {
    "sum": lambda x: x.sum(1),
    "sum_all": lambda x: (x * x).sum(),
    "mean": lambda x: x.mean(1),
    "mean_all": lambda x: x.exp().mean(),
    "amax": lambda x: x.amax(1),
    "amin_keepdim": lambda x: x.amin(1, keepdim=True) * 2,
    "max_dim": lambda x: x.max(1).values,
    "softmax": lambda x: torch.softmax(x, 1) * x,
    "log_softmax": lambda x: torch.log_softmax(x.exp(), 1),
    "logsumexp": lambda x: torch.logsumexp(x, 1),
    "bmm": lambda x: x.transpose(1, 2) @ x.exp(),
    "mm_flat": lambda x: x.flatten(0, 1).t() @ (x.flatten(0, 1) @ _W.to(x.device)),
    "mse_mean": lambda x: torch.nn.functional.mse_loss(x, x.detach().sin() * 2),
    "size_as_value": lambda x: torch.softmax(x, 1) * x.shape[1],
    "bce_sum": lambda x: torch.nn.functional.binary_cross_entropy(
        torch.sigmoid(x), torch.sigmoid(x.detach() * 3), reduction="sum"),
    "huber_mean": lambda x: torch.nn.functional.huber_loss(x, x.detach().cos()),
    # slices that keep real positions a prefix (size s - 1), and their slice_scatter backward
    "shifted_product": lambda x: (x[:, 1:] * x[:, :-1]).sum(1),
    "first_position": lambda x: x[:, 0] * x.mean(1),
}


@pytest.mark.parametrize("name", sorted(MASKED))
def test_masked_reductions_forward_backward(name, monkeypatch):
    """Each family masked exactly: NaN in every padded input position never reaches a
    result, and one program per bucket (sizes 17..31: bucket 32) for forward and backward."""
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))
    masked = _count("compile_masked_graphs")
    programs, w = _fwd_bwd(MASKED[name], [17, 24, 31])
    assert _specialised(w) == []
    assert programs == 2
    assert _count("compile_masked_graphs") - masked >= 1


def test_two_dynamic_dims_are_masked_with_their_own_sizes(monkeypatch):
    """Batch and sequence both dynamic: two real sizes, each mask along its own dim."""
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))

    def f(x):
        return torch.softmax(x, 1).sum(0) + x.mean((0, 1)) * x.shape[0]

    g = torch.compile(f, backend="tpu")
    before = _count("compile_cache_misses")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for b, n in ((3, 17), (5, 30), (6, 20)):
            x = torch.randn(b, n, 8, generator=torch.Generator().manual_seed(b * n),
                            requires_grad=True)
            xt = x.detach().to(TPU).requires_grad_()
            torch._dynamo.mark_dynamic(xt, 0)
            torch._dynamo.mark_dynamic(xt, 1)
            out_c, out_t = f(x), g(xt)
            torch.testing.assert_close(out_t.cpu(), out_c.detach())
            go = torch.randn(out_c.shape, generator=torch.Generator().manual_seed(b))
            out_c.backward(go)
            out_t.backward(go.to(TPU))
            torch.testing.assert_close(xt.grad.cpu(), x.grad)
    assert _specialised(w) == []
    assert _count("compile_cache_misses") - before == 2  # buckets (8, 32): forward, backward


def test_masked_index_reductions():
    f = lambda x: x.argmax(1) + x.argmin(1) + (x > 0.5).any(1) + (x > -3).all(1)  # noqa: E731
    programs, w = _fwd_bwd(f, [17, 24, 31], grad=False)
    assert _specialised(w) == [] and programs == 1


def test_index_past_the_real_size_still_raises():
    """gather along a padded dim: an index valid only in the bucket raises as on CPU."""
    g = torch.compile(lambda x, i: torch.gather(x, 1, i), backend="tpu")
    for n, bad in ((17, False), (18, True)):
        x = torch.randn(3, n, 8)
        idx = torch.randint(0, 17, (3, 2, 8), generator=torch.Generator().manual_seed(0))
        if bad:
            idx[1, 1, 2] = n  # past the real size, inside the bucket (32)
        xt = x.to(TPU)
        torch._dynamo.mark_dynamic(xt, 1)
        if bad:
            with pytest.raises(RuntimeError):
                torch.gather(x, 1, idx)
            with pytest.raises(RuntimeError, match="gather"):
                g(xt, idx.to(TPU)).cpu()
        else:
            torch.testing.assert_close(g(xt, idx.to(TPU)).cpu(), torch.gather(x, 1, idx))


def test_nan_padding_would_show_a_missing_mask(monkeypatch):
    """The NaN padding check can fail: with the masks turned off, NaN reaches the result."""
    from torchtpu.compile import masking

    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))
    monkeypatch.setattr(masking, "fill_padding", lambda x, spec, fill, *reals: x)
    g = torch.compile(lambda x: x.sum(1), backend="tpu")
    xt = torch.randn(3, 17, 8).to(TPU)
    torch._dynamo.mark_dynamic(xt, 1)
    assert torch.isnan(g(xt).cpu()).all()


def test_attention_over_a_dynamic_sequence_is_masked(monkeypatch):
    """Attention written out (softmax over the dynamic key dim, contractions over it), the
    query, key and value all of the dynamic length: one program per bucket."""
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))

    def attn(x):
        q, k, v = x, x * 0.5, x.cos()
        s = q @ k.transpose(-1, -2) / 8 ** 0.5
        causal = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
        return torch.softmax(s, -1) @ v

    programs, w = _fwd_bwd(attn, [17, 24, 31], dyn_dim=2, shape=(1, 2, None, 8))
    assert _specialised(w) == []
    assert programs == 2


def test_sdpa_backward_over_a_dynamic_sequence_is_specialised():
    """scaled_dot_product_attention's backward reaches the compiler as one fused op, registered
    random (dropout) with the sequence lengths as values: left per size, said once (the
    forward is padded: one program for both sizes)."""
    f = lambda x: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        x, x * 0.5, x.cos(), is_causal=True)
    programs, w = _fwd_bwd(f, [17, 24], dyn_dim=2, shape=(1, 2, None, 8))
    msgs = _specialised(w)
    assert len(msgs) == 1 and "scaled_dot_product" in msgs[0] and "backward" in msgs[0]
    assert programs == 3


# attention's fused op over a dynamic sequence (forward): the padded keys and values are zeroed,
# and a causal mask over one length, or a mask whose key dim is the dynamic one, keeps every
# real query off them
SDPA = {
    "causal": lambda x: torch.nn.functional.scaled_dot_product_attention(
        x, x * 0.5, x.cos(), is_causal=True),
    "bool_mask": lambda x: torch.nn.functional.scaled_dot_product_attention(
        x, x * 0.5, x.cos(), attn_mask=torch.ones(
            x.shape[2], x.shape[2], dtype=torch.bool, device=x.device).tril(-1).logical_not()),
    "float_mask": lambda x: torch.nn.functional.scaled_dot_product_attention(
        x, x.sin(), x.cos(), attn_mask=torch.zeros(x.shape[2], x.shape[2], device=x.device)),
}


@pytest.mark.parametrize("name", sorted(SDPA))
def test_sdpa_over_a_dynamic_sequence_is_masked(name, monkeypatch):
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))
    programs, w = _fwd_bwd(SDPA[name], [17, 24, 31], dyn_dim=2, shape=(1, 2, None, 8),
                           grad=False)
    assert _specialised(w) == []
    assert programs == 1


def test_sdpa_with_a_static_mask_over_dynamic_queries_is_specialised():
    """A mask whose query dim is static while the queries are dynamic would not broadcast once
    padded: per size (and still CPU's result)."""
    m = torch.zeros(1, 1, 1, 5)

    def f(x):
        return torch.nn.functional.scaled_dot_product_attention(
            x, x[:, :, :5], x[:, :, :5].cos(), attn_mask=m.to(x.device).expand(1, 1, 17, 5))

    programs, w = _fwd_bwd(f, [17], dyn_dim=2, shape=(1, 2, None, 8), grad=False)
    assert programs == 1


def test_sdpa_mask_marked_apart_from_the_queries(monkeypatch):
    """A 4-d mask (batch, 1, queries, keys) marked dynamic apart from the queries (a prompt's
    ids and the mask generate() builds for a static cache): two size symbols, padded alike
    when equal (one program, CPU's result); unequal, the op raises as on CPU."""
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))
    kv = torch.randn(1, 2, 24, 8, generator=torch.Generator().manual_seed(1))

    def f(q, mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q, kv.to(q.device), kv.to(q.device).cos(), attn_mask=mask)

    g = torch.compile(f, backend="tpu")
    before = _count("compile_cache_misses")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for n, m in ((17, 17), (21, 21), (17, 18)):
            q = torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n))
            mask = torch.rand(1, 1, m, 24, generator=torch.Generator().manual_seed(m)) > 0.3
            mask[..., 0] = True
            qt, mt = q.to(TPU), mask.to(TPU)
            torch._dynamo.mark_dynamic(qt, 2)
            torch._dynamo.mark_dynamic(mt, 2)
            if n != m:
                with pytest.raises(RuntimeError):
                    f(q, mask)
                with pytest.raises(RuntimeError, match="must match"):
                    g(qt, mt).cpu()
                continue
            torch.testing.assert_close(g(qt, mt).cpu(), f(q, mask))
    assert _specialised(w) == []
    assert _count("compile_cache_misses") - before == 1


def test_index_copy_at_dynamic_positions_of_a_static_buffer(monkeypatch):
    """A static KV cache written at a prompt's positions (index_copy_ of a dynamic number of
    rows into a buffer of fixed size): the padded rows and indices write nothing, so the
    buffer holds CPU's values everywhere (the padding's index 0 and NaN rows would overwrite
    position 0 otherwise); one program for the bucket."""
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))

    def f(buf, x, pos):
        buf.index_copy_(1, pos, x * 2)
        return buf.sum(-1)

    g = torch.compile(f, backend="tpu")
    before = _count("compile_cache_misses")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for n in (17, 21, 29):
            x = torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n))
            pos = torch.arange(n) + 3
            buf = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(0))
            bt, xt, pt = buf.to(TPU), x.to(TPU), pos.to(TPU)
            torch._dynamo.mark_dynamic(xt, 1)
            torch._dynamo.mark_dynamic(pt, 0)
            out_t = g(bt, xt, pt)
            torch.testing.assert_close(out_t.cpu(), f(buf, x, pos))
            torch.testing.assert_close(bt.cpu(), buf)
    assert _specialised(w) == []
    assert _count("compile_cache_misses") - before == 1


@pytest.mark.parametrize("k", [1, 3])
def test_slice_from_the_end_of_a_dynamic_dim(k, monkeypatch):
    """``h[:, -k:]`` (a model's logits for its last token): the last real positions."""
    monkeypatch.setattr(buckets, "DEBUG_PAD_VALUE", float("nan"))
    programs, w = _fwd_bwd(lambda x: x[:, -k:] * 2, [17, 24, 31], grad=False)
    assert _specialised(w) == []
    assert programs == 1


@pytest.mark.parametrize("name, op", [("var", "var.correction"), ("cumsum", "cumsum")])
def test_unmasked_reduction_is_specialised_with_a_warning(name, op):
    f = {"var": lambda x: x.var(1), "cumsum": lambda x: x.cumsum(1)}[name]
    programs, w = _fwd_bwd(f, [17, 19], grad=False)
    msgs = _specialised(w)
    assert len(msgs) == 1 and op in msgs[0]
    assert programs == 2  # per size


def test_rowwise_forward_of_a_training_step_is_bucketed():
    """The compiled part is row-wise (embedding, tanh, linear); the loss runs eagerly. The
    forward graph returns the sizes its backward needs: their real values, not the bucket's.
    The backward's weight gradients sum over batch x sequence: masked, also per bucket."""
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
    # forward and backward: buckets 32, 64
    assert COUNTERS["compile_bucket_programs"] - bucketed == 4
