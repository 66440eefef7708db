"""``torch.tpu.ops`` collectives (all_gather_dim, reduce_scatter_dim, ragged_all_to_all) on
"tpu" (tpu_dist) in Strict, Fused and compiled mode, against their definitions composed from
ordinary collectives on CPU over gloo (``dist.all_gather`` / ``all_reduce`` /
``all_to_all_single`` of a gloo group in the same job), forward and backward.

Run under torchrun; prints "OK <case>" per check and "ALL OK <n>" at the end.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import torchtpu.ops as tops

checked = []


def ok(name):
    checked.append(name)
    if dist.get_rank() == 0:
        print("OK", name, flush=True)


def close(got, want, what):
    torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(),
                               msg=lambda s: f"rank {dist.get_rank()} {what}: {s}")


def inp(rank, shape, salt):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * salt + rank))


# ---- the definitions, from ordinary collectives on CPU tensors over gloo ----

def ref_gather(x, dim, g):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(g))]
    dist.all_gather(parts, x, group=g)
    return torch.cat(parts, dim)


def ref_scatter(x, dim, op, g):
    y = x.clone()
    n = dist.get_world_size(g)
    dist.all_reduce(y, {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
                        "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op], group=g)
    if op == "avg":
        y = y / n
    return y.chunk(n, dim)[dist.get_rank(g)]


def ref_ragged(inp_, out, io, ss, oo, rs, g):
    n = dist.get_world_size(g)
    where = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(where, oo.to(torch.int64), group=g)
    data = torch.cat([inp_[o:o + s] for o, s in zip(io.tolist(), ss.tolist())])
    got = torch.empty((int(rs.sum()),) + inp_.shape[1:])
    dist.all_to_all_single(got, data, rs.tolist(), ss.tolist(), group=g)
    out = out.clone()
    start = 0
    for o, s in zip(where.tolist(), rs.tolist()):
        out[o:o + s] = got[start:start + s]
        start += s
    return out


def ragged_case(rank, n, salt):
    """Token dispatch: rank r sends (r + j + 1) % 3 + 1 rows to rank j, packed from row 1 of
    its input (row 0 unused); the receiver lays the chunks out from row 2, in sender order.
    The rows not sent or written stay as they were."""
    send = [(rank + j + 1) % 3 + 1 for j in range(n)]
    recv = [(i + rank + 1) % 3 + 1 for i in range(n)]
    io = [1 + sum(send[:j]) for j in range(n)]
    # where my chunk goes in peer j's output: after the chunks of senders 0..rank-1 to j
    oo = [2 + sum((i + j + 1) % 3 + 1 for i in range(rank)) for j in range(n)]
    rows_in = 1 + 3 * n + 1  # the same on every rank (compiled: one SPMD program's shapes)
    rows_out = 2 + 3 * n + 2
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return (inp(rank, (rows_in, 3), salt), inp(rank, (rows_out, 3), salt + 1), t(io), t(send),
            t(oo), t(recv))


def strict(c):
    g, gl, dev = c.group, c.gloo, c.dev
    x = inp(c.rank, (4, 6), 1)
    for dim in (0, 1, -1):
        close(tops.all_gather_dim(x.to(dev), dim, g), ref_gather(x, dim, gl),
              f"all_gather_dim {dim}")
        # the same op on CPU tensors over gloo (the CompositeExplicitAutograd definition)
        close(tops.all_gather_dim(x, dim, gl), ref_gather(x, dim, gl), f"cpu all_gather_dim {dim}")
    for dim, op in ((0, "sum"), (1, "avg"), (1, "max"), (-1, "min")):
        close(tops.reduce_scatter_dim(x.to(dev), dim, op, g), ref_scatter(x, dim, op, gl),
              f"reduce_scatter_dim {dim} {op}")
    ok("all_gather_dim / reduce_scatter_dim (strict)")
    case = ragged_case(c.rank, c.n, 5)
    want = ref_ragged(*case, gl)
    close(tops.ragged_all_to_all(*[t.to(dev) for t in case], g), want, "ragged_all_to_all")
    close(tops.ragged_all_to_all(*case, gl), want, "cpu ragged_all_to_all")
    ok("ragged_all_to_all (strict)")
    # backward: against autograd through the gloo definition
    w = inp(c.rank, (6, 5), 7)
    for dev_ in (dev, None):
        xt = x.clone().to(dev_ or "cpu").requires_grad_()
        wt = w.clone().requires_grad_()
        if dev_ is None:
            y = tops.all_gather_dim(xt, 1, gl)  # CPU path (gloo)
            z = tops.reduce_scatter_dim(torch.tanh(y @ torch.cat([wt, wt], 0)), 0, "avg", gl)
        else:
            y = tops.all_gather_dim(xt, 1, g)
            z = tops.reduce_scatter_dim(torch.tanh(y @ torch.cat([wt, wt], 0).to(dev)), 0,
                                        "avg", g)
        (z * z).sum().backward()
        if dev_ is None:
            gref = xt.grad
            zref = z
        else:
            gtpu = xt.grad
            ztpu = z
    close(ztpu, zref, "autograd forward")
    close(gtpu, gref, "all_gather_dim/reduce_scatter_dim backward")
    ri, ro = (case[0].clone().requires_grad_(), case[1].clone().requires_grad_())
    rt = [case[0].to(dev).requires_grad_(), case[1].to(dev).requires_grad_()]
    wr = torch.arange(case[1].numel(), dtype=torch.float32).reshape(case[1].shape)
    (tops.ragged_all_to_all(ri, ro, *case[2:], gl) * wr).sum().backward()
    (tops.ragged_all_to_all(rt[0], rt[1], *[t.to(dev) for t in case[2:]], g)
     * wr.to(dev)).sum().backward()
    close(rt[0].grad, ri.grad, "ragged_all_to_all d_input")
    close(rt[1].grad, ro.grad, "ragged_all_to_all d_output")
    assert ri.grad.abs().sum() > 0 and (ro.grad == 0).any()
    ok("autograd (strict)")


def fused(c):
    g, gl, dev = c.group, c.gloo, c.dev
    x = inp(c.rank, (4, 6), 11)
    case = ragged_case(c.rank, c.n, 12)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        a = tops.all_gather_dim(x.to(dev) * 2, 1, g) + 1
        b = tops.reduce_scatter_dim(a.relu(), 1, "sum", g) - 1
        r = tops.ragged_all_to_all(*[t.to(dev) for t in case], g) * 3
        res = (a.cpu(), b.cpu(), r.cpu())
    a_ref = ref_gather(x * 2, 1, gl) + 1
    close(res[0], a_ref, "fused all_gather_dim")
    close(res[1], ref_scatter(a_ref.relu(), 1, "sum", gl) - 1, "fused reduce_scatter_dim")
    close(res[2], ref_ragged(*case, gl) * 3, "fused ragged_all_to_all")
    ok("fused")


def compiled(c):
    g, gl, dev = c.group, c.gloo, c.dev
    torch._dynamo.reset()
    before = dict(torch.tpu.metrics()["per_op"].get("compile_collectives", {}))

    def step(x, w, inp_, out, io, ss, oo, rs):
        h = torch.tanh(tops.all_gather_dim(x, 1, g) @ w)
        s = tops.reduce_scatter_dim(h, 0, "sum", g)
        r = tops.ragged_all_to_all(inp_ * 2, out, io, ss, oo, rs, g)
        return s * 2, r + 1

    x, w = inp(c.rank, (4, 3), 21), inp(c.rank, (6, 5), 22)
    case = ragged_case(c.rank, c.n, 23)
    cf = torch.compile(step, backend="tpu", fullgraph=True)
    got = cf(x.to(dev), w.to(dev), *[t.to(dev) for t in case])
    h = torch.tanh(ref_gather(x, 1, gl) @ w)
    close(got[0], ref_scatter(h, 0, "sum", gl) * 2, "compiled reduce_scatter_dim")
    close(got[1], ref_ragged(case[0] * 2, *case[1:], gl) + 1, "compiled ragged_all_to_all")
    # training: forward and backward graphs hold the ops (aot_autograd)
    xt = x.to(dev).requires_grad_()
    wt = w.to(dev).requires_grad_()

    def loss(x, w):
        return (tops.reduce_scatter_dim(torch.tanh(tops.all_gather_dim(x, 1, g) @ w), 0,
                                        "avg", g) ** 2).sum()

    torch.compile(loss, backend="tpu")(xt, wt).backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (tops.reduce_scatter_dim(torch.tanh(tops.all_gather_dim(xr, 1, gl) @ wr), 0, "avg", gl)
     ** 2).sum().backward()
    close(xt.grad, xr.grad, "compiled backward d_x")
    close(wt.grad, wr.grad, "compiled backward d_w")
    m = torch.tpu.metrics()["per_op"]
    low = {k: v - before.get(k, 0) for k, v in m.get("compile_collectives", {}).items()}
    for op in ("all_gather_dim", "reduce_scatter_dim", "ragged_all_to_all"):
        assert low.get(f"tpu::{op}.default", 0) > 0, (op, low)
    fb = m.get("compile_cpu_fallbacks", {})
    assert not any(k.startswith("tpu::") for k in fb), fb
    ok(f"compiled (lowered: {sorted(low.items())})")


def p2p(c):
    """send/recv: eager (tpu and CPU/gloo), and compiled where the two ranks run different
    programs (MPMD): rank 0 computes and sends, rank 1 receives and computes; then the reverse
    direction, the sender's token unused."""
    g, gl, dev = c.group, c.gloo, c.dev
    assert c.n == 2
    x = inp(0, (3, 4), 31)
    if c.rank == 0:
        tops.send(x.to(dev) * 2, 1, g)
        tops.send(x * 2, 1, gl)  # the same op on CPU tensors over gloo
    else:
        close(tops.recv(torch.empty(3, 4, device=dev), 0, g), x * 2, "eager recv")
        close(tops.recv(torch.empty(3, 4), 0, gl), x * 2, "cpu recv")
    ok("send/recv (strict)")
    torch._dynamo.reset()
    before = dict(torch.tpu.metrics()["per_op"].get("compile_collectives", {}))

    def stage0(x):
        tops.send(torch.tanh(x) * 3, 1, g)  # the token is dropped
        return tops.recv(torch.empty_like(x), 1, g) + 1

    def stage1(buf):
        h = tops.recv(buf, 0, g)
        tops.send(h * h, 0, g)
        return h - 1

    if c.rank == 0:
        out = torch.compile(stage0, backend="tpu", fullgraph=True)(x.to(dev))
        close(out, (torch.tanh(x) * 3) ** 2 + 1, "compiled send then recv")
    else:
        out = torch.compile(stage1, backend="tpu", fullgraph=True)(torch.empty(3, 4, device=dev))
        close(out, torch.tanh(x) * 3 - 1, "compiled recv then send")
    m = torch.tpu.metrics()["per_op"]
    low = {k: v - before.get(k, 0) for k, v in m.get("compile_collectives", {}).items()}
    assert low.get("tpu::send.default", 0) > 0 and low.get("tpu::recv.default", 0) > 0, low
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        if c.rank == 0:
            tops.send(x.to(dev) + 5, 1, g)
        else:
            r = (tops.recv(torch.empty(3, 4, device=dev), 0, g) * 2).cpu()
    if c.rank == 1:
        close(r, (x + 5) * 2, "fused recv")
    ok("send/recv (compiled MPMD, fused)")


def p2p_autograd(c):
    """send/recv differentiate as pipeline stages pair them: rank 0 sends tanh(x @ w0) and
    back-propagates through the token (its gradient comes back from rank 1), rank 1 receives
    it and back-propagates its loss (the gradient goes back to rank 0); on tpu and on CPU over
    gloo, against one CPU process computing the whole."""
    g, gl, dev = c.group, c.gloo, c.dev
    x, w0, w1 = inp(0, (3, 4), 51), inp(0, (4, 4), 52), inp(0, (4, 2), 53)
    w0r, w1r = w0.clone().requires_grad_(), w1.clone().requires_grad_()
    ((torch.tanh(x @ w0r) @ w1r) ** 2).sum().backward()
    for group, d in ((g, dev), (gl, torch.device("cpu"))):
        if c.rank == 0:
            wt = w0.clone().to(d).requires_grad_()
            tok = tops.send(torch.tanh(x.to(d) @ wt), 1, group)
            assert tok.requires_grad
            tok.sum().backward()
            close(wt.grad, w0r.grad, f"{d.type} send backward: d_w0")
        else:
            wt = w1.clone().to(d).requires_grad_()
            h = tops.recv(torch.empty(3, 4, device=d, requires_grad=True), 0, group)
            assert h.requires_grad
            ((h @ wt) ** 2).sum().backward()
            close(wt.grad, w1r.grad, f"{d.type} recv backward: d_w1")
    # compiled stages: aot_autograd puts the backward's recv/send in the backward graph
    torch._dynamo.reset()
    if c.rank == 0:
        wt = w0.to(dev).requires_grad_()
        f = torch.compile(lambda x, w: tops.send(torch.tanh(x @ w), 1, g), backend="tpu")
        f(x.to(dev), wt).sum().backward()
        close(wt.grad, w0r.grad, "compiled send backward: d_w0")
    else:
        wt = w1.to(dev).requires_grad_()
        f = torch.compile(lambda b, w: ((tops.recv(b, 0, g) @ w) ** 2).sum(), backend="tpu")
        f(torch.empty(3, 4, device=dev, requires_grad=True), wt).backward()
        close(wt.grad, w1r.grad, "compiled recv backward: d_w1")
    ok("send/recv autograd (tpu, CPU/gloo, compiled)")


def mesh(c):
    """torch.tpu.topology_aware_mesh: the CPU platform's trivial order; a 2-D mesh's groups
    carry the ops."""
    m = torch.tpu.topology_aware_mesh((c.n,), ("dp",))
    assert m.mesh.tolist() == list(range(c.n)) and m.mesh_dim_names == ("dp",)
    assert m.device_type == "tpu"
    m2 = torch.tpu.topology_aware_mesh((1, c.n), ("pp", "tp"))
    assert m2.mesh.tolist() == [list(range(c.n))]
    x = inp(c.rank, (2, 3), 41)
    close(tops.all_gather_dim(x.to(c.dev), 1, m2["tp"]), ref_gather(x, 1, c.gloo),
          "all_gather_dim over a mesh dim")
    try:
        torch.tpu.topology_aware_mesh((c.n + 1,))
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "mesh_shape" in str(e)
    ok("topology_aware_mesh")


class Ctx:
    pass


def main():
    import sys

    parts = sys.argv[1:] or ["strict", "fused", "compiled", "p2p", "p2p_autograd", "mesh"]
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    c = Ctx()
    c.rank, c.n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", c.rank))
    torch.tpu.set_device(local)
    c.dev = torch.device("tpu", local)
    c.group = dist.group.WORLD
    c.gloo = dist.new_group(backend="gloo")
    for p in parts:
        globals()[p](c)
    dist.destroy_process_group()
    if c.rank == 0:
        print("ALL OK", len(checked), flush=True)


if __name__ == "__main__":
    main()
