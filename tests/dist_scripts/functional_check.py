"""Functional collectives on "tpu" (eager, Fused, compiled) against a CPU reference.

Run under torchrun (or with RANK/WORLD_SIZE/MASTER_* set). Each rank's input is a deterministic
function of (rank, case), so every rank computes the expected result on CPU from all ranks'
inputs. Eager: the ``_c10d_functional`` kernels run as device kernels (no host sync); compiled:
``torch.compile(backend="tpu")`` graphs hold the collectives as lowerings (the compile metrics
count them; no CPU fallback). Prints "OK <case>" per check and "ALL OK <n>" at the end.
Usage: functional_check.py [part ...] (parts: eager fused compiled_one compiled train
fsdp_compiled tp_compiled; default: all).
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

c10d = torch.ops._c10d_functional
checked = []


def inp(rank, shape, salt=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype == torch.int64:
        return torch.randint(-50, 50, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def close(got, want, what):
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
    torch.testing.assert_close(got, want, msg=lambda s: f"rank {dist.get_rank()} {what}: {s}")


def ok(name):
    checked.append(name)
    if dist.get_rank() == 0:
        print("OK", name, flush=True)


def counters():
    m = torch.tpu.metrics()
    return dict(m["counters"]), {k: dict(v) for k, v in m["per_op"].items()}


class Ctx:
    def __init__(self, rank, n, dev):
        self.rank, self.n, self.dev = rank, n, dev
        self.group = dist.group.WORLD

    def all_in(self, shape, salt, dtype=torch.float32):
        return [inp(r, shape, salt, dtype) for r in range(self.n)]

    def mine(self, shape, salt, dtype=torch.float32):
        return inp(self.rank, shape, salt, dtype).to(self.dev)


# ---- the collectives: (name, run(ctx, x...) on tpu, reference from every rank's CPU input) ----

def cases(c):
    n, r = c.n, c.rank
    g = c.group
    red = {"sum": lambda v: sum(v[1:], v[0]), "avg": lambda v: sum(v[1:], v[0]) / n,
           "max": lambda v: torch.stack(v).amax(0), "min": lambda v: torch.stack(v).amin(0),
           "product": lambda v: torch.stack(v).prod(0)}
    out = []
    for op, f in red.items():
        out.append((f"all_reduce_{op}", (4, 3),
                    lambda x, op=op: funcol.all_reduce(x, op, g),
                    lambda v, f=f: f(v)))
    out += [
        ("all_reduce_0d", (), lambda x: funcol.all_reduce(x, "sum", g), red["sum"]),
        ("all_gather_tensor", (2, 5), lambda x: funcol.all_gather_tensor(x, 0, g),
         lambda v: torch.cat(v, 0)),
        ("all_gather_tensor_dim1", (2, 3), lambda x: funcol.all_gather_tensor(x, 1, g),
         lambda v: torch.cat(v, 1)),
        ("reduce_scatter_sum", (2 * n, 3),
         lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, g),
         lambda v: red["sum"](v).chunk(n, 0)[r]),
        ("reduce_scatter_avg", (2 * n, 3),
         lambda x: funcol.reduce_scatter_tensor(x, "avg", 0, g),
         lambda v: red["avg"](v).chunk(n, 0)[r]),
        ("reduce_scatter_dim1", (3, 2 * n),
         lambda x: funcol.reduce_scatter_tensor(x, "sum", 1, g),
         lambda v: red["sum"](v).chunk(n, 1)[r]),
        ("all_to_all_single", (2 * n, 3),
         lambda x: funcol.all_to_all_single(x, None, None, g),
         lambda v: torch.cat([v[j].chunk(n, 0)[r] for j in range(n)], 0)),
        ("broadcast", (3, 2), lambda x: funcol.broadcast(x, 1 % n, g), lambda v: v[1 % n]),
        ("permute_tensor", (6,),  # (split sizes in elements: 1-D, as on CUDA)
         lambda x: funcol.permute_tensor(x, [(i + 1) % n for i in range(n)], g),
         lambda v: v[(r - 1) % n]),
        ("all_reduce_int64", (5,), lambda x: funcol.all_reduce(x.long() * 3, "sum", g),
         lambda v: red["sum"]([t.long() * 3 for t in v])),
    ]
    return out


def coalesced_cases(c):
    n, r, g = c.n, c.rank, c.group
    return [
        ("all_reduce_coalesced", [(3,), (2, 2)],
         lambda xs: funcol.all_reduce_coalesced(xs, "sum", g),
         lambda vs: [sum(v[1:], v[0]) for v in vs]),
        ("all_gather_into_tensor_coalesced", [(2,), (1, 3)],
         lambda xs: funcol.all_gather_into_tensor_coalesced(xs, g),
         lambda vs: [torch.cat(v, 0) for v in vs]),
        ("reduce_scatter_tensor_coalesced", [(2 * n,), (n, 3)],
         lambda xs: funcol.reduce_scatter_tensor_coalesced(xs, "sum", [0, 0], g),
         lambda vs: [sum(v[1:], v[0]).chunk(n, 0)[r] for v in vs]),
    ]


def run_all(c, prefix, wrap):
    """Every case through ``wrap(fn)`` (identity for eager, torch.compile for compiled)."""
    for k, (name, shape, fn, ref) in enumerate(cases(c)):
        vals = c.all_in(shape, k)
        got = wrap(fn)(vals[c.rank].to(c.dev))
        if isinstance(got, funcol.AsyncCollectiveTensor):
            got = got.wait()
        close(got, ref(vals), f"{prefix} {name}")
        ok(f"{prefix} {name}")
    for k, (name, shapes, fn, ref) in enumerate(coalesced_cases(c)):
        vals = [c.all_in(s, 100 + 10 * k + i) for i, s in enumerate(shapes)]
        got = wrap(fn)([v[c.rank].to(c.dev) for v in vals])
        want = ref(vals)
        for i, (a, b) in enumerate(zip(got, want)):
            close(a.wait() if isinstance(a, funcol.AsyncCollectiveTensor) else a, b,
                  f"{prefix} {name}[{i}]")
        ok(f"{prefix} {name}")


# ---- eager ----

def eager(c):
    before, _ = counters()
    x = c.mine((4, 3), 7)
    y = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", c.group.group_name))
    z = c10d.all_gather_into_tensor(y + 1, c.n, c.group.group_name)
    z = c10d.wait_tensor(z)
    after, _ = counters()
    # device kernels: nothing came back to the host, the programs ran on the device
    assert after.get("host_syncs", 0) == before.get("host_syncs", 0), (before, after)
    vals = c.all_in((4, 3), 7)
    want_y = sum(v * 2 for v in vals)
    close(y, want_y, "eager ops all_reduce")
    close(z, torch.cat([want_y + 1] * c.n, 0), "eager ops all_gather_into_tensor")
    ok("eager _c10d_functional ops (no host sync)")

    # in-place and out= overloads
    vals = c.all_in((3, 2), 8)
    t = vals[c.rank].to(c.dev)
    c10d.wait_tensor(c10d.all_reduce_(t, "max", c.group.group_name))
    close(t, torch.stack(vals).amax(0), "eager all_reduce_")
    t = vals[c.rank].to(c.dev)
    c10d.wait_tensor(c10d.broadcast_(t, 0, c.group.group_name))
    close(t, vals[0], "eager broadcast_")
    out = torch.empty(3 * c.n, 2, device=c.dev)
    c10d.wait_tensor(c10d.all_gather_into_tensor_out(vals[c.rank].to(c.dev), c.n,
                                                     c.group.group_name, out=out))
    close(out, torch.cat(vals, 0), "eager all_gather_into_tensor_out")
    ok("eager in-place and out= overloads")

    run_all(c, "eager", lambda f: f)

    # uneven all_to_all_single: rank i sends (j + 1) rows to rank j
    ins = [[j + 1 for j in range(c.n)] for _ in range(c.n)]
    vals = [inp(i, (sum(ins[i]), 2), 30) for i in range(c.n)]
    outs = [ins[j][c.rank] for j in range(c.n)]
    got = funcol.all_to_all_single(vals[c.rank].to(c.dev), outs, ins[c.rank], c.group)
    want = torch.cat([vals[j].split(ins[j], 0)[c.rank] for j in range(c.n)], 0)
    close(got.wait(), want, "eager all_to_all_single uneven")
    ok("eager all_to_all_single uneven")

    autograd_cases(c, "eager", lambda f: f)


def autograd_cases(c, prefix, wrap):
    """The autograd variants: forward and input gradient against CPU."""
    n, r, g = c.n, c.rank, c.group

    def ag(x):
        return (funcol.all_gather_tensor_autograd(x, 0, g) ** 2).sum()

    def rs(x):
        return (funcol.reduce_scatter_tensor_autograd(x, "sum", 0, g) ** 2).sum()

    def a2a(x):
        return (funcol.all_to_all_single_autograd(x, None, None, g) ** 2).sum()

    vals = c.all_in((2 * n, 3), 40)
    for name, fn in (("all_gather_tensor_autograd", ag),
                     ("reduce_scatter_tensor_autograd", rs),
                     ("all_to_all_single_autograd", a2a)):
        x = vals[r].to(c.dev).requires_grad_()
        loss = wrap(fn)(x)
        loss.backward()
        # CPU: the same computation with every rank's tensor at hand
        xs = [v.clone().requires_grad_() for v in vals]
        if name.startswith("all_gather"):
            want_losses = [(torch.cat(xs, 0) ** 2).sum()] * n
            # the gradient of the gathered tensor is reduce-scattered (summed over ranks)
            tot = sum(want_losses[1:], want_losses[0])
        elif name.startswith("reduce_scatter"):
            s = sum(xs[1:], xs[0])
            want_losses = [(s.chunk(n, 0)[i] ** 2).sum() for i in range(n)]
            tot = sum(want_losses[1:], want_losses[0])
        else:
            want_losses = [(torch.cat([xs[j].chunk(n, 0)[i] for j in range(n)], 0) ** 2).sum()
                           for i in range(n)]
            tot = sum(want_losses[1:], want_losses[0])
        tot.backward()
        close(loss, want_losses[r].detach(), f"{prefix} {name} forward")
        close(x.grad, xs[r].grad, f"{prefix} {name} gradient")
        ok(f"{prefix} {name}")


# ---- Fused eager: the graph is cut around collectives ----

def fused(c):
    vals = c.all_in((4, 3), 50)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        x = vals[c.rank].to(c.dev)
        a = x * 2 + 1
        b = funcol.all_reduce(a, "sum", c.group).wait()
        d = torch.relu(b) - x
        e = funcol.all_gather_tensor(d * 3, 0, c.group).wait()
        f = e.sum(0)
        t = x.clone()
        dist.all_reduce(t)  # the c10d in-place collective too
        t = t * 0.5
        res = (f.cpu(), d.cpu(), t.cpu())
    b_ref = sum(v * 2 + 1 for v in vals)
    d_ref = torch.relu(b_ref) - vals[c.rank]
    e_ref = torch.cat([(torch.relu(b_ref) - v) * 3 for v in vals], 0)
    close(res[1], d_ref, "fused all_reduce")
    close(res[0], e_ref.sum(0), "fused all_gather")
    close(res[2], sum(vals) * 0.5, "fused dist.all_reduce")
    ok("fused eager around collectives")


# ---- compiled ----

def compiled(c):
    torch._dynamo.reset()
    before, pb = counters()

    def wrap(fn):
        return torch.compile(fn, backend="tpu", fullgraph=True)

    run_all(c, "compiled", wrap)
    lowered_check(before, pb, ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                               "all_to_all_single", "broadcast", "all_reduce_coalesced",
                               "all_gather_into_tensor_coalesced",
                               "reduce_scatter_tensor_coalesced"))
    autograd_cases(c, "compiled", lambda fn: torch.compile(fn, backend="tpu"))


def lowered_check(before, pb, ops):
    after, pa = counters()
    low = {k: v - pb.get("compile_collectives", {}).get(k, 0)
           for k, v in pa.get("compile_collectives", {}).items()}
    fb = pa.get("compile_cpu_fallbacks", {})
    assert not any("c10d" in k for k in fb), f"collectives ran as CPU callbacks: {fb}"
    for op in ops:
        assert low.get(f"_c10d_functional::{op}.default", 0) > 0, (op, low)
    assert after.get("compile_spmd_programs", 0) > before.get("compile_spmd_programs", 0)
    ok(f"compiled collectives lowered into the programs {sorted(low.items())}")


def compiled_one(c):
    """Compute and every kind of collective in one compiled program (fast: one compile)."""
    torch._dynamo.reset()
    before, pb = counters()
    n, r, g = c.n, c.rank, c.group

    def step(x, w):
        h = torch.tanh(x @ w)  # (2n, 5)
        dist.all_reduce(h)  # the c10d in-place API: Dynamo rewrites it to a functional one
        a = funcol.all_gather_tensor(h.relu(), 0, g)
        b = funcol.reduce_scatter_tensor(h * 3, "avg", 0, g)
        d = funcol.all_to_all_single(h - 1, None, None, g)
        e = funcol.broadcast(x[:, :2] * 2, 1 % n, g)
        f, k = funcol.all_reduce_coalesced([x.sum(0), w], "max", g)
        return (h * 2).sum(1), a, b, d, e, f, k

    vals = c.all_in((2 * n, 3), 60)
    ws = c.all_in((3, 5), 61)
    cf = torch.compile(step, backend="tpu", fullgraph=True)
    for _ in range(2):  # the second call reuses the program (the order token's path)
        got = [t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
               for t in cf(vals[r].to(c.dev), ws[r].to(c.dev))]
    hs = [torch.tanh(v @ w) for v, w in zip(vals, ws)]
    h = sum(hs[1:], hs[0])
    want = [(h * 2).sum(1), torch.cat([h.relu()] * n, 0), (h * 3).chunk(n, 0)[r],
            torch.cat([(h - 1).chunk(n, 0)[r]] * n, 0), vals[1 % n][:, :2] * 2,
            torch.stack([v.sum(0) for v in vals]).amax(0), torch.stack(ws).amax(0)]
    for i, (a, b) in enumerate(zip(got, want)):
        close(a, b, f"compiled one program output {i}")
    ok("compiled compute + all_reduce/all_gather/reduce_scatter/all_to_all/broadcast/coalesced "
       "in one program")
    lowered_check(before, pb, ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                               "all_to_all_single", "broadcast", "all_reduce_coalesced"))

    # an input overwritten by an in-place collective (its buffer donated to the program)
    def inplace(t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t * 2

    vals = c.all_in((3, 4), 62)
    cf = torch.compile(inplace, backend="tpu", fullgraph=True)
    for i in range(2):
        t = (vals[r] + i).to(c.dev)
        got = cf(t)
        want = torch.stack(vals).amax(0) + i
        close(t, want, "compiled in-place all_reduce: the input")
        close(got, want * 2, "compiled in-place all_reduce: the output")
    ok("compiled in-place all_reduce of an input")


# ---- a compiled tensor-parallel MLP trained with SGD vs one CPU process ----

class ColRow(nn.Module):
    """y = relu(x @ W1[:, shard]) @ W2[shard, :], summed over ranks (Megatron MLP)."""

    def __init__(self, w1, w2, group):
        super().__init__()
        self.w1 = nn.Parameter(w1)
        self.w2 = nn.Parameter(w2)
        self.group = group

    def forward(self, x):
        h = torch.relu(x @ self.w1)
        y = h @ self.w2
        return funcol.all_reduce(y, "sum", self.group)


def train(c):
    """The same TP MLP trained on CPU tensors over gloo (PyTorch's semantics), on tpu in eager
    and compiled: parameters equal after 3 SGD steps."""
    n, r = c.n, c.rank
    g = torch.Generator().manual_seed(5)
    w1 = torch.randn(6, 8 * n, generator=g) * 0.3
    w2 = torch.randn(8 * n, 4, generator=g) * 0.3
    data = [(torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)) for _ in range(3)]

    def run(dev, group, compile_it):
        m = ColRow(w1.chunk(n, 1)[r].clone(), w2.chunk(n, 0)[r].clone(), group).to(dev)
        f = torch.compile(m, backend="tpu") if compile_it else m
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(f(x.to(dev)), y.to(dev)).backward()
            opt.step()
        return [p.detach().cpu() for p in m.parameters()]

    gloo = dist.new_group(backend="gloo")
    want = run(torch.device("cpu"), gloo, False)
    for mode in ("eager", "compiled"):
        got = run(c.dev, c.group, mode == "compiled")
        for name, a, b in zip(("w1", "w2"), got, want):
            close(a, b, f"{mode} TP MLP {name}")
    ok("tensor-parallel MLP, 3 SGD steps, eager and compiled vs CPU gloo")


# ---- torch.compile of FSDP2 and tensor-parallel (DTensor) models vs one CPU process ----

class MLP(nn.Module):
    def __init__(self, d=8, h=16, d_in=6, d_out=3, blocks=2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for _ in range(blocks))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


STEPS, BATCH = 3, 8


def batches():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g))
            for _ in range(STEPS)]


def reference(init):
    """One CPU process on the full batches."""
    import copy

    m = copy.deepcopy(init)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return dict(m.named_parameters())


def compiled_training(c, m, x_of, what, compile_root=True, foreach=None):
    """Train ``m`` compiled for STEPS AdamW steps; check graphs were compiled and every
    parameter's full value equals the CPU reference (``c.init``)."""
    from torch._dynamo.utils import counters as dyn

    torch._dynamo.reset()
    g0 = torch.tpu.metrics()["counters"].get("compile_graphs", 0)
    a0 = dyn["aot_autograd"]["total"]
    cm = torch.compile(m, backend="tpu") if compile_root else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=foreach)
    for x, y in batches():
        opt.zero_grad()
        xx, yy = x_of(x, y)
        nn.functional.mse_loss(cm(xx), yy).backward()
        opt.step()
    graphs = torch.tpu.metrics()["counters"].get("compile_graphs", 0) - g0
    assert graphs >= 2 and dyn["aot_autograd"]["total"] > a0, (what, graphs, {k: dict(v) for k, v in dyn.items()})
    ref = reference(c.init)
    for name, p in m.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        close(full, ref[name.replace("_orig_mod.", "")].detach(), f"{what} {name}")
    return graphs


def fsdp_compiled(c):
    """Blocks compiled, then fully_shard per block and at the root (TorchTitan's order: FSDP2's
    hooks sit on the compiled module's wrapper and run eagerly around the compiled graphs; a
    whole model compiled over FSDP2 breaks its graph in the blocks' loop, which makes Dynamo
    skip the frame: torch 2.13 does the same on CUDA)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    c.init = MLP()
    mesh = init_device_mesh("tpu", (c.n,))
    m = copy.deepcopy(c.init).to(c.dev)
    for i, b in enumerate(m.blocks):
        m.blocks[i] = torch.compile(b, backend="tpu")
        fully_shard(m.blocks[i], mesh=mesh)
    fully_shard(m, mesh=mesh)
    sl = slice(c.rank * BATCH // c.n, (c.rank + 1) * BATCH // c.n)
    graphs = compiled_training(c, m, lambda x, y: (x[sl].to(c.dev), y[sl].to(c.dev)),
                               "compiled FSDP2", compile_root=False)
    ok(f"compiled FSDP2 model ({graphs} graphs), {STEPS} AdamW steps vs one CPU process")


def tp_compiled(c):
    """ColwiseParallel / RowwiseParallel blocks (DTensor parameters) compiled: the DTensor
    collectives become _c10d_functional nodes lowered into the graphs."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    c.init = MLP()
    mesh = init_device_mesh("tpu", (c.n,))
    m = copy.deepcopy(c.init).to(c.dev)
    for b in m.blocks:
        parallelize_module(b, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    before, pb = counters()
    # (foreach=False: the blocks' parameters are DTensors, the others plain tensors, which
    # one foreach op cannot mix, on CUDA too)
    graphs = compiled_training(c, m, lambda x, y: (x.to(c.dev), y.to(c.dev)),
                               "compiled TP", foreach=False)
    lowered_check(before, pb, ("all_reduce",))
    ok(f"compiled tensor-parallel model ({graphs} graphs), {STEPS} AdamW steps vs one CPU "
       "process")


def main():
    parts = sys.argv[1:] or ["eager", "fused", "compiled_one", "compiled", "train",
                            "fsdp_compiled", "tp_compiled"]
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    c = Ctx(rank, n, torch.device("tpu", local))
    for p in parts:
        globals()[p](c)
    dist.destroy_process_group()
    if rank == 0:
        print("ALL OK", len(checked), flush=True)


if __name__ == "__main__":
    main()
