"""The MPMD check: a program's collectives compared with the other ranks' before its first run.

Ranks may run different programs (pipeline stages; a stage's send/recv pairs with its peer's),
but the collectives of programs over one mesh must agree, in order, or the transport hangs
(gloo on XLA:CPU: an op mismatch hangs, a shape mismatch aborts the process). At a program's
first launch over a mesh (``runtime/launches.py``), when its list of collectives is new on this
process, each member publishes (program name, collectives) under
``tpu_mpmd/<epoch>/<global ranks>/<launch number>/<rank>`` in the default group's c10d store
and reads every other member's entry at that launch number. Different lists are a RuntimeError on
every member, naming the group, the first differing collective and both ranks' programs,
before anything reached the transport; the ranks can go on.

Entries are keyed by the cluster's epoch (``bootstrap.state["epoch"]``, new with every JAX
cluster) and a failed check's launch keeps its number on every member
(``runtime/launches.py``), so an entry left by an earlier failed check or an earlier run in
the same store is never read by a later check.

A member that does not publish at that launch number within ``PROBE_S`` (1 s,
``TORCHTPU_MPMD_PROBE_S``) is asked directly: its process's p2p listener
(``p2p_transport.py``; its reader thread answers while the main thread may be blocked in a
collective) returns its launch count on the mesh and, for its recent launches, the launch at
which each one's program was first checked (``launches.state_of``). A member that has passed
this launch number without publishing ran there a program it had checked before, which
cannot match a list new here, and is blocked in the transport (or will be) in a collective
this rank never launches: this rank aborts the collectives of every member (``_abort``: an
``mpmd_abort`` message to each member's listener, whose reader thread records the message in
``launches.aborted`` and shuts down that process's gloo connections, ``gloo_sockets.py``; the
blocked launch then fails in its own thread and is raised as ``launches.Aborted`` with the
message naming both programs), then raises ``Mismatch``. Every later collective of these
processes raises ``launches.Aborted``: a new run is needed, as after NCCL's abort. A refused
connection means the peer's process exited: a RuntimeError naming the group, the collective,
the launch and the dead rank, in about ``PROBE_S`` seconds (JAX's heartbeat takes 100 s). A
member that is merely busy is waited for up to the group's timeout (``TORCHTPU_MPMD_TIMEOUT``
seconds if set). The steady state (a program run before) adds no store operation:
``launches.launch`` records the launch in memory (~1 us). Counted: ``mpmd_checks``, ``mpmd_check_ms``, ``mpmd_mismatches``,
``mpmd_dead_peers``, ``mpmd_aborts``.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import weakref

import torch.distributed as dist

from ..runtime import launches
from . import bootstrap, gloo_sockets, p2p_transport
from ..runtime.metrics import count

_groups: dict = {}  # global ranks (tuple) -> weak reference to the ProcessGroupTPU


def note_group(pg) -> None:
    """Remember a group by its global ranks (to name it in errors)."""
    _groups[tuple(pg._global_ranks)] = weakref.ref(pg)


def _group_of(ranks):
    ref = _groups.get(tuple(ranks))
    return ref() if ref is not None else None


def _timeout(pg) -> float:
    env = os.environ.get("TORCHTPU_MPMD_TIMEOUT")
    if env:
        return float(env)
    for g in (pg, dist.distributed_c10d._get_default_group() if dist.is_initialized() else None):
        t = getattr(g, "_timeout", None)
        if isinstance(t, datetime.timedelta):
            return t.total_seconds()
    return 1800.0


def _program(rank: int, entry: dict) -> str:
    cols = "; ".join(entry["collectives"]) or "none"
    return f"rank {rank} runs {entry['name']!r} with collectives [{cols}]"


PROBE_S = float(os.environ.get("TORCHTPU_MPMD_PROBE_S", "1.0"))


def _address(ranks, r):
    """Rank ``r``'s p2p listener (published by every group at creation), or None."""
    for g in (_group_of(ranks), _group_of(list(range(dist.get_world_size())))):
        if g is not None and r in g._global_ranks:
            addr = g._peer_addr.get(r_local := g._global_ranks.index(r))
            if addr is None:
                try:
                    addr = g._peer_addr[r_local] = g._store.get(
                        g._key("addr", r_local)).decode()
                except Exception:  # noqa: BLE001
                    continue
            return addr
    return None


def _answer(question: str) -> bytes:
    """A peer's probe ``mpmd/<device ids>``: this process's launches on that mesh."""
    ids = [int(i) for i in question.split("/", 1)[1].split(",")]
    st = launches.state_of(ids)
    return json.dumps(None if st is None else [st[0], {str(k): v for k, v in st[1].items()}]
                      ).encode()


def _probe(devices, r, addr):
    """Rank ``r``'s (launch count, {launch: first launch of its program}) on ``devices``; None
    if unknown (no answer, no address, never launched there); raises PeerGone."""
    if addr is None:
        return None
    got = p2p_transport.Transport.ask(addr, "mpmd/" + ",".join(str(d.id) for d in devices),
                                      timeout=max(PROBE_S, 1.0))
    if not got:
        return None
    st = json.loads(got)
    return None if st is None else (st[0], {int(k): v for k, v in st[1].items()})


def check(devices, n: int, name: str, records) -> None:
    """The hook of ``runtime/launches.py``: compare this launch's collectives with the
    other members' at launch number ``n`` (see the module docstring)."""
    if not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    ranks = [d.process_index for d in devices]
    me = dist.get_rank()
    pg = _group_of(ranks)
    gname = f"group {pg.group_name!r} " if pg is not None else ""
    where = f"{gname}(global ranks {ranks})"
    t0 = time.perf_counter()
    mine = {"name": name, "collectives": [launches.describe(r) for r in records]}
    head = f"[tpu_dist] rank {me}, MPMD check of {where} before {mine['collectives'][0]} " \
        f"(launch {n})"
    prefix = f"tpu_mpmd/{bootstrap.state['epoch']}/{','.join(map(str, ranks))}/"
    at = prefix + f"{n}/"
    store.set(at + str(me), json.dumps(mine))
    count("mpmd_checks")
    timeout = _timeout(pg)
    deadline = time.monotonic() + timeout
    for r in ranks:
        if r == me:
            continue
        addr = _address(ranks, r)
        pause, next_probe = 0.001, time.monotonic() + PROBE_S
        while True:
            # polled (store.wait's timeout logs a C++ warning each time), backing off to 50 ms
            try:
                if store.check([at + str(r)]):
                    break
                store_error = None
            except Exception as e:  # noqa: BLE001  (the store failed)
                store_error = e
            if store_error is None and time.monotonic() < min(next_probe, deadline):
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
                continue
            next_probe = time.monotonic() + PROBE_S
            try:
                peer = _probe(devices, r, addr)
            except p2p_transport.PeerGone as e:
                count("mpmd_dead_peers")
                bootstrap.state["failed"] = True
                raise RuntimeError(
                    f"{head}: rank {r} is gone: its process exited ({e}) before reaching "
                    f"this launch; the collective cannot run. {_program(me, mine)}") from e
            if store_error is not None:
                bootstrap.state["failed"] = True
                raise RuntimeError(f"{head}: the c10d store failed while waiting for rank {r} "
                                   f"(rank 0, which hosts it, may be gone): {store_error}"
                                   ) from store_error
            if peer is not None and peer[0] > n and not store.check([at + str(r)]):
                # it passed launch n without publishing: it ran there a program whose
                # collectives it had checked before, which cannot match this new one
                count("mpmd_mismatches")
                first = peer[1].get(n)
                theirs = {"name": "a program", "collectives": []}
                if first is not None and first >= 0:
                    theirs = json.loads(store.get(f"{prefix}{first}/{r}"))
                what = _program(r, theirs) if first is not None else \
                    f"rank {r} runs a program it ran before"
                msg = (f"[tpu_dist] MPMD check of {where}, rank {me}: ranks run programs "
                       f"whose collectives differ at launch {n} on this group: rank {r} runs "
                       f"there a program it ran before (first checked at launch {first}), "
                       f"rank {me} a new one; rank {r} was blocked in the transport: the "
                       f"collectives of {'both processes' if len(ranks) == 2 else 'every member'} "
                       f"are aborted. {_program(me, mine)}; "
                       f"{what}")
                _abort(store, prefix, ranks, me, msg)
                raise launches.Mismatch(msg)
            if time.monotonic() >= deadline:
                count("mpmd_mismatches")
                raise launches.Mismatch(
                    f"[tpu_dist] MPMD check of {where}, rank {me}: rank {r} did not reach the "
                    f"check of launch {n} within {timeout:.0f} s (it is blocked elsewhere); "
                    f"{_program(me, mine)}")
        theirs = json.loads(store.get(at + str(r)))
        if theirs["collectives"] != mine["collectives"]:
            count("mpmd_mismatches")
            a, b = mine["collectives"], theirs["collectives"]
            i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            first = (f"collective {i}: rank {me}: {a[i] if i < len(a) else 'none'}, rank {r}: "
                     f"{b[i] if i < len(b) else 'none'}")
            raise launches.Mismatch(
                f"[tpu_dist] MPMD check of {where}, rank {me}: ranks run programs whose "
                f"collectives differ at launch {n} on this group (they would hang or abort "
                f"in the transport); first difference at {first}. {_program(me, mine)}; "
                f"{_program(r, theirs)}")
    count("mpmd_check_ms", int((time.perf_counter() - t0) * 1000))


def _known_ports() -> set:
    """Ports whose connections are not gloo's: the p2p listeners, the c10d store's, JAX's
    coordination service's."""
    ports = set()
    if p2p_transport._transport:
        ports.add(int(p2p_transport._transport[0].address.rsplit(":", 1)[1]))
    for g in list(_groups.values()):
        g = g()
        for a in (g._peer_addr.values() if g is not None else ()):
            ports.add(int(a.rsplit(":", 1)[1]))
    if os.environ.get("MASTER_PORT", "").strip().isdigit():
        ports.add(int(os.environ["MASTER_PORT"]))
    try:
        from jax._src import distributed as jd

        if jd.global_state.coordinator_address:
            ports.add(int(jd.global_state.coordinator_address.rsplit(":", 1)[1]))
    except Exception:  # noqa: BLE001
        pass
    if dist.is_initialized():
        st = dist.distributed_c10d._get_default_store()
        while st is not None:
            if isinstance(st, dist.TCPStore):
                ports.add(st.port)
            st = getattr(st, "underlying_store", None)
    return ports


def _end_transport(reason: str, peers: list) -> list:
    """Abort this process's collectives: later launches raise ``launches.Aborted(reason)``,
    and the gloo connections (accepted on this process's gloo listeners, or made to the
    ``peers``' ones) are shut down, so a collective blocked in one fails in its own thread.
    Returns this process's gloo listener ports."""
    if launches.aborted is None:
        launches.aborted = reason
        count("mpmd_aborts")
    bootstrap.state["failed"] = True  # the exit skips JAX's shutdown barrier
    known = _known_ports()
    own = gloo_sockets.listeners(known)
    gloo_sockets.shutdown(own, peers, known)
    return own


def _abort(store, prefix: str, ranks, me: int, msg: str) -> None:
    """The mismatch found while a member is blocked in the transport: tell every member
    (``mpmd_abort`` over its p2p listener: its reader thread aborts that process's
    collectives, so the blocked one fails at once with ``msg``; the record under
    ``<prefix>abort`` names it for a member that cannot be reached), then abort here."""
    try:
        store.set(prefix + "abort", msg)
    except Exception:  # noqa: BLE001  (the store is gone: the p2p message still goes)
        pass
    peers: list = []
    own = gloo_sockets.listeners(_known_ports())
    for r in ranks:
        if r == me:
            continue
        addr = _address(ranks, r)
        if addr is None:
            continue
        try:
            got = p2p_transport.Transport.ask(
                addr, "mpmd_abort/" + json.dumps({"from": me, "msg": msg, "gloo": own}),
                timeout=max(PROBE_S, 1.0))
            peers += json.loads(got) if got else []
        except (p2p_transport.PeerGone, ValueError):
            continue
    _end_transport(msg, peers)


def _answer_abort(question: str) -> bytes:
    """A member's ``mpmd_abort``: abort this process's collectives (see ``_abort``); the
    answer is this process's gloo listener ports."""
    q = json.loads(question.split("/", 1)[1])
    return json.dumps(_end_transport(q["msg"], q["gloo"])).encode()


def install() -> None:
    launches.hook = check
    p2p_transport.answers["mpmd"] = _answer
    p2p_transport.answers["mpmd_abort"] = _answer_abort
