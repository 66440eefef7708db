"""Random ops on tpu: distribution statistics (bounds that fail for a wrong distribution),
support and dtype like PyTorch, and reproducibility under torch.manual_seed,
torch.tpu.manual_seed and explicit generators."""
from __future__ import annotations

import math

import warnings

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

D = "tpu"
N = 40000
# a mean estimated from N samples has standard error sigma/sqrt(N); 6 standard errors
Z = 6.0 / math.sqrt(N)


def _stats(t):
    c = t.cpu().double()
    return c.mean().item(), c.std().item(), c.min().item(), c.max().item()


def test_continuous_distributions():
    torch.manual_seed(0)
    x = torch.empty(N, device=D)
    m, s, _, _ = _stats(x.normal_(2.0, 3.0))
    assert abs(m - 2.0) < 3.0 * Z and abs(s - 3.0) < 0.05
    m, s, lo, hi = _stats(x.uniform_(-1.0, 3.0))
    assert -1.0 <= lo and hi < 3.0 and abs(m - 1.0) < 4 / math.sqrt(12) * Z
    assert abs(s - 4 / math.sqrt(12)) < 0.03
    m, s, lo, _ = _stats(x.exponential_(2.0))
    assert lo > 0 and abs(m - 0.5) < 0.5 * Z and abs(s - 0.5) < 0.02
    m, _, lo, _ = _stats(x.log_normal_(0.0, 0.5))
    assert lo > 0 and abs(m - math.exp(0.125)) < 0.6 * Z
    med = x.cauchy_(1.0, 2.0).cpu().median().item()
    assert abs(med - 1.0) < 0.1
    c = x.cpu()
    # Cauchy: P(|X - median| < sigma) = 1/2
    assert abs(((c - 1.0).abs() < 2.0).double().mean().item() - 0.5) < 0.02
    assert x.dtype == torch.float32
    h = torch.empty(N, dtype=torch.bfloat16, device=D).uniform_(0, 1)
    assert h.dtype == torch.bfloat16 and h.cpu().max().item() < 1.0


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_samplers_draw_each_part_like_cpu(dtype):
    """PyTorch samples a complex tensor's real and imaginary parts (view_as_real): normal with
    half the variance in each part, uniform in [from, to) in each part. They raised
    NotImplementedError on tpu (the real-only check), as randn/rand/randn_like of a complex
    dtype did."""
    torch.manual_seed(0)
    for z, (m_want, s_want) in ((torch.randn(N, dtype=dtype, device=D), (0.0, math.sqrt(0.5))),
                                (torch.empty(N, dtype=dtype, device=D).normal_(1.0, 2.0),
                                 (1.0, 2.0 / math.sqrt(2))),
                                (torch.randn_like(torch.zeros(N, dtype=dtype, device=D)),
                                 (0.0, math.sqrt(0.5)))):
        assert z.dtype == dtype
        for part in (z.real, z.imag):
            m, s, _, _ = _stats(part)
            assert abs(m - m_want) < s_want * Z and abs(s - s_want) < 0.02 * s_want
    for z, lo_want, hi_want in ((torch.rand(N, dtype=dtype, device=D), 0.0, 1.0),
                                (torch.empty(N, dtype=dtype, device=D).uniform_(-1.0, 3.0),
                                 -1.0, 3.0)):
        for part in (z.real, z.imag):
            m, _, lo, hi = _stats(part)
            assert lo_want <= lo and hi < hi_want
            assert abs(m - (lo_want + hi_want) / 2) < (hi_want - lo_want) / math.sqrt(12) * Z
    z = torch.randn(N, dtype=dtype, device=D).cpu()
    assert abs(torch.corrcoef(torch.stack([z.real, z.imag]).double())[0, 1].item()) < 6 / math.sqrt(N)


def test_discrete_distributions():
    torch.manual_seed(1)
    x = torch.empty(N, device=D)
    m, _, lo, _ = _stats(x.geometric_(0.25))
    c = x.cpu()
    assert lo >= 1 and torch.equal(c, c.round()) and abs(m - 4.0) < math.sqrt(12) * Z
    m, _, _, _ = _stats(x.bernoulli_(0.3))
    assert set(x.cpu().unique().tolist()) <= {0.0, 1.0} and abs(m - 0.3) < 0.5 * Z
    m, _, _, _ = _stats(torch.bernoulli(torch.full((N,), 0.2, device=D)))
    assert abs(m - 0.2) < 0.5 * Z
    p = torch.linspace(0, 1, N, device=D)
    b = torch.empty(N, device=D).bernoulli_(p)
    assert abs(b.cpu().mean().item() - 0.5) < 0.5 * Z
    assert b.cpu()[0].item() == 0.0 and b.cpu()[-1].item() == 1.0


@pytest.mark.parametrize("dtype,args,lo,hi", [
    (torch.int64, (-5, 5), -5, 4), (torch.uint8, (), 0, 255), (torch.int8, (), 0, 127),
    (torch.float32, (), 0, 2 ** 24), (torch.bool, (), 0, 1), (torch.int32, (7,), 0, 6),
    (torch.int64, (3, None), 3, 2 ** 63 - 1),
])
def test_random_integer_ranges(dtype, args, lo, hi):
    torch.manual_seed(2)
    t = torch.empty(N, dtype=dtype, device=D).random_(*args)
    assert t.dtype == dtype
    c = t.cpu().double() if dtype != torch.int64 else t.cpu()
    assert c.min().item() >= lo and c.max().item() <= hi
    if hi - lo <= 256:  # every value of a small range appears, uniformly
        counts = torch.bincount((t.cpu().long() - lo).flatten(), minlength=hi - lo + 1)
        assert counts.min().item() > 0
        expect = N / (hi - lo + 1)
        assert (counts.double() - expect).abs().max().item() < 6 * math.sqrt(expect)
    else:  # the mean of a wide range is its midpoint
        mid = (lo + hi) / 2
        assert abs(c.double().mean().item() - mid) < (hi - lo) * Z


def test_randint_randperm_multinomial():
    torch.manual_seed(3)
    r = torch.randint(3, 9, (N,), device=D)
    assert r.dtype == torch.int64 and r.cpu().min() == 3 and r.cpu().max() == 8
    p = torch.randperm(100, device=D)
    assert p.dtype == torch.int64 and torch.equal(p.cpu().sort().values, torch.arange(100))
    assert torch.randperm(5, dtype=torch.int32, device=D).dtype == torch.int32
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3], device=D)
    s = torch.multinomial(probs, N, replacement=True)
    assert s.dtype == torch.int64
    freq = torch.bincount(s.cpu(), minlength=4).double() / N
    assert freq[1].item() == 0.0
    assert (freq - probs.cpu().double()).abs().max().item() < 0.5 * Z * 2
    w = torch.multinomial(torch.tensor([[1.0, 0.0, 2.0, 3.0], [1.0, 1.0, 1.0, 0.0]], device=D), 3)
    w = w.cpu()
    assert w.shape == (2, 3)
    assert sorted(w[0].tolist()) == [0, 2, 3] and sorted(w[1].tolist()) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="without replacement"):
        torch.multinomial(probs, 5)


def test_dropout():
    torch.manual_seed(4)
    x = torch.ones(N, device=D)
    out, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    assert mask.dtype == torch.bool
    m, o = mask.cpu(), out.cpu()
    assert abs(m.double().mean().item() - 0.75) < 0.5 * Z
    assert torch.equal(o, torch.where(m, torch.tensor(1 / 0.75), torch.tensor(0.0)))
    out, mask = torch.ops.aten.native_dropout(x, 0.25, False)
    assert torch.equal(out.cpu(), x.cpu()) and bool(mask.cpu().all())
    y = torch.nn.functional.dropout(x, 1.0)
    assert torch.equal(y.cpu(), torch.zeros(N))
    # autograd through dropout uses the same mask
    xr = torch.ones(1000, device=D, requires_grad=True)
    z = torch.nn.functional.dropout(xr, 0.5)
    z.sum().backward()
    assert torch.equal(xr.grad.cpu(), z.detach().cpu())


def test_normal_functional_overloads():
    torch.manual_seed(5)
    mean = torch.full((N,), 3.0, device=D)
    m, s, _, _ = _stats(torch.normal(mean, 2.0))
    assert abs(m - 3.0) < 2 * Z and abs(s - 2.0) < 0.05
    m, s, _, _ = _stats(torch.normal(-1.0, torch.full((N,), 0.5, device=D)))
    assert abs(m + 1.0) < 0.5 * Z and abs(s - 0.5) < 0.02
    m, s, _, _ = _stats(torch.normal(mean, torch.full((N,), 0.5, device=D)))
    assert abs(m - 3.0) < 0.5 * Z
    t = torch.normal(0.0, 1.0, (N,), device=D, dtype=torch.float64)
    assert t.dtype == torch.float64
    m, s, _, _ = _stats(torch.randn(N, device=D))
    assert abs(m) < Z and abs(s - 1.0) < 0.03


def test_reproducibility():
    def draw():
        return torch.cat([torch.randn(8, device=D), torch.rand(8, device=D),
                          torch.randint(0, 100, (8,), device=D).float()]).cpu()

    torch.manual_seed(11)
    a = draw()
    torch.manual_seed(11)
    b = draw()
    assert torch.equal(a, b)
    c = draw()
    assert not torch.equal(a, c)
    torch.tpu.manual_seed(12)
    a = draw()
    torch.tpu.manual_seed(12)
    assert torch.equal(a, draw())
    state = torch.tpu.get_rng_state()
    a = draw()
    torch.tpu.set_rng_state(state)
    assert torch.equal(a, draw())
    g = torch.Generator(device=D)
    g.manual_seed(3)
    a = torch.randn(6, device=D, generator=g).cpu()
    g.manual_seed(3)
    assert torch.equal(a, torch.randn(6, device=D, generator=g).cpu())


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_explicit_generator_is_seeded_and_advances(mode):
    # the dispatcher hands a kernel a plain wrapper of a tpu Generator's C++ generator: its seed
    # was ignored and every draw from it repeated the first (same noise for every step of a
    # sampler seeded with torch.Generator("tpu").manual_seed(s))
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    with ctx:
        g = torch.Generator(device=D).manual_seed(5)
        a, b = (torch.rand(8, device=D, generator=g).cpu() for _ in range(2))
        assert not torch.equal(a, b)
        assert g.get_offset() == 2
        torch.tpu.manual_seed(5)  # the same seed gives the default generator's stream
        assert torch.equal(torch.rand(8, device=D).cpu(), a)
        g7 = torch.Generator(device=D).manual_seed(7)
        assert not torch.equal(torch.rand(8, device=D, generator=g7).cpu(), a)
        g.manual_seed(5)
        assert torch.equal(torch.rand(8, device=D, generator=g).cpu(), a)
        state = g.get_state()
        c = torch.randn(8, device=D, generator=g).cpu()
        torch.randn(3, device=D)  # the default generator's draws leave g alone
        d = torch.empty(8, device=D).normal_(generator=g).cpu()
        assert not torch.equal(c, d)
        g.set_state(state)
        assert torch.equal(torch.randn(8, device=D, generator=g).cpu(), c)
        assert torch.equal(torch.empty(8, device=D).normal_(generator=g).cpu(), d)
        with pytest.raises(RuntimeError, match="device type for generator"):
            torch.rand(3, device=D, generator=torch.Generator().manual_seed(5)).cpu()


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_explicit_generator_drives_random_ops_run_on_cpu(mode):
    # a random op without a lowering runs on CPU (randperm with a generator): it drew from the
    # tpu generator's own C++ generator, which holds only its tag, so re-seeding the tpu
    # generator did not repeat the draw
    before = torch.tpu.metrics()["per_op"].get("cpu_fallbacks", {})
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    with ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = torch.Generator(device=D).manual_seed(3)
        a, b = (torch.randperm(64, generator=g, device=D).cpu() for _ in range(2))
        assert sorted(a.tolist()) == list(range(64)) and not torch.equal(a, b)
        assert g.get_offset() == 2
        g.manual_seed(3)
        assert torch.equal(torch.randperm(64, generator=g, device=D).cpu(), a)
        g.manual_seed(4)
        assert not torch.equal(torch.randperm(64, generator=g, device=D).cpu(), a)
    after = torch.tpu.metrics()["per_op"].get("cpu_fallbacks", {})
    assert sum(after.values()) > sum(before.values())  # the path under test ran


def test_random_ops_have_lowerings():
    torch.tpu.reset_metrics()
    x = torch.empty(10, device=D)
    x.normal_(), x.uniform_(), x.exponential_(), x.bernoulli_(0.5), x.random_(0, 5)
    x.geometric_(0.5), x.log_normal_(), x.cauchy_()
    torch.randperm(5, device=D), torch.multinomial(x.abs() + 0.1, 3)
    torch.ops.aten.native_dropout(x, 0.5, True)
    x.cpu()
    per_op = torch.tpu.metrics()["per_op"]
    assert not per_op.get("cpu_fallbacks"), per_op


_FACTORIES = {
    "randn": lambda x: x + torch.randn(4, 3, device=x.device),
    "randn_bf16": lambda x: x + torch.randn(4, 3, device=x.device, dtype=torch.bfloat16).float(),
    "rand": lambda x: x + torch.rand(4, 3, device=x.device),
    "randint_low": lambda x: x + torch.randint(2, 5, (4, 3), device=x.device),
    "randint": lambda x: x + torch.randint(9, (4, 3), device=x.device),
    "randn_like": lambda x: x + torch.randn_like(x),
    "rand_like": lambda x: x + torch.rand_like(x),
    "randint_like": lambda x: x + torch.randint_like(x, 7),
    "randint_like_low": lambda x: x + torch.randint_like(x, 3, 7),
}


@pytest.mark.parametrize("name", list(_FACTORIES))
def test_compiled_random_factories_match_eager_on_device(name):
    """torch.randn & co. inside torch.compile draw from the device generator exactly what
    eager draws (before their lowerings, aot_autograd's decompositions ran them on the CPU
    with the CPU generator)."""
    f = _FACTORIES[name]
    x = torch.zeros(4, 3, device=D)
    torch.manual_seed(0)
    eager = f(x).cpu()
    torch._dynamo.reset()
    torch.tpu.reset_metrics()
    torch.manual_seed(0)
    compiled = torch.compile(f, backend="tpu")(x).cpu()
    assert torch.equal(compiled, eager)
    assert not torch.tpu.metrics()["per_op"].get("compile_cpu_fallbacks")
    torch.manual_seed(1)
    assert not torch.equal(torch.compile(f, backend="tpu")(x).cpu(), eager)


_BAD_PROBABILITIES = {
    "multinomial_negative": lambda d: torch.multinomial(torch.tensor([[0.5, -0.1, 0.6]], device=d), 1),
    "multinomial_nan": lambda d: torch.multinomial(torch.tensor([float("nan"), 1.0], device=d), 1),
    "multinomial_zero_sum": lambda d: torch.multinomial(torch.zeros(2, 3, device=d), 1),
    "bernoulli": lambda d: torch.bernoulli(torch.tensor([1.5, 0.2], device=d)),
    "bernoulli_": lambda d: torch.empty(2, device=d).bernoulli_(torch.tensor([-0.5, 0.2],
                                                                             device=d)),
}


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("name", list(_BAD_PROBABILITIES))
def test_invalid_probabilities_raise_like_cpu(name, mode):
    """Invalid probabilities raise CPU's exception type at the next sync instead of sampling."""
    f = _BAD_PROBABILITIES[name]
    with pytest.raises(RuntimeError) as cpu_err:
        f("cpu")
    assert cpu_err.type is RuntimeError
    if mode == "compiled":
        torch._dynamo.reset()
        g = torch.compile(lambda: f(D).float().sum(), backend="tpu")
    else:
        g = lambda: f(D)  # noqa: E731
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    with ctx, pytest.raises(RuntimeError, match="multinomial|p_in"):
        g().cpu()
    # valid probabilities in the same program shapes run and do not raise
    assert torch.multinomial(torch.tensor([[0.0, 1.0, 0.0]], device=D), 1).item() == 1
    assert torch.bernoulli(torch.tensor([1.0, 0.0], device=D)).cpu().tolist() == [1.0, 0.0]
