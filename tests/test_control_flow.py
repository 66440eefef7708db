"""torch.cond / torch.while_loop compiled for "tpu" (lowering/control_flow.py) against PyTorch
eager on CPU."""
import pytest
import torch
import torch._dynamo.testing

import torchtpu  # noqa: F401

DEV = "tpu"


def _branches(x, w):
    def hot(x, w):
        return (x @ w).softmax(-1), x.sum(-1)

    def cold(x, w):
        return (x - w.mean()).abs(), x.amax(-1)

    return hot, cold


def _f(x, w, t):
    hot, cold = _branches(x, w)
    return torch.cond((t > 0).any(), hot, cold, (x, w))


@pytest.mark.parametrize("taken", ["true", "false"])
def test_cond_tensor_predicate_matches_cpu(taken):
    torch._dynamo.reset()
    x, w = torch.randn(6, 6), torch.randn(6, 6)
    t = torch.tensor([0.0, 1.0] if taken == "true" else [0.0, -1.0])
    cf = torch.compile(_f, backend="tpu", fullgraph=True)
    got = cf(x.to(DEV), w.to(DEV), t.to(DEV))
    want = _f(x, w, t)
    for g, e in zip(got, want):
        torch.testing.assert_close(g.cpu(), e)


def test_cond_both_branches_one_program_no_recompile():
    """The predicate is data: flipping it reuses the compiled graph."""
    torch._dynamo.reset()
    x, w = torch.randn(6, 6), torch.randn(6, 6)
    counter = torch._dynamo.testing.CompileCounterWithBackend("tpu")
    cf = torch.compile(_f, backend=counter, fullgraph=True, dynamic=False)
    for sign in (1.0, -1.0, 1.0):
        t = torch.tensor([sign])
        for g, e in zip(cf(x.to(DEV), w.to(DEV), t.to(DEV)), _f(x, w, t)):
            torch.testing.assert_close(g.cpu(), e)
    assert counter.frame_count == 1


def test_cond_closure_tensor_and_python_predicate():
    torch._dynamo.reset()
    b = torch.randn(5)

    def f(x, flag: bool):
        return torch.cond(flag, lambda x: x + b.to(x.device), lambda x: x * 2, (x,))

    x = torch.randn(5)
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    for flag in (True, False):
        torch.testing.assert_close(cf(x.to(DEV), flag).cpu(), f(x, flag))


def test_cond_grad_matches_cpu():
    torch._dynamo.reset()
    x, w = torch.randn(4, 4), torch.randn(4, 4)

    def f(x, w):
        return torch.cond(x.sum() > 0, lambda x, w: (x @ w).tanh(), lambda x, w: x * w,
                          (x, w)).sum()

    for sign in (1.0, -1.0):
        xs = (x.abs() * sign)
        xc, wc = xs.clone().requires_grad_(), w.clone().requires_grad_()
        f(xc, wc).backward()
        xt, wt = xs.to(DEV).requires_grad_(), w.to(DEV).requires_grad_()
        torch.compile(f, backend="tpu")(xt, wt).backward()
        torch.testing.assert_close(xt.grad.cpu(), xc.grad)
        torch.testing.assert_close(wt.grad.cpu(), wc.grad)


def test_while_loop_matches_cpu():
    torch._dynamo.reset()

    def f(i, x, w):
        return torch._higher_order_ops.while_loop(
            lambda i, x: i < 5, lambda i, x: (i + 1, (x @ w).tanh()), (i, x))

    i, x, w = torch.tensor(0), torch.randn(3, 3), torch.randn(3, 3)
    cf = torch.compile(f, backend="tpu", fullgraph=True)
    got = cf(i.to(DEV), x.to(DEV), w.to(DEV))
    want = f(i, x, w)
    assert int(got[0].cpu()) == int(want[0]) == 5
    torch.testing.assert_close(got[1].cpu(), want[1])


def test_random_op_in_a_branch_is_a_clear_error():
    torch._dynamo.reset()

    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x + torch.rand_like(x), lambda x: x * 2, (x,))

    with pytest.raises(Exception, match="rand_like.*torch.cond branch"):
        torch.compile(f, backend="tpu")(torch.randn(4, device=DEV))


def test_eager_cond_and_while_loop_on_tpu_match_cpu():
    x = torch.randn(4)
    for sign in (1.0, -1.0):
        xs = x.abs() * sign
        want = torch.cond(xs.sum() > 0, lambda x: x + 1, lambda x: x * 2, (xs,))
        got = torch.cond(xs.to(DEV).sum() > 0, lambda x: x + 1, lambda x: x * 2, (xs.to(DEV),))
        torch.testing.assert_close(got.cpu(), want)
    body = (lambda i, x: i < 3, lambda i, x: (i + 1, x * 2))
    want = torch._higher_order_ops.while_loop(*body, (torch.tensor(0), x))
    got = torch._higher_order_ops.while_loop(*body, (torch.tensor(0, device=DEV), x.to(DEV)))
    assert int(got[0].cpu()) == int(want[0]) == 3
    torch.testing.assert_close(got[1].cpu(), want[1])


def _rnn_scan(x, h0, w, u):
    """An RNN as torch's scan HOP: carry h, per-step output h and its norm; w, u closed over
    (additional inputs), ``reverse`` exercises the flip the user-level API adds."""
    from torch._higher_order_ops.scan import scan

    def step(h, xt):
        nxt = torch.tanh(xt @ w + h @ u)
        return nxt, (nxt * 2, nxt.norm(dim=-1))

    h, (hs, norms) = scan(step, h0, x)
    hr, (hrs, _) = scan(step, h0, x, reverse=True)
    return h, hs, norms, hr, hrs


def test_scan_matches_cpu_forward_and_backward():
    torch._dynamo.reset()
    x, h0 = torch.randn(7, 2, 3), torch.randn(2, 4)  # 7 steps over dim 0
    w, u = torch.randn(3, 4) * 0.5, torch.randn(4, 4) * 0.5
    counter = torch._dynamo.testing.CompileCounterWithBackend("tpu")
    cf = torch.compile(_rnn_scan, backend=counter, fullgraph=True)
    got = cf(*(t.to(DEV) for t in (x, h0, w, u)))
    want = _rnn_scan(x, h0, w, u)
    for g, e in zip(got, want):
        torch.testing.assert_close(g.cpu(), e)
    assert counter.frame_count == 1

    def loss(x, h0, w, u):
        from torch._higher_order_ops.scan import scan

        def step(h, xt):
            nxt = torch.tanh(xt @ w + h @ u)
            return nxt, nxt.sum(-1)

        h, ys = scan(step, h0, x)
        return h.square().sum() + ys.square().sum()

    cpu = [t.clone().requires_grad_() for t in (x, h0, w, u)]
    loss(*cpu).backward()
    dev = [t.to(DEV).requires_grad_() for t in (x, h0, w, u)]
    torch.compile(loss, backend="tpu")(*dev).backward()
    for d, c in zip(dev, cpu):
        torch.testing.assert_close(d.grad.cpu(), c.grad, rtol=1e-4, atol=1e-5)


def test_map_matches_cpu():
    torch._dynamo.reset()
    from torch._higher_order_ops.map import map as hop_map

    def f(xs, ys, w):
        return hop_map(lambda xy, w: ((xy[0] @ w).relu() + xy[1].sum(), xy[0].amax()), (xs, ys), w)

    xs, ys, w = torch.randn(5, 3, 4), torch.randn(5, 2), torch.randn(4, 4)
    got = torch.compile(f, backend="tpu", fullgraph=True)(xs.to(DEV), ys.to(DEV), w.to(DEV))
    want = f(xs, ys, w)
    for g, e in zip(got, want):
        torch.testing.assert_close(g.cpu(), e)


@torch.compiler.nested_compile_region
def _region(x, w):
    from torch._higher_order_ops.scan import scan

    h, ys = scan(lambda h, xt: ((h + xt) @ w, (h * xt).sum(-1)), x[0], x[1:])
    return (x @ w).relu() + h, ys


def test_nested_compile_region_matches_cpu_forward_and_backward():
    """torch.compiler.nested_compile_region (invoke_subgraph), twice, with a scan inside it."""
    torch._dynamo.reset()

    def f(x, w):
        y, ys = _region(x, w)
        z, zs = _region(y.tanh(), w)
        return z.square().sum() + ys.sum() + zs.sum()

    x, w = torch.randn(5, 4), torch.randn(4, 4) * 0.5
    torch.testing.assert_close(
        torch.compile(f, backend="tpu", fullgraph=True)(x.to(DEV), w.to(DEV)).cpu(), f(x, w))
    torch._dynamo.reset()
    cpu = [t.clone().requires_grad_() for t in (x, w)]
    f(*cpu).backward()
    dev = [t.to(DEV).requires_grad_() for t in (x, w)]
    torch.compile(f, backend="tpu")(*dev).backward()
    for d, c in zip(dev, cpu):
        torch.testing.assert_close(d.grad.cpu(), c.grad, rtol=1e-4, atol=1e-5)
