"""The MPMD check: a program's collectives compared with the other ranks' before its first run.

Ranks may run different programs (pipeline stages; a stage's send/recv pairs with its peer's),
but the collectives of programs over one mesh must agree, in order, or the transport hangs
(gloo on XLA:CPU: an op mismatch hangs, a shape mismatch aborts the process). At a program's
first launch over a mesh (``runtime/launches.py``), when its list of collectives is new on this
process, each member publishes (program name, collectives) under
``tpu_mpmd/<global ranks>/<launch number>/<rank>`` in the default group's c10d store and reads
every other member's entry at that launch number. Different lists are a RuntimeError on every
member, naming the group, the first differing collective and both ranks' programs, before
anything reached the transport; the ranks can go on (the failed launch is not counted). A
member that never publishes (it runs, at that launch, a program whose collectives it ran
before, which cannot match a list new here) is waited for up to the group's timeout
(``TORCHTPU_MPMD_TIMEOUT`` seconds if set). Counted: ``mpmd_checks``, ``mpmd_check_ms``,
``mpmd_mismatches``.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import weakref

import torch.distributed as dist

from ..runtime import launches
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
    prefix = f"tpu_mpmd/{','.join(map(str, ranks))}/{n}/"
    store.set(prefix + str(me), json.dumps(mine))
    count("mpmd_checks")
    timeout = _timeout(pg)
    for r in ranks:
        if r == me:
            continue
        try:
            store.wait([prefix + str(r)], datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001  (the store's timeout)
            count("mpmd_mismatches")
            raise launches.Mismatch(
                f"[tpu_dist] MPMD check of {where}, rank {me}: rank {r} did not reach the "
                f"check of launch {n} within {timeout:.0f} s (it runs, there, a program "
                f"whose collectives it ran before, which cannot match this one, or it is "
                f"blocked elsewhere); {_program(me, mine)}") from e
        theirs = json.loads(store.get(prefix + str(r)))
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


def install() -> None:
    launches.hook = check
