"""The MPMD check (distributed/mpmd.py): ranks whose programs' collectives disagree get a clear
RuntimeError on every rank, naming both ranks' programs, within seconds and before the
transport sees anything (gloo would hang or abort); the group stays usable afterwards. Ranks
running different programs whose collectives agree (a compiled program on one rank, an eager
collective on the other) pass. A rank launching a new program while its peer re-runs one it
checked before (``abort``: both ranks raise; the processes' collectives are aborted), and a
peer dead before a new program, are errors within seconds. A failed check's store entries are
never read as a later launch's (also after the group is re-created on the same store).

Run under torchrun with 2 ranks (``mpmd_check.py [abort]``; ``abort`` also with 3); prints "OK <case>" per check and "ALL OK <n>" at the end.
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


def swapped(rank, dev, base, what):
    """A failed check (rank 0: f32[base], rank 1: f32[base+1]), then the swapped programs,
    with rank 1 late: both checks fail, none matches the other's stale entry."""
    x = torch.ones(base + rank, device=dev)
    expect_mismatch(what + " (first)", lambda: dist.all_reduce(x), f"f32[{base}]",
                    f"f32[{base + 1}]")
    if rank == 1:
        time.sleep(1.5)  # rank 0 reads rank 1's entries first
    y = torch.ones(base + 1 - rank, device=dev)
    expect_mismatch(what, lambda: dist.all_reduce(y), f"f32[{base}]", f"f32[{base + 1}]")


def abort_case():
    """A new program on rank 0 while rank 1 re-runs one it checked before (so it is blocked in
    the transport): both ranks raise within seconds, naming both programs; the collectives of
    both processes are aborted: later collectives raise a clear error; local work goes on."""
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("tpu", int(os.environ.get("LOCAL_RANK", rank)))
    still_usable(dev)
    old = torch.ones(4, device=dev)
    dist.all_reduce(old)
    dist.barrier()
    needles = ("MPMD check", "rank 0 runs", "rank 1 runs", "f32[6]", "f32[4]",
               "collectives of " + ("both processes" if world == 2 else "every member")
               + " are aborted")
    if rank == 0:
        expect_mismatch("new vs re-run", lambda: dist.all_reduce(torch.ones(6, device=dev)),
                        *needles)
    else:
        t0 = time.monotonic()
        try:
            dist.all_reduce(old)  # blocked in the transport until rank 0's check aborts it
            old.cpu()
        except RuntimeError as e:
            took, msg = time.monotonic() - t0, str(e)
            for n in needles + ("all_reduce (sequence number",):
                assert n in msg, (n, msg)
            assert took < LIMIT_S, (took, msg)
            print(f"  rank {rank}, blocked in the re-run program: {took:.2f} s: {msg[:400]}",
                  flush=True)
        else:
            raise AssertionError(f"rank {rank}: no error")
    assert metric("mpmd_aborts") == 1
    ok("a new program against a peer blocked in a re-run one: an error on both ranks")
    for later in (lambda: dist.all_reduce(torch.ones(4, device=dev)),
                  lambda: dist.broadcast(torch.ones(4, device=dev), 0)):
        try:
            later()
        except RuntimeError as e:
            assert "collectives were aborted" in str(e) and "rank 0 runs" in str(e), str(e)
        else:
            raise AssertionError("a collective after the abort ran")
    torch.testing.assert_close((torch.arange(3.0, device=dev) * 2).cpu(),
                               torch.arange(3.0) * 2)
    got = torch.empty(5, device=dev)
    if rank == 0:
        for peer in range(1, world):
            dist.send(torch.arange(5.0, device=dev), peer)
    else:
        dist.recv(got, 0)
        torch.testing.assert_close(got.cpu(), torch.arange(5.0))
    ok("after the abort: collectives raise a clear error, local work and send/recv go on")
    # leave together (through the store: collectives are aborted): rank 0 hosts JAX's
    # coordination service, whose loss ends the other process
    store = dist.distributed_c10d._get_default_store()
    store.set(f"abort_done/{rank}", "1")
    store.wait([f"abort_done/{r}" for r in range(world)], datetime.timedelta(seconds=60))
    print("ALL OK", len(checked), flush=True)
    os._exit(0)  # the group was aborted: no collective shutdown


def still_usable(dev):
    t = torch.full((3,), float(dist.get_rank() + 1), device=dev)
    dist.all_reduce(t)
    n = dist.get_world_size()
    torch.testing.assert_close(t.cpu(), torch.full((3,), n * (n + 1) / 2))


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

    # the store entries carry this cluster's epoch: drawn by rank 0 at the join, the same on
    # every rank (an earlier run's entries in a store that outlived it are never read)
    from torchtpu.distributed import bootstrap
    epochs = [None, None]
    dist.all_gather_object(epochs, bootstrap.state["epoch"])
    assert epochs[0] == epochs[1] and len(epochs[0]) == 12, epochs
    store = dist.distributed_c10d._get_default_store()
    assert store.check([f"tpu_mpmd/{epochs[0]}/0,1/0/{rank}"])
    ok("the check's store entries are keyed by the cluster's epoch")

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

    # a failed check's store entries stay; the next new programs (swapped: rank 0 now runs
    # rank 1's failed program and vice versa) must never read them as a match (rank 1 comes
    # late, so rank 0 would meet its stale entry; a false match hangs or aborts in gloo)
    swapped(rank, dev, 20, "stale entries of a failed check")
    still_usable(dev)
    ok("a failed check's entries are never read as a later launch's")

    # the same after the group is destroyed and re-created on the same store
    dist.destroy_process_group()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    g = dist.group.WORLD
    x = torch.ones(30 + rank, device=dev)
    expect_mismatch("re-created group", lambda: dist.all_reduce(x), "f32[30]", "f32[31]")
    swapped(rank, dev, 40, "stale entries, re-created group")
    still_usable(dev)
    ok("a re-created group on the same store: stale entries are never read as a match")

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

    # the steady-state cost of a launch (a program run before): no store operation
    from torchtpu.runtime import launches
    devs = next(iter(launches._meshes))
    fake = (devs[0], devs[0])  # its own launch record: the real meshes' counts stay aligned
    launches.launch(fake, "k", lambda: ("p", []))
    t0 = time.perf_counter()
    for _ in range(20000):
        launches.launch(fake, "k", None)
    us = (time.perf_counter() - t0) / 20000 * 1e6
    assert us < 50, us
    if rank == 0:
        print(f"  per-launch cost of the check's record: {us:.2f} us", flush=True)
    ok("a launch of a checked program costs no store operation")

    # a peer that died before a new program: an error naming the group, the collective and the
    # dead rank within seconds (not the group's 300 s timeout, not JAX's heartbeat)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(1.0)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(7, device=dev))
    except RuntimeError as e:
        took = time.monotonic() - t0
        msg = str(e)
        for needle in ("rank 1 is gone", "global ranks [0, 1]", "all_reduce", "f32[7]",
                       "rank 0"):
            assert needle in msg, (needle, msg)
        assert took < LIMIT_S, (took, msg)
        print(f"  dead peer: {took:.2f} s: {msg[:300]}", flush=True)
    else:
        raise AssertionError("no error with a dead peer")
    ok("a peer dead before a new program: a RuntimeError within seconds")
    print("ALL OK", len(checked), flush=True)
    os._exit(0)  # the group lost a member: no collective shutdown


if __name__ == "__main__":
    import sys

    abort_case() if sys.argv[1:] == ["abort"] else main()
