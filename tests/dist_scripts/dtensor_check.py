"""DTensor on "tpu" against the same computation on plain CPU tensors.

Run under torchrun (2 or 4 ranks) or spawned ranks. Every rank builds the same global CPU
tensors from fixed seeds, computes the reference on CPU, runs the DTensor computation on a
"tpu" DeviceMesh and compares (float32 tolerance; exact where no arithmetic happens):
  mesh        init_device_mesh("tpu", (n,)) and ("dp", "tp") named 2-D meshes
  layout      distribute_tensor / from_local / to_local / full_tensor, uneven and empty shards
  redist      every transition among Shard(0), Shard(1), Replicate, Partial(sum|avg|max|min)
  ops         matmul, linear, elementwise, reductions, softmax, embedding, view ops, cat/split
  autograd    gradients through all of the above, from_local/to_local/redistribute backward
  random      distributed RNG: replicated values equal, shards differ
  mesh2d      the same on the 2-D mesh (dp x tp; (1, 2) on 2 ranks, (2, 2) on 4)
Prints "OK <check>" per check and "ALL OK <n>" at the end; any mismatch raises.
Usage: dtensor_check.py [--mode strict|fused] [--only name,...]
"""
from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (DTensor, Partial, Replicate, Shard, distribute_tensor)

checked = []
DEV = None


_t0 = [time.monotonic()]


def ok(name):
    checked.append(name)
    if dist.get_rank() == 0:
        print(f"OK {name} ({time.monotonic() - _t0[0]:.1f} s)", flush=True)
    _t0[0] = time.monotonic()


def g(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def close(got, want, what, exact=False):
    """``got`` (DTensor or tensor) equals CPU ``want``; a DTensor is compared in full and must
    live on "tpu"."""
    if isinstance(got, DTensor):
        assert got.to_local().device.type == "tpu", (what, got.to_local().device)
        got = got.full_tensor()
    assert got.device.type == "tpu", (what, got.device)
    got = got.cpu()
    if exact:
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), \
            f"rank {dist.get_rank()} {what}: got {got} want {want}"
    else:
        torch.testing.assert_close(got, want, msg=lambda m: f"rank {dist.get_rank()} {what}: {m}")


def local_piece(x, placements, mesh):
    """What this rank must hold for CPU ``x`` laid out as ``placements`` (Shard/Replicate)."""
    coord = mesh.get_coordinate()
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            chunks = list(torch.chunk(x, mesh.size(i), dim=p.dim))
            c = coord[i]
            if c < len(chunks):
                x = chunks[c]
            else:  # torch.chunk gives fewer chunks: the trailing ranks hold an empty piece
                shape = list(x.shape)
                shape[p.dim] = 0
                x = x.new_empty(shape)
    return x


# ---- layout ----

def check_layout(mesh):
    n = mesh.size()
    for shape in [(8, 6), (5, 3), (1, 3), (3, 5, 2)]:
        x = g(*shape, seed=sum(shape))
        for pl in [[Shard(0)], [Shard(1)], [Replicate()], [Shard(len(shape) - 1)]]:
            d = distribute_tensor(x.to(DEV), mesh, pl)
            assert d.shape == x.shape and d.placements == tuple(pl)
            close(d.to_local(), local_piece(x, pl, mesh), f"to_local {shape} {pl}", exact=True)
            close(d, x, f"full_tensor {shape} {pl}", exact=True)
    # from_local: shards, replicas and partial sums, with the global shape given (uneven)
    x = g(5, 4, seed=7)
    piece = local_piece(x, [Shard(0)], mesh)
    d = DTensor.from_local(piece.to(DEV), mesh, [Shard(0)], shape=x.shape,
                           stride=x.stride())
    close(d, x, "from_local Shard(0) uneven", exact=True)
    d = DTensor.from_local(x.to(DEV), mesh, [Replicate()], run_check=True)
    close(d, x, "from_local Replicate run_check", exact=True)
    parts = [g(5, 4, seed=70 + r) for r in range(n)]
    d = DTensor.from_local(parts[mesh.get_local_rank()].to(DEV), mesh, [Partial()])
    close(d, sum(parts), "from_local Partial full_tensor")
    ok("layout")


# ---- redistribute ----

def make(x, pl, mesh, seed):
    """A DTensor for global CPU ``x`` with placement ``pl`` on a 1-D mesh (Partial: random
    local parts that reduce to ``x``)."""
    n, r = mesh.size(), mesh.get_local_rank()
    if isinstance(pl, Partial):
        op = pl.reduce_op
        if op in ("sum", "avg"):
            parts = [g(*x.shape, seed=seed + k) for k in range(n - 1)]
            scale = n if op == "avg" else 1
            parts.append(x * scale - sum(parts) if parts else x * scale)
        else:  # max/min: one rank holds x, the others something smaller/larger
            other = x - 1 - g(*x.shape, seed=seed).abs() if op == "max" else \
                x + 1 + g(*x.shape, seed=seed).abs()
            parts = [x if k == seed % n else other for k in range(n)]
        return DTensor.from_local(parts[r].to(DEV), mesh, [pl], shape=x.shape,
                                  stride=x.stride())
    return distribute_tensor(x.to(DEV), mesh, [pl])


def check_redistribute(mesh):
    srcs = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max"),
            Partial("min")]
    dsts = [Shard(0), Shard(1), Replicate(), Partial("sum")]
    seed = 0
    for shape in [(6, 4), (5, 3)]:
        x = g(*shape, seed=100 + shape[0])
        for src in srcs:
            for dst in dsts:
                if isinstance(dst, Partial) and src != dst:
                    # DTensor refuses it from the API ("for internal use only"); the
                    # backward of Partial -> Replicate/Shard does it (autograd checks)
                    continue
                seed += 1
                d = make(x, src, mesh, seed)
                e = d.redistribute(mesh, [dst])
                assert e.placements == (dst,), (src, dst, e.placements)
                what = f"redistribute {shape} {src} -> {dst}"
                exact = not isinstance(src, Partial) or src.reduce_op in ("max", "min")
                if not isinstance(dst, Partial):
                    want = local_piece(x, [dst], mesh)
                    close(e.to_local(), want, what + " local", exact=exact)
                close(e, x, what, exact=exact)
    # async redistribute and forward_dtype
    x = g(6, 4, seed=5)
    d = distribute_tensor(x.to(DEV), mesh, [Shard(0)])
    e = d.redistribute(mesh, [Replicate()], async_op=True)
    close(e.to_local(), x, "async redistribute", exact=True)
    e = d.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16)
    assert e.dtype == torch.bfloat16
    close(e.to_local(), x.bfloat16(), "redistribute forward_dtype bf16", exact=True)
    ok("redistribute")


# ---- ops ----

def check_ops(mesh):
    # 8 columns: no rank holds an empty shard on 4 ranks (a full reduction of an empty local
    # shard raises in PyTorch on any device, e.g. amin without dim)
    a, b, c = g(8, 8, seed=1), g(8, 4, seed=2), g(8, 8, seed=3)
    da = {p: distribute_tensor(a.to(DEV), mesh, [p]) for p in (Shard(0), Shard(1), Replicate())}
    db = {p: distribute_tensor(b.to(DEV), mesh, [p]) for p in (Shard(0), Shard(1), Replicate())}
    dc = distribute_tensor(c.to(DEV), mesh, [Shard(0)])
    # matmul: S(0) x R -> S(0); R x S(1) -> S(1); S(1) x S(0) -> Partial
    for pa, pb, want_pl in [(Shard(0), Replicate(), Shard(0)), (Replicate(), Shard(1), Shard(1)),
                            (Shard(1), Shard(0), Partial())]:
        y = da[pa] @ db[pb]
        assert y.placements == (want_pl,), (pa, pb, y.placements)
        close(y, a @ b, f"mm {pa} x {pb}")
    w, bias = g(4, 8, seed=4), g(4, seed=5)
    dw = distribute_tensor(w.to(DEV), mesh, [Shard(0)])
    dbias = distribute_tensor(bias.to(DEV), mesh, [Shard(0)])
    close(F.linear(da[Replicate()], dw, dbias), F.linear(a, w, bias), "linear colwise")
    x3, w3 = g(2, 5, 8, seed=6), g(2, 8, 3, seed=8)
    d3 = distribute_tensor(x3.to(DEV), mesh, [Shard(0)])
    dw3 = distribute_tensor(w3.to(DEV), mesh, [Shard(0)])
    close(torch.bmm(d3, dw3), torch.bmm(x3, w3), "bmm batch-sharded")
    close(torch.matmul(distribute_tensor(x3.to(DEV), mesh, [Shard(1)]),
                       distribute_tensor(b[:, :3].contiguous().to(DEV), mesh, [Replicate()])),
          x3 @ b[:, :3], "matmul 3-D x 2-D")
    # elementwise, same and mixed placements, scalars, comparisons, where
    s0 = da[Shard(0)]
    close(s0 + dc, a + c, "add")
    close(s0 * 2.5 - 1, a * 2.5 - 1, "scalar ops")
    close(torch.exp(s0) / (1 + dc.abs()), torch.exp(a) / (1 + c.abs()), "exp div abs")
    close(F.gelu(s0) + F.silu(dc) + torch.tanh(s0), F.gelu(a) + F.silu(c) + torch.tanh(a),
          "gelu silu tanh")
    close(torch.where(s0 > dc, s0, dc), torch.where(a > c, a, c), "where gt")
    close(s0 + da[Replicate()], a + a, "add S(0) + R")
    close(s0.float().to(torch.bfloat16), a.to(torch.bfloat16), "cast bf16", exact=True)
    close(torch.rsqrt(s0.pow(2).mean(-1, keepdim=True) + 1e-6),
          torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6), "rms")
    # reductions over the sharded dim (Partial results) and others
    for p in (Shard(0), Shard(1)):
        d = da[p]
        close(d.sum(), a.sum(), f"sum all {p}")
        close(d.sum(0), a.sum(0), f"sum dim0 {p}")
        close(d.mean(1), a.mean(1), f"mean dim1 {p}")
        close(d.amax(0), a.amax(0), f"amax dim0 {p}", exact=True)
        close(d.amin(), a.amin(), f"amin all {p}", exact=True)
        close(torch.linalg.vector_norm(d), torch.linalg.vector_norm(a), f"norm {p}")
        close(d.max(dim=1).values, a.max(dim=1).values, f"max dim1 {p}", exact=True)
        close(d.var(dim=1), a.var(dim=1), f"var dim1 {p}")
        close(torch.argmax(d, dim=1), torch.argmax(a, dim=1), f"argmax dim1 {p}", exact=True)
        # softmax over and across the sharded dim
        close(F.softmax(d, dim=-1), F.softmax(a, dim=-1), f"softmax -1 {p}")
        close(F.log_softmax(d, dim=0), F.log_softmax(a, dim=0), f"log_softmax 0 {p}")
    close(F.layer_norm(s0, (8,)), F.layer_norm(a, (8,)), "layer_norm")
    # embedding: replicated weight + sharded ids; colwise (Shard(1)); rowwise (Shard(0))
    emb, ids = g(10, 6, seed=9), torch.randint(0, 10, (4, 5),
                                                generator=torch.Generator().manual_seed(9))
    did = distribute_tensor(ids.to(DEV), mesh, [Shard(0)])
    rid = distribute_tensor(ids.to(DEV), mesh, [Replicate()])
    for pw, dids in [(Replicate(), did), (Shard(1), rid), (Shard(0), rid)]:
        dw = distribute_tensor(emb.to(DEV), mesh, [pw])
        close(F.embedding(dids, dw), F.embedding(ids, emb), f"embedding weight {pw}",
              exact=True)
    # view ops
    # dims divisible by 2 and 4: DTensor refuses to merge or split an unevenly sharded dim
    # ("Cannot flatten unevenly sharded tensor", on any device)
    x = g(4, 8, 8, seed=11)
    for p in (Shard(0), Shard(1), Shard(2)):
        d = distribute_tensor(x.to(DEV), mesh, [p])
        close(d.view(4, 64), x.view(4, 64), f"view merge {p}", exact=True)
        close(d.reshape(4, 8, 4, 2), x.reshape(4, 8, 4, 2), f"reshape split {p}", exact=True)
        close(d.transpose(0, 2), x.transpose(0, 2), f"transpose {p}", exact=True)
        close(d.permute(2, 0, 1).contiguous(), x.permute(2, 0, 1), f"permute {p}", exact=True)
        close(d.flatten(), x.flatten(), f"flatten {p}", exact=True)
        close(d.unsqueeze(1).squeeze(1), x, f"unsqueeze squeeze {p}", exact=True)
        close(d[:, 1:4], x[:, 1:4], f"slice dim1 {p}", exact=True)
        close(d.chunk(2, dim=2)[1], x.chunk(2, dim=2)[1], f"chunk dim2 {p}", exact=True)
        close(torch.cat([d, d * 2], dim=1), torch.cat([x, x * 2], dim=1), f"cat {p}", exact=True)
        close(d.view(4, 8, 4, 2).transpose(1, 2).reshape(4, 4, 16),
              x.view(4, 8, 4, 2).transpose(1, 2).reshape(4, 4, 16), f"heads {p}", exact=True)
    # uneven shards through shape-preserving view ops
    x = g(4, 6, 5, seed=12)
    for p in (Shard(1), Shard(2)):
        d = distribute_tensor(x.to(DEV), mesh, [p])
        close(d.transpose(0, 2).contiguous(), x.transpose(0, 2), f"uneven transpose {p}",
              exact=True)
        close(d.unsqueeze(0)[0, :, 1:], x[:, 1:], f"uneven unsqueeze slice {p}", exact=True)
    # in-place ops on DTensors
    d = distribute_tensor(a.to(DEV), mesh, [Shard(0)])
    d.mul_(2).add_(dc)
    close(d, a * 2 + c, "in-place mul_ add_")
    d.zero_()
    close(d, torch.zeros_like(a), "zero_", exact=True)
    ok("ops")


# ---- autograd ----

def check_autograd(mesh):
    x, w1, w2 = g(8, 6, seed=21), g(12, 6, seed=22), g(4, 12, seed=23)
    emb, ids = g(10, 6, seed=24), torch.randint(0, 10, (8,),
                                                 generator=torch.Generator().manual_seed(24))

    def f(x, w1, w2, emb, ids):
        h = F.embedding(ids, emb) + x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = F.silu(F.linear(h, w1))
        y = F.linear(h, w2)
        # a mean loss: gradients of O(10), whose float32 rounding fits float32 tolerances (a
        # summed loss gave O(60) gradients, 1.8e-5 off float64 on CPU too)
        return F.cross_entropy(y, ids % 4) + (y.tanh() * y).mean()

    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, emb)]
    f(*leaves, ids).backward()
    # Megatron-style: w1 colwise (Shard(0)), w2 rowwise (Shard(1)), x sharded on the batch
    plans = [
        [Shard(0), Shard(0), Shard(1), Replicate()],
        [Replicate(), Shard(0), Shard(1), Shard(1)],
        [Shard(0), Replicate(), Replicate(), Shard(0)],
    ]
    for pl in plans:
        ds = [distribute_tensor(t.to(DEV), mesh, [p]).requires_grad_()
              for t, p in zip((x, w1, w2, emb), pl)]
        did = distribute_tensor(ids.to(DEV), mesh, [Replicate()])
        loss = f(*ds, did)
        close(loss, f(x, w1, w2, emb, ids).detach(), f"loss {pl}")
        loss.backward()
        for name, d, ref in zip(("x", "w1", "w2", "emb"), ds, leaves):
            assert isinstance(d.grad, DTensor), name
            close(d.grad, ref.grad, f"grad {name} {pl}")
    # from_local / to_local / redistribute / full_tensor backward
    xs = x.clone().requires_grad_()
    (xs.sin() * torch.arange(6.0)).sum().backward()
    loc = local_piece(x, [Shard(0)], mesh).to(DEV).requires_grad_()
    d = DTensor.from_local(loc, mesh, [Shard(0)])
    full = d.redistribute(mesh, [Replicate()]).to_local()
    (full.sin() * torch.arange(6.0, device=DEV)).sum().backward()
    # a Replicate gradient is the same on every rank: its Shard(0) piece, no reduction
    close(loc.grad, local_piece(xs.grad, [Shard(0)], mesh), "from_local/redistribute grad")
    loc2 = local_piece(x, [Shard(0)], mesh).to(DEV).requires_grad_()
    ft = DTensor.from_local(loc2, mesh, [Shard(0)]).full_tensor()
    (ft.sin() * torch.arange(6.0, device=DEV)).sum().backward()
    close(loc2.grad, local_piece(xs.grad, [Shard(0)], mesh), "full_tensor grad")
    d = distribute_tensor(x.to(DEV), mesh, [Shard(0)]).requires_grad_()
    t = d.to_local(grad_placements=[Shard(0)])
    (t * 3).sum().backward()
    close(d.grad, torch.full_like(x, 3.0), "to_local grad_placements", exact=True)
    ok("autograd")


def check_random(mesh):
    import torch.distributed.tensor as dt
    torch.manual_seed(1234)
    rep = dt.randn(16, 8, device_mesh=mesh, placements=[Replicate()])
    sh = dt.rand(16, 8, device_mesh=mesh, placements=[Shard(0)])
    every = [None] * mesh.size()
    dist.all_gather_object(every, (rep.to_local().cpu(), sh.to_local().cpu()),
                           group=mesh.get_group())
    for r in range(1, mesh.size()):
        assert torch.equal(every[r][0], every[0][0]), "replicated random values differ"
        assert not torch.equal(every[r][1], every[0][1]), "shards drew the same values"
    full = sh.full_tensor().cpu()
    assert 0 <= full.min() and full.max() < 1 and full.std() > 0.2
    # nn.init on a DTensor parameter keeps replicas identical
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 6, device=DEV), mesh, [Replicate()]))
    torch.nn.init.normal_(p)
    dist.all_gather_object(every, p.to_local().detach().cpu(), group=mesh.get_group())
    assert all(torch.equal(e, every[0]) for e in every) and every[0].std() > 0.3
    ok("random")


def check_mesh2d(world):
    dp = world // 2
    mesh = init_device_mesh("tpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    assert mesh.device_type == "tpu" and mesh.mesh_dim_names == ("dp", "tp")
    assert mesh["tp"].size() == 2 and mesh["dp"].size() == dp
    x = g(8, 6, seed=31)
    for pl in [[Replicate(), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Replicate()],
               [Shard(0), Shard(0)], [Replicate(), Replicate()]]:
        d = distribute_tensor(x.to(DEV), mesh, pl)
        close(d.to_local(), local_piece(x, pl, mesh), f"2-D to_local {pl}", exact=True)
        for dst in [[Replicate(), Replicate()], [Shard(1), Shard(0)], [Replicate(), Shard(1)],
                    [Shard(0), Replicate()]]:
            close(d.redistribute(mesh, dst), x, f"2-D redistribute {pl} -> {dst}", exact=True)
    # partial on both dims
    parts = {r: g(8, 6, seed=300 + r) for r in range(world)}
    d = DTensor.from_local(parts[dist.get_rank()].to(DEV), mesh, [Partial(), Partial()])
    close(d.redistribute(mesh, [Shard(0), Replicate()]), sum(parts.values()), "2-D P,P -> S,R")
    # ops on the 2-D mesh
    w = g(6, 10, seed=32)
    dx = distribute_tensor(x.to(DEV), mesh, [Shard(0), Replicate()])
    dw = distribute_tensor(w.to(DEV), mesh, [Replicate(), Shard(1)])
    y = dx @ dw
    assert y.placements == (Shard(0), Shard(1)), y.placements
    close(y, x @ w, "2-D mm")
    close(F.softmax(y, -1).sum(0), F.softmax(x @ w, -1).sum(0), "2-D softmax sum")
    # 1-D sub-meshes behave like a 1-D mesh
    tp = mesh["tp"]
    d = distribute_tensor(x.to(DEV), tp, [Shard(1)])
    close(d, x, "mesh['tp'] full_tensor", exact=True)
    close(d @ distribute_tensor(w.to(DEV), tp, [Shard(0)]), x @ w, "mesh['tp'] mm partial")
    ok("mesh2d")


def main():
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="strict")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.tpu.set_device(local)
    DEV = torch.device("tpu", local)
    if args.mode == "fused":
        torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    mesh = init_device_mesh("tpu", (world,))
    assert mesh.device_type == "tpu" and mesh.size() == world
    checks = {"layout": lambda: check_layout(mesh),
              "redistribute": lambda: check_redistribute(mesh),
              "ops": lambda: check_ops(mesh),
              "autograd": lambda: check_autograd(mesh),
              "random": lambda: check_random(mesh),
              "mesh2d": lambda: check_mesh2d(world)}
    only = [c for c in args.only.split(",") if c]
    for name, fn in checks.items():
        if not only or name in only:
            fn()
    torch.tpu.synchronize()
    dist.barrier()
    fb = torch.tpu.metrics()["per_op"].get("cpu_fallbacks", {})
    if dist.get_rank() == 0:
        print("cpu fallbacks:", dict(fb) if fb else {}, flush=True)
        print("ALL OK", len(checked), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
