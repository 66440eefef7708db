"""PyTorch eager semantics on device "tpu", each checked against PyTorch on CPU.

Type promotion, broadcasting, views and in-place ops (bases and sibling views see writes),
``out=``, 64-bit dtypes, autograd, ``nn.Parameter``, tensor <-> Python conversions, device
errors, and the metrics counters. Values are compared with ``torch.testing.assert_close`` at
its default tolerances (exact for integers and bools).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

TPU = torch.device("tpu")


def assert_same(tpu_value, cpu_value):
    """tpu result == CPU result: device, dtype, shape and values (default tolerances)."""
    if isinstance(cpu_value, torch.Tensor):
        assert isinstance(tpu_value, torch.Tensor)
        assert tpu_value.device.type == "tpu", tpu_value.device
        assert tpu_value.dtype == cpu_value.dtype
        assert tpu_value.shape == cpu_value.shape
        torch.testing.assert_close(tpu_value.cpu(), cpu_value, equal_nan=True)
    elif isinstance(cpu_value, (list, tuple)):
        assert len(tpu_value) == len(cpu_value)
        for a, b in zip(tpu_value, cpu_value):
            assert_same(a, b)
    else:
        assert tpu_value == cpu_value


def both(fn, *cpu_args):
    """Run ``fn`` on CPU tensors and on copies of them on tpu; return (tpu_out, cpu_out)."""
    tpu_args = [a.to(TPU) if isinstance(a, torch.Tensor) else a for a in cpu_args]
    return fn(*tpu_args), fn(*cpu_args)


def check(fn, *cpu_args):
    out_tpu, out_cpu = both(fn, *cpu_args)
    assert_same(out_tpu, out_cpu)
    return out_tpu


def _make(dtype, shape=(3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    lo = 0 if dtype == torch.uint8 else -5
    return torch.randint(lo, 10, shape, generator=g).to(dtype)


# ----------------------------------------------------------------------------- type promotion

PROMOTION_PAIRS = [
    (torch.int32, torch.float32),
    (torch.int64, torch.int32),
    (torch.uint8, torch.int8),
    (torch.bool, torch.int64),
    (torch.bool, torch.float32),
    (torch.float32, torch.float64),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float16),
    (torch.int16, torch.bfloat16),
]


@pytest.mark.parametrize("a_dt,b_dt", PROMOTION_PAIRS, ids=lambda d: str(d).split(".")[-1])
def test_binary_promotion_tensor_tensor(a_dt, b_dt):
    a, b = _make(a_dt, seed=1), _make(b_dt, seed=2)
    check(torch.add, a, b)
    check(torch.mul, b, a)


@pytest.mark.parametrize("dt", [torch.int64, torch.int32, torch.uint8, torch.bool,
                                torch.float16, torch.float32, torch.float64],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("scalar", [2, 2.5, True], ids=["int", "float", "bool"])
def test_promotion_with_python_scalar(dt, scalar):
    a = _make(dt)
    check(lambda t: t * scalar, a)
    check(lambda t: t + scalar, a)


def test_zero_dim_tensor_does_not_promote_category():
    a = _make(torch.float16)
    z64 = torch.tensor(3.0, dtype=torch.float64)  # 0-dim: same category, does not widen
    check(torch.add, a, z64)
    i32 = _make(torch.int32)
    zi64 = torch.tensor(7, dtype=torch.int64)
    check(torch.mul, i32, zi64)
    zf = torch.tensor(0.5, dtype=torch.float64)  # 0-dim float with int tensor: default dtype
    check(torch.mul, i32, zf)


def test_true_division_of_integers_is_float():
    a = torch.tensor([7, -7, 9], dtype=torch.int64)
    b = torch.tensor([2, 2, -4], dtype=torch.int64)
    check(torch.div, a, b)
    check(lambda x, y: torch.div(x, y, rounding_mode="floor"), a, b)
    check(lambda x, y: torch.div(x, y, rounding_mode="trunc"), a, b)
    check(torch.remainder, a, b)


def test_inplace_cannot_downcast():
    a = torch.arange(4, device=TPU)  # int64
    with pytest.raises(RuntimeError, match="can't be cast"):
        a.add_(torch.ones(4, device=TPU, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="can't be cast"):
        a.mul_(1.5)
    f = torch.zeros(4, device=TPU)
    f.add_(torch.arange(4, device=TPU))  # int into float: allowed
    assert_same(f, torch.arange(4, dtype=torch.float32))


# ----------------------------------------------------------------------------- broadcasting

@pytest.mark.parametrize("sa,sb", [((3, 1), (1, 4)), ((2, 3, 4), (4,)), ((5, 1, 3), (2, 1)),
                                   ((), (2, 3)), ((1,), (3, 1))])
def test_broadcasting(sa, sb):
    a, b = _make(torch.float32, sa, 1), _make(torch.float32, sb, 2)
    check(torch.add, a, b)
    check(torch.mul, a, b)


def test_inplace_broadcasting():
    def fn(a, b):
        a = a.clone()
        a.add_(b)
        return a

    check(fn, _make(torch.float32, (3, 4)), _make(torch.float32, (4,)))


def test_inplace_broadcast_to_self_shape_fails():
    a = torch.zeros(4, device=TPU)
    with pytest.raises(RuntimeError):
        a.add_(torch.ones(3, 4, device=TPU))


def test_incompatible_shapes_fail():
    with pytest.raises(RuntimeError):
        torch.ones(3, device=TPU) + torch.ones(4, device=TPU)


# ----------------------------------------------------------------------------- views and in-place

def test_views_are_views():
    x = torch.zeros(3, 4, device=TPU)
    v = x[1]
    assert v._base is x
    assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert v.storage_offset() == 4
    t = x.t()
    assert not t.is_contiguous() and t.stride() == (1, 4)
    assert x.view(-1)._base is x


def test_inplace_on_view_updates_base_and_siblings():
    def fn(base):
        base = base.clone()
        row = base[1]
        col = base[:, 2]
        row.add_(100)  # write through one view...
        strided = base[:, ::2]
        strided.mul_(2)  # ...and through a strided one
        return base, row, col, strided

    check(fn, torch.arange(12.0).view(3, 4))


def test_inplace_on_base_visible_in_views():
    def fn(base):
        base = base.clone()
        v = base.view(2, 6)
        tr = base.t()
        base.sub_(1)
        base[0, 0] = 42.0
        return v, tr

    check(fn, torch.arange(12.0).view(3, 4))


def test_setitem_and_index_put():
    def fn(x):
        x = x.clone()
        x[0] = 5.0
        x[:, 1] = torch.tensor([7.0, 8.0, 9.0], device=x.device)
        x[x > 8] = -1.0
        x[torch.tensor([2, 0], device=x.device), torch.tensor([3, 3], device=x.device)] = 0.5
        return x

    check(fn, torch.arange(12.0).view(3, 4))


def test_view_of_view_and_transpose_inplace():
    def fn(x):
        x = x.clone()
        a = x.view(4, 6)[1:3]  # view of a view
        b = a.transpose(0, 1)
        b.zero_()
        x.unsqueeze(0).squeeze(0)[0, 0, 0] = 3.0
        return x

    check(fn, torch.arange(24.0).view(2, 3, 4))


def test_expand_and_reshape():
    check(lambda x: x.expand(3, 4) * 2, torch.arange(4.0).view(1, 4))
    check(lambda x: x.t().reshape(-1), torch.arange(12.0).view(3, 4))
    check(lambda x: x.t().contiguous().view(2, 6), torch.arange(12.0).view(3, 4))
    check(lambda x: x.permute(2, 0, 1).flatten(1), torch.arange(24.0).view(2, 3, 4))


def test_inplace_ops_return_self():
    a = torch.ones(3, device=TPU)
    assert a.add_(1) is a
    assert a.mul_(3) is a
    assert a.zero_() is a
    assert a.fill_(2.5) is a
    assert_same(a, torch.full((3,), 2.5))


def test_copy_between_devices_and_into_views():
    x = torch.zeros(3, 4, device=TPU)
    x[1].copy_(torch.arange(4.0))  # CPU -> tpu view
    x[:, 0].copy_(torch.ones(3, device=TPU))  # tpu -> tpu view
    ref = torch.zeros(3, 4)
    ref[1].copy_(torch.arange(4.0))
    ref[:, 0].copy_(torch.ones(3))
    assert_same(x, ref)
    host = torch.empty(3, 4)
    host.copy_(x)  # tpu -> CPU
    torch.testing.assert_close(host, ref)
    d = torch.zeros(3, device=TPU, dtype=torch.float64)
    d.copy_(torch.tensor([1, 2, 3]))  # with a dtype conversion
    assert_same(d, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


# ----------------------------------------------------------------------------- out=

def test_out_variant_writes_and_returns_out():
    a, b = _make(torch.float32, seed=1), _make(torch.float32, seed=2)
    out = torch.empty(3, 4, device=TPU)
    r = torch.add(a.to(TPU), b.to(TPU), out=out)
    assert r is out
    assert_same(out, a + b)


def test_out_variant_resizes_empty_out():
    a, b = _make(torch.float32, seed=1), _make(torch.float32, seed=2)
    out = torch.empty(0, device=TPU)
    torch.mul(a.to(TPU), b.to(TPU), out=out)
    assert_same(out, a * b)


def test_out_variant_into_view_updates_base():
    a = _make(torch.float32, (4,), 1)
    base = torch.zeros(3, 4, device=TPU)
    torch.mul(a.to(TPU), 2, out=base[1])
    ref = torch.zeros(3, 4)
    torch.mul(a, 2, out=ref[1])
    assert_same(base, ref)


def test_out_variant_dtype_rules():
    i = torch.arange(4, device=TPU)
    out_f = torch.empty(4, device=TPU, dtype=torch.float64)
    torch.add(i, i, out=out_f)  # int result into a float out: allowed, cast
    assert_same(out_f, torch.arange(4, dtype=torch.float64) * 2)
    out_i = torch.empty(4, device=TPU, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="can't be cast"):
        torch.add(i, 0.5, out=out_i)


def test_reduction_out():
    x = _make(torch.float32, (3, 4))
    out = torch.empty(3, device=TPU)
    torch.sum(x.to(TPU), dim=1, out=out)
    assert_same(out, x.sum(1))


# ----------------------------------------------------------------------------- 64-bit dtypes

def test_int64_values_beyond_int32_are_kept():
    big = torch.tensor([2**40 + 1, -(2**62), 2**53 + 1], dtype=torch.int64)
    t = big.to(TPU)
    assert t.dtype == torch.int64
    assert t.tolist() == big.tolist()
    check(lambda x: x + 1, big)
    check(lambda x: x * 3, torch.tensor([2**40 + 7], dtype=torch.int64))
    assert (t + 1)[2].item() == 2**53 + 2


def test_float64_precision_is_kept():
    x = torch.tensor([1.0 + 2**-40, 1e-300, 1e300], dtype=torch.float64)
    t = x.to(TPU)
    assert t.dtype == torch.float64
    assert t.tolist() == x.tolist()
    check(lambda v: v * 2.0, x)
    assert (t - 1.0)[0].item() == 2**-40


def test_default_dtypes():
    assert torch.arange(3, device=TPU).dtype == torch.int64
    assert torch.zeros(2, device=TPU).dtype == torch.float32
    assert torch.tensor([1, 2], device=TPU).dtype == torch.int64
    assert torch.tensor([1.5], device=TPU).dtype == torch.float32
    assert torch.tensor([True], device=TPU).dtype == torch.bool


@pytest.mark.parametrize("dt", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                                torch.bool], ids=lambda d: str(d).split(".")[-1])
def test_dtype_round_trip(dt):
    x = _make(dt, (5,))
    t = x.to(TPU)
    assert t.dtype == dt and t.device.type == "tpu"
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.int64), (torch.int64, torch.float16),
                                     (torch.float32, torch.bfloat16), (torch.float64, torch.float32),
                                     (torch.int32, torch.bool), (torch.float32, torch.uint8)],
                         ids=str)
def test_to_dtype(src, dst):
    x = torch.tensor([0.0, 1.0, 2.7, 100.0, -0.0]).to(src)
    if dst == torch.uint8:
        x = x.abs()
    check(lambda v: v.to(dst), x)


# ----------------------------------------------------------------------------- autograd

def leaf(x, dev):
    """A fresh leaf that requires grad (never ``x`` itself: ``x.to("cpu")`` returns ``x``)."""
    return x.detach().clone().to(dev).requires_grad_()


def _loss(x, w):
    return ((x @ w).tanh() * 2 + x.sum(1, keepdim=True)).pow(2).mean()


def test_backward_matches_cpu():
    x, w = _make(torch.float32, (4, 3), 1), _make(torch.float32, (3, 2), 2)
    grads = []
    for dev in ("cpu", TPU):
        xd = leaf(x, dev)
        wd = leaf(w, dev)
        loss = _loss(xd, wd)
        loss.backward()
        assert xd.grad.device.type == torch.device(dev).type
        grads.append((loss.detach(), xd.grad, wd.grad))
    (lt, gxt, gwt), (lc, gxc, gwc) = grads[1], grads[0]
    assert_same(lt, lc)
    assert_same(gxt, gxc)
    assert_same(gwt, gwc)


def test_autograd_grad_and_accumulation():
    x = _make(torch.float32, (5,), 3)
    res = {}
    for dev in ("cpu", TPU):
        xd = leaf(x, dev)
        (g,) = torch.autograd.grad((xd.sin() * xd).sum(), xd)
        assert xd.grad is None  # autograd.grad does not accumulate
        (xd * 2).sum().backward()
        (xd * 3).sum().backward()  # .grad accumulates
        res[str(dev)] = (g, xd.grad)
    assert_same(res["tpu"], res["cpu"])


def test_double_backward():
    x = _make(torch.float32, (4,), 4)
    res = {}
    for dev in ("cpu", TPU):
        xd = leaf(x, dev)
        (g,) = torch.autograd.grad((xd ** 3).sum(), xd, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), xd)
        res[str(dev)] = (g.detach(), gg)
    assert_same(res["tpu"], res["cpu"])


def test_no_grad_and_inference_mode():
    w = torch.ones(3, device=TPU, requires_grad=True)
    with torch.no_grad():
        y = w * 2
    assert not y.requires_grad and y.grad_fn is None
    with torch.inference_mode():
        z = w * 2
    assert z.is_inference() and not z.requires_grad
    assert_same(z, torch.full((3,), 2.0))
    with torch.enable_grad():
        assert (w * 2).requires_grad


def test_requires_grad_flows_and_detach():
    a = torch.ones(3, device=TPU, requires_grad=True)
    b = torch.ones(3, device=TPU)
    c = a * b
    assert c.requires_grad and c.grad_fn is not None and not c.is_leaf
    d = c.detach()
    assert not d.requires_grad and d.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    d.add_(1)  # detach shares storage
    assert_same(c.detach(), torch.full((3,), 2.0))
    b.requires_grad_()
    assert b.requires_grad and b.is_leaf


def test_tensor_and_module_hooks():
    x = _make(torch.float32, (2, 3), 5)
    res = {}
    for dev in ("cpu", TPU):
        torch.manual_seed(0)
        lin = nn.Linear(3, 2).to(dev)
        seen = {}

        def fwd_hook(module, inputs, output):  # returns None: observes only
            seen["fwd"] = output.detach().clone()

        def grad_hook(g):
            seen["h_grad"] = g.clone()

        lin.register_forward_hook(fwd_hook)
        lin.weight.register_hook(lambda g: g * 10)  # hooks may rewrite the gradient
        xd = leaf(x, dev)
        h = lin(xd)
        h.retain_grad()
        h.register_hook(grad_hook)
        h.pow(2).sum().backward()
        res[str(dev)] = (seen["fwd"], seen["h_grad"], h.grad, lin.weight.grad, xd.grad)
    assert_same(res["tpu"], res["cpu"])


def test_custom_autograd_function():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = _make(torch.float32, (4,), 6)
    res = {}
    for dev in ("cpu", TPU):
        xd = leaf(x, dev)
        Square.apply(xd).sum().backward()
        res[str(dev)] = xd.grad
    assert_same(res["tpu"], res["cpu"])


# ----------------------------------------------------------------------------- nn.Parameter

def test_parameter_on_tpu():
    p = nn.Parameter(torch.randn(3, 2, device=TPU))
    assert isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf
    assert p.device.type == "tpu"
    m = nn.Linear(2, 3)
    m.to(TPU)
    assert isinstance(m.weight, nn.Parameter) and m.weight.device.type == "tpu"
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    m(torch.ones(4, 2, device=TPU)).sum().backward()
    assert m.weight.grad.device.type == "tpu" and m.weight.grad.shape == (3, 2)


def test_module_to_keeps_parameters_and_weight_tying():
    """Like CUDA: ``module.to(device)`` converts parameters in place (same Parameter objects),
    so tied weights stay tied and an optimizer built before the move still owns them."""
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    param = emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to(TPU)
    assert model[0].weight is param and model[1].weight is param
    assert param.device.type == "tpu"
    assert opt.param_groups[0]["params"][0] is param


def test_parameter_data_assignment_and_inplace_under_no_grad():
    ref = nn.Linear(2, 2)
    m = nn.Linear(2, 2)
    m.load_state_dict(ref.state_dict())
    m.to(TPU)
    with torch.no_grad():
        m.weight.mul_(0.5)
        ref.weight.mul_(0.5)
    m.bias.data = torch.arange(2.0, device=TPU)
    ref.bias.data = torch.arange(2.0)
    assert_same(m.weight.detach(), ref.weight.detach())
    assert_same(m.bias.detach(), ref.bias.detach())


# ----------------------------------------------------------------------------- conversions

def test_item_tolist_and_python_conversions():
    t = torch.tensor([[1.5, -2.0], [3.25, 4.0]], device=TPU)
    assert t[1, 0].item() == 3.25
    assert t.tolist() == [[1.5, -2.0], [3.25, 4.0]]
    assert float(t[0, 1]) == -2.0
    assert int(torch.tensor(7, device=TPU)) == 7
    assert bool(torch.tensor(True, device=TPU)) is True
    assert torch.tensor([3], device=TPU).item() == 3
    assert isinstance(torch.tensor([3], device=TPU).item(), int)


def test_device_moves_and_predicates():
    x = torch.arange(6.0).view(2, 3)
    t = x.tpu()
    assert t.is_tpu and t.device == torch.device("tpu", 0) and not x.is_tpu
    assert t.to("tpu:0").is_tpu
    back = t.cpu()
    assert back.device.type == "cpu" and not back.is_tpu
    torch.testing.assert_close(back, x)
    assert t.to(torch.float64).dtype == torch.float64 and t.to(torch.float64).is_tpu
    assert t.to("cpu", torch.int32).dtype == torch.int32
    same = t.to(TPU)
    assert same is t  # no-op move returns self, like PyTorch
    m = nn.Linear(3, 1).tpu()
    assert m.weight.is_tpu
    assert torch.device("tpu").type == "tpu"
    assert torch.tpu.is_available() and torch.tpu.device_count() >= 1


def test_factories_on_device():
    assert_same(torch.zeros(2, 3, device=TPU), torch.zeros(2, 3))
    assert_same(torch.ones(4, device=TPU, dtype=torch.int32), torch.ones(4, dtype=torch.int32))
    assert_same(torch.full((2,), 3.5, device=TPU), torch.full((2,), 3.5))
    assert_same(torch.arange(1, 10, 2, device=TPU), torch.arange(1, 10, 2))
    assert_same(torch.linspace(0, 1, 5, device=TPU), torch.linspace(0, 1, 5))
    assert_same(torch.eye(3, device=TPU), torch.eye(3))
    x = torch.ones(2, 2, device=TPU)
    assert_same(torch.zeros_like(x), torch.zeros(2, 2))
    assert torch.empty(3, device=TPU).shape == (3,)


# ----------------------------------------------------------------------------- device errors

def test_mixing_devices_raises():
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, device=TPU) + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(3, 3, device=TPU) @ torch.ones(3, 3)


def test_cpu_zero_dim_tensor_operand():
    # PyTorch allows a 0-dim CPU tensor with a device tensor; it promotes as a 0-dim tensor
    # (a float64 one makes an int tensor float64), unlike a Python number
    check(lambda t: t * torch.tensor(2.0), _make(torch.float32, (3,)))
    check(lambda t: t * torch.tensor(2.5, dtype=torch.float64), _make(torch.int64, (3,)))
    check(lambda t: t * 2.5, _make(torch.int64, (3,)))
    check(lambda t: t + torch.tensor(3), _make(torch.int32, (3,)))
    check(lambda t: t * torch.tensor(1 + 2j), _make(torch.float32, (3,)))
    check(lambda t: t * torch.tensor(2.5, dtype=torch.float64), _make(torch.bfloat16, (3,)))


# One sequence in one process: each case follows one whose scalar compares equal (1 == 1.0 ==
# True, 0.0 == -0.0), so a cache keyed on the scalar's value would hand it the wrong program.
SCALAR_SEQUENCE = [
    (torch.int64, lambda t: t + 1), (torch.int64, lambda t: t + 1.0),
    (torch.int64, lambda t: t * 1.0), (torch.int64, lambda t: t * 1),
    (torch.bool, lambda t: t + True), (torch.bool, lambda t: t + 1), (torch.bool, lambda t: t + 1.0),
    (torch.int32, lambda t: t.clamp(0, 3)), (torch.int32, lambda t: t.clamp(0.0, 3.0)),
    (torch.int64, lambda t: torch.pow(t, 2)), (torch.int64, lambda t: torch.pow(t, 2.0)),
    (torch.float32, lambda t: 1 / (t * 0.0)), (torch.float32, lambda t: 1 / (t * -0.0)),
    (torch.float32, lambda t: t.add(1, alpha=2)), (torch.float32, lambda t: t.add(1, alpha=2.0)),
    (torch.int64, lambda t: torch.full_like(t, 2)), (torch.int64, lambda t: torch.full_like(t, 2.0)),
]


def test_python_scalars_promote_by_kind_not_value():
    for dtype, fn in SCALAR_SEQUENCE:
        check(fn, _make(dtype, (4,), seed=1))


def test_default_dtype_reaches_cached_ops():
    t = torch.tensor([1, 2, 3])
    check(lambda x: x * 2.5, t)
    check(lambda x: torch.ones(2, device=x.device), t)
    torch.set_default_dtype(torch.float64)
    try:
        check(lambda x: x * 2.5, t)
        check(lambda x: torch.ones(2, device=x.device), t)
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            check(lambda x: x * 2.5, t)
    finally:
        torch.set_default_dtype(torch.float32)
    check(lambda x: x * 2.5, t)


# ----------------------------------------------------------------------------- metrics

def _counter(name):
    return torch.tpu.metrics()["counters"].get(name, 0)


def test_metrics_count_host_syncs_on_item():
    x = torch.ones(3, device=TPU) * 2
    before = _counter("host_syncs")
    x.sum().item()
    assert _counter("host_syncs") >= before + 1
    before = _counter("host_syncs")
    x.tolist()
    assert _counter("host_syncs") >= before + 1
    before = _counter("host_syncs")
    x.cpu()
    assert _counter("host_syncs") >= before + 1


def test_metrics_count_compiles_and_cache_hits():
    a = torch.ones(7, 13, device=TPU)  # a shape no other test uses
    b = torch.ones(7, 13, device=TPU)
    c0, h0 = _counter("eager_compiles"), _counter("eager_cache_hits")
    a * b
    c1, h1 = _counter("eager_compiles"), _counter("eager_cache_hits")
    a * b
    c2, h2 = _counter("eager_compiles"), _counter("eager_cache_hits")
    assert c1 >= c0 + 1
    assert c2 == c1 and h2 >= h1 + 1  # the second call hits the cache
    per_op = torch.tpu.metrics()["per_op"]["eager_compiles"]
    assert any("mul" in k for k in per_op)


def test_metrics_reset():
    torch.ones(2, device=TPU).sum().item()
    torch.tpu.reset_metrics()
    assert _counter("host_syncs") == 0
    torch.ones(2, device=TPU).sum().item()
    assert _counter("host_syncs") >= 1


def test_synchronize():
    x = torch.ones(64, 64, device=TPU)
    y = x @ x
    torch.tpu.synchronize()
    assert_same(y, torch.full((64, 64), 64.0))
