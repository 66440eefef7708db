"""Every c10d collective on "tpu_dist" against a single-process CPU reference.

Run under torchrun (or spawned with RANK/WORLD_SIZE/MASTER_* set). Each rank's input is a
deterministic function of (rank, case), so every rank computes the expected result on CPU from
all ranks' inputs. Prints "OK <case>" per check and "ALL OK <n>" at the end; any mismatch
raises (non-zero exit). Usage: collectives_check.py [--mode strict|fused] [--init default]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import operator
import os

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
R = dist.ReduceOp
checked = []


def inp(rank, shape, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        # small integers: exact in every float dtype, so sums do not depend on the order
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def same(got, want, what):
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"rank {dist.get_rank()} {what}: got {got} want {want}")


def ok(name):
    checked.append(name)
    if dist.get_rank() == 0:
        print("OK", name, flush=True)


def reduce_ref(vals, op, dtype):
    if dtype == torch.bool:
        if op in (R.SUM, R.MAX, R.BOR):
            return functools.reduce(operator.or_, vals)
        if op in (R.MIN, R.PRODUCT, R.BAND):
            return functools.reduce(operator.and_, vals)
        return functools.reduce(operator.xor, vals)
    f = {R.SUM: operator.add, R.PRODUCT: operator.mul, R.MIN: torch.minimum,
         R.MAX: torch.maximum, R.BAND: operator.and_, R.BOR: operator.or_,
         R.BXOR: operator.xor}
    if op == R.AVG:
        return (functools.reduce(operator.add, vals) / len(vals)).to(dtype)
    return functools.reduce(f[op], vals)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="strict")
    ap.add_argument("--init", default="tpu_dist")
    ap.add_argument("--dtypes", default=",".join(str(d).split(".")[1] for d in DTYPES),
                    help="comma-separated subset of the dtypes to check")
    a = ap.parse_args()
    DTYPES[:] = [getattr(torch, d) for d in a.dtypes.split(",")]
    if a.init == "default":
        dist.init_process_group(timeout=datetime.timedelta(seconds=120))
    else:
        dist.init_process_group(a.init, timeout=datetime.timedelta(seconds=120))
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    from torchtpu.distributed.process_group import ProcessGroupTPU

    # with no backend named, torch records "undefined" but creates the device's default group
    assert dist.get_backend() == ("tpu_dist" if a.init == "tpu_dist" else "undefined")
    assert isinstance(dist.group.WORLD, ProcessGroupTPU), dist.group.WORLD
    if a.mode == "fused":
        torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    ranks = range(n)

    # all_reduce: every op on every dtype it is defined for
    for dt in DTYPES:
        ops = [R.SUM, R.MIN, R.MAX, R.PRODUCT]
        if dt.is_floating_point:
            ops.append(R.AVG)
        if not dt.is_floating_point:
            ops += [R.BAND, R.BOR, R.BXOR]
        for op in ops:
            x = inp(rank, (3, 5), dt, 1).to(dev)
            if dt.is_floating_point and op == R.PRODUCT:
                x = inp(rank, (3, 5), dt, 1).clamp(-2, 2).to(dev)
            dist.all_reduce(x, op=op)
            vals = [inp(r, (3, 5), dt, 1) for r in ranks]
            if dt.is_floating_point and op == R.PRODUCT:
                vals = [v.clamp(-2, 2) for v in vals]
            same(x, reduce_ref(vals, op, dt), f"all_reduce {op} {dt}")
        ok(f"all_reduce {dt}")
    # PREMUL_SUM (what DDP's gradient averaging and FSDP use)
    x = inp(rank, (4,), torch.float32, 2).to(dev)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
    same(x, sum(inp(r, (4,), torch.float32, 2) * 0.5 for r in ranks), "premul_sum")
    ok("all_reduce PREMUL_SUM")
    # a strided view and a 0-dim tensor; the rest of the storage must stay untouched
    base = inp(rank, (4, 6), torch.float32, 3).to(dev)
    col = base[:, 1]
    dist.all_reduce(col)
    want = inp(rank, (4, 6), torch.float32, 3)
    want[:, 1] = sum(inp(r, (4, 6), torch.float32, 3)[:, 1] for r in ranks)
    same(base, want, "all_reduce of a view")
    s = torch.tensor(float(rank + 1), device=dev)
    dist.all_reduce(s)
    same(s, torch.tensor(float(sum(r + 1 for r in ranks))), "0-dim")
    ok("all_reduce view and 0-dim")
    # async work
    x = inp(rank, (8,), torch.float32, 4).to(dev)
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    assert w.is_completed()
    fut = w.get_future()
    fut.wait()
    same(x, sum(inp(r, (8,), torch.float32, 4) for r in ranks), "async all_reduce")
    same(fut.value()[0], sum(inp(r, (8,), torch.float32, 4) for r in ranks), "future value")
    ok("async_op work")
    # coalesced all_reduce
    xs = [inp(rank, (3,), torch.float32, 5).to(dev), inp(rank, (2, 2), torch.float32, 6).to(dev)]
    dist.all_reduce_coalesced(xs)
    same(xs[0], sum(inp(r, (3,), torch.float32, 5) for r in ranks), "coalesced 0")
    same(xs[1], sum(inp(r, (2, 2), torch.float32, 6) for r in ranks), "coalesced 1")
    ok("all_reduce_coalesced")

    for dt in DTYPES:
        # all_gather / all_gather_into_tensor
        x = inp(rank, (2, 3), dt, 7).to(dev)
        outs = [torch.empty(2, 3, dtype=dt, device=dev) for _ in ranks]
        dist.all_gather(outs, x)
        for r in ranks:
            same(outs[r], inp(r, (2, 3), dt, 7), f"all_gather {dt}")
        big = torch.empty(2 * n, 3, dtype=dt, device=dev)
        dist.all_gather_into_tensor(big, x)
        same(big, torch.cat([inp(r, (2, 3), dt, 7) for r in ranks]), "all_gather_into_tensor")
        stacked = torch.empty(n, 2, 3, dtype=dt, device=dev)
        dist.all_gather_into_tensor(stacked, x)
        same(stacked, torch.stack([inp(r, (2, 3), dt, 7) for r in ranks]), "into stacked")
        # broadcast from every root
        for src in ranks:
            x = inp(rank, (5,), dt, 8).to(dev)
            dist.broadcast(x, src=src)
            same(x, inp(src, (5,), dt, 8), f"broadcast {dt} from {src}")
        # all_to_all_single, even
        x = inp(rank, (2 * n, 3), dt, 9).to(dev)
        y = torch.empty(2 * n, 3, dtype=dt, device=dev)
        dist.all_to_all_single(y, x)
        same(y, torch.cat([inp(r, (2 * n, 3), dt, 9)[2 * rank:2 * rank + 2] for r in ranks]),
             f"all_to_all_single {dt}")
        ok(f"all_gather / broadcast / all_to_all_single {dt}")
    # -0.0, inf and nan survive broadcast bit for bit
    x = torch.tensor([-0.0, float("inf"), float("nan"), 1e-40], device=dev) if rank == 0 else \
        torch.zeros(4, device=dev)
    dist.broadcast(x, src=0)
    got = x.cpu()
    assert torch.equal(got.view(torch.int32),
                       torch.tensor([-0.0, float("inf"), float("nan"), 1e-40]).view(torch.int32))
    ok("broadcast bit-exact")

    for dt in [d for d in DTYPES if d != torch.bool]:
        for op in [R.SUM, R.MAX] + ([R.AVG] if dt.is_floating_point else []):
            # reduce_scatter_tensor and reduce_scatter (list)
            x = inp(rank, (2 * n, 3), dt, 10).to(dev)
            y = torch.empty(2, 3, dtype=dt, device=dev)
            dist.reduce_scatter_tensor(y, x, op=op)
            full = reduce_ref([inp(r, (2 * n, 3), dt, 10) for r in ranks], op, dt)
            same(y, full[2 * rank:2 * rank + 2], f"reduce_scatter_tensor {dt} {op}")
            xs = [inp(rank, (4,), dt, 11 + j).to(dev) for j in ranks]
            y = torch.empty(4, dtype=dt, device=dev)
            dist.reduce_scatter(y, xs, op=op)
            same(y, reduce_ref([inp(r, (4,), dt, 11 + rank) for r in ranks], op, dt),
                 f"reduce_scatter {dt} {op}")
        ok(f"reduce_scatter {dt}")

    # reduce, gather, scatter to/from every root
    for root in ranks:
        x = inp(rank, (3,), torch.float32, 20).to(dev)
        dist.reduce(x, dst=root)
        if rank == root:
            same(x, sum(inp(r, (3,), torch.float32, 20) for r in ranks), "reduce")
        x = inp(rank, (2, 2), torch.int64, 21).to(dev)
        outs = [torch.empty(2, 2, dtype=torch.int64, device=dev) for _ in ranks] \
            if rank == root else None
        dist.gather(x, outs, dst=root)
        if rank == root:
            for r in ranks:
                same(outs[r], inp(r, (2, 2), torch.int64, 21), "gather")
        ins = [inp(root, (3,), torch.float32, 30 + j).to(dev) for j in ranks] \
            if rank == root else None
        y = torch.empty(3, device=dev)
        dist.scatter(y, ins, src=root)
        same(y, inp(root, (3,), torch.float32, 30 + rank), "scatter")
    ok("reduce / gather / scatter")

    # all_to_all (list) and all_to_all_single with uneven splits
    xs = [inp(rank, (2,), torch.float32, 40 + j).to(dev) for j in ranks]
    ys = [torch.empty(2, device=dev) for _ in ranks]
    dist.all_to_all(ys, xs)
    for r in ranks:
        same(ys[r], inp(r, (2,), torch.float32, 40 + rank), "all_to_all")
    in_splits = [(rank + j) % 3 + 1 for j in ranks]  # rank sends in_splits[j] rows to j
    out_splits = [(r + rank) % 3 + 1 for r in ranks]
    x = inp(rank, (sum(in_splits), 2), torch.float32, 50).to(dev)
    y = torch.empty(sum(out_splits), 2, device=dev)
    dist.all_to_all_single(y, x, out_splits, in_splits)
    want = []
    for r in ranks:
        sp = [(r + j) % 3 + 1 for j in ranks]
        xr = inp(r, (sum(sp), 2), torch.float32, 50)
        want.append(xr[sum(sp[:rank]):sum(sp[:rank + 1])])
    same(y, torch.cat(want), "all_to_all_single uneven")
    xs = [inp(rank, (j + 1,), torch.float32, 60 + j).to(dev) for j in ranks]
    ys = [torch.empty(rank + 1, device=dev) for _ in ranks]
    dist.all_to_all(ys, xs)
    for r in ranks:
        same(ys[r], inp(r, (rank + 1,), torch.float32, 60 + rank), "all_to_all uneven")
    ok("all_to_all uneven")

    # point to point: blocking pairs, a ring with isend/irecv and batch_isend_irecv
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:
        dist.send(inp(rank, (4,), torch.float32, 70).to(dev), dst=nxt)
        y = torch.empty(4, device=dev)
        dist.recv(y, src=prv)
    else:
        y = torch.empty(4, device=dev)
        dist.recv(y, src=prv)
        dist.send(inp(rank, (4,), torch.float32, 70).to(dev), dst=nxt)
    same(y, inp(prv, (4,), torch.float32, 70), "send/recv")
    y = torch.empty(3, dtype=torch.int64, device=dev)
    reqs = [dist.isend(inp(rank, (3,), torch.int64, 71).to(dev), nxt), dist.irecv(y, prv)]
    for q in reqs:
        q.wait()
    same(y, inp(prv, (3,), torch.int64, 71), "isend/irecv ring")
    y = torch.empty(2, 2, device=dev)
    ops = [dist.P2POp(dist.isend, inp(rank, (2, 2), torch.float32, 72).to(dev), nxt),
           dist.P2POp(dist.irecv, y, prv)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    same(y, inp(prv, (2, 2), torch.float32, 72), "batch_isend_irecv")
    ok("send/recv, isend/irecv, batch_isend_irecv")

    # subgroups: every rank alone, the even ranks, everyone reversed
    evens = [r for r in ranks if r % 2 == 0]
    g_even = dist.new_group(evens)
    g_rev = dist.new_group(list(reversed(ranks)))
    if rank in evens:
        x = inp(rank, (3,), torch.float32, 80).to(dev)
        dist.all_reduce(x, group=g_even)
        same(x, sum(inp(r, (3,), torch.float32, 80) for r in evens), "subgroup all_reduce")
        x = inp(rank, (3,), torch.float32, 81).to(dev)
        dist.broadcast(x, src=evens[-1], group=g_even)
        same(x, inp(evens[-1], (3,), torch.float32, 81), "subgroup broadcast (global src)")
    x = inp(rank, (2,), torch.float32, 82).to(dev)
    outs = [torch.empty(2, device=dev) for _ in ranks]
    dist.all_gather(outs, x, group=g_rev)
    for i in ranks:  # new_group sorts its ranks: group rank order is the global order
        r = dist.get_global_rank(g_rev, i)
        same(outs[i], inp(r, (2,), torch.float32, 82), "reversed group all_gather")
    ok("new_group subgroups")

    # object collectives and CPU tensors
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert objs == [{"rank": r, "s": "x" * r} for r in ranks], objs
    lst = [{"a": 1}, [2, 3]] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"a": 1}, [2, 3]], lst
    c = inp(rank, (3,), torch.float32, 90)
    dist.all_reduce(c)
    same(c, sum(inp(r, (3,), torch.float32, 90) for r in ranks), "CPU tensor all_reduce")
    dist.barrier()
    ok("object collectives, CPU tensors, barrier")

    m = torch.tpu.metrics()["per_op"]
    assert m["dist_calls"]["all_reduce"] > 10 and m["dist_bytes"]["all_reduce"] > 0, m
    assert m["dist_compiles"]["allreduce"] >= 1, m
    ok("metrics")
    if a.mode == "fused":
        torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER)
    dist.destroy_process_group()
    if rank == 0:
        print("ALL OK", len(checked), flush=True)


if __name__ == "__main__":
    main()
