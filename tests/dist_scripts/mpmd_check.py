"""The MPMD check (distributed/mpmd.py): ranks whose programs' collectives disagree get a clear
RuntimeError on every rank, naming both ranks' programs, within seconds and before the
transport sees anything (gloo would hang or abort); the group stays usable afterwards. Ranks
running different programs whose collectives agree (a compiled program on one rank, an eager
collective on the other) pass.

Run under torchrun with 2 ranks; prints "OK <case>" per check and "ALL OK <n>" at the end.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

checked = []
LIMIT_S = 20.0  # a mismatch must be reported well before any timeout (the group's: 300 s)


def ok(name):
    checked.append(name)
    if dist.get_rank() == 0:
        print("OK", name, flush=True)


def metric(name):
    return torch.tpu.metrics()["counters"].get(name, 0)


def expect_mismatch(what, fn, *needles):
    before = metric("mpmd_mismatches")
    t0 = time.monotonic()
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        took = time.monotonic() - t0
        assert "MPMD check" in msg and "rank 0 runs" in msg and "rank 1 runs" in msg, msg
        for n in needles:
            assert n in msg, (n, msg)
        assert took < LIMIT_S, (took, msg)
        assert metric("mpmd_mismatches") == before + 1
        if dist.get_rank() == 0:
            print(f"  {what}: {took:.2f} s: {msg[:400]}", flush=True)
        return
    raise AssertionError(f"rank {dist.get_rank()} {what}: no error")


def still_usable(dev):
    t = torch.full((3,), float(dist.get_rank() + 1), device=dev)
    dist.all_reduce(t)
    torch.testing.assert_close(t.cpu(), torch.full((3,), 3.0))


def large_p2p(rank, dev):
    """send/recv past the c10d store's 8 MiB message limit (it broke the store's connection):
    the payload goes over a direct connection; both directions posted at once
    (batch_isend_irecv), float32, bfloat16 and bool, bit-exact."""
    peer = 1 - rank
    before = metric("dist_p2p_socket_bytes")
    cases = []
    specs = [(((3 << 20) + 5,), torch.float32), (((1 << 20), 3), torch.bfloat16),
             ((600 << 10,), torch.bool)]
    for salt, (shape, dtype) in enumerate(specs):
        gen = torch.Generator().manual_seed(100 * salt + rank)
        mine = torch.randn(shape, generator=gen).to(dtype) if dtype != torch.bool else \
            torch.rand(shape, generator=gen) > 0.5
        gen = torch.Generator().manual_seed(100 * salt + peer)
        want = torch.randn(shape, generator=gen).to(dtype) if dtype != torch.bool else \
            torch.rand(shape, generator=gen) > 0.5
        got = torch.empty(shape, dtype=dtype, device=dev)
        ops = [dist.P2POp(dist.isend, mine.to(dev), peer), dist.P2POp(dist.irecv, got, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        cases.append((got, want))
    for got, want in cases:
        assert torch.equal(got.cpu(), want), (got.dtype, got.shape)
    sent = metric("dist_p2p_socket_bytes") - before
    assert sent >= ((3 << 20) + 5) * 4 + (3 << 20) * 2, sent
    ok(f"large send/recv over a direct connection ({sent >> 20} MiB sent by rank {rank})")


def main():
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    g = dist.group.WORLD
    checks0 = metric("mpmd_checks")
    still_usable(dev)
    assert metric("mpmd_checks") > checks0  # a new program was checked
    ok("a matching collective is checked once and runs")

    # eager: one rank's all_reduce has another shape
    x = torch.ones(4 + rank, device=dev)
    expect_mismatch("eager shape", lambda: dist.all_reduce(x), "f32[4]", "f32[5]",
                    "all_reduce")
    still_usable(dev)
    ok("eager: a shape mismatch is an error on both ranks; the group goes on")

    # eager: the same bytes, another collective (gloo: a silent hang)
    if rank == 0:
        op = lambda: dist.all_reduce(torch.ones(8, device=dev))  # noqa: E731
    else:
        op = lambda: dist.all_gather_into_tensor(  # noqa: E731
            torch.empty(8, device=dev), torch.ones(4, device=dev))
    expect_mismatch("eager op", op, "all_reduce", "all_gather")
    still_usable(dev)
    ok("eager: an op mismatch is an error on both ranks")

    # compiled: the ranks compile the same function for different shapes
    def f(t):
        return funcol.all_reduce(t * 2, "sum", g) + 1

    cf = torch.compile(f, backend="tpu", fullgraph=True)
    expect_mismatch("compiled shape", lambda: cf(torch.ones(2, 3 + rank, device=dev)).cpu(),
                    "compiled_spmd", "f32[2,3]", "f32[2,4]")
    still_usable(dev)
    ok("compiled: programs whose collectives differ are an error on both ranks")

    # different programs whose collectives agree: compiled on rank 0, eager on rank 1
    v = torch.arange(6, dtype=torch.float32, device=dev).reshape(2, 3) + rank
    if rank == 0:
        got = cf(v).cpu()
    else:
        w = v * 2
        dist.all_reduce(w)
        got = (w + 1).cpu()
    want = (torch.arange(6, dtype=torch.float32).reshape(2, 3) * 2 * 2 + 2 + 1)
    torch.testing.assert_close(got, want)
    ok("different programs (compiled / eager) with the same collectives run")

    large_p2p(rank, dev)
    dist.destroy_process_group()
    if rank == 0:
        print("ALL OK", len(checked), flush=True)


if __name__ == "__main__":
    main()
