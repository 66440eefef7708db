"""Launches of programs that talk to other processes, and the MPMD check before a new one.

Every program whose collectives span several processes' devices (an eager collective,
``distributed/collectives.py``; a compiled graph with collectives, ``compile/spmd.py``) calls
``launch(devices, key, describe)`` just before it runs. Per device tuple (a mesh, in its order)
this counts launches and remembers the recent launches' programs (``state_of``: what a peer
waiting at a check asks this process, ``distributed/mpmd.py``); at a program's first launch
its collectives are listed
(``collectives_of``: kind, operand and result types, groups, reduction, in program order) and,
when this process has not run that list on this mesh before, the hook that
``distributed/mpmd.py`` installs compares it with every other member's at the same launch
number, before anything reaches the transport. Ranks may run different programs (pipeline
stages, MPMD); only their collectives over a shared mesh must agree.

A launch whose check failed keeps its number (``FAILED`` in the record): every member failed
it, so the numbers stay aligned, and a later check never meets the failed one's store entries.
Once ``aborted`` is set (``distributed/mpmd.py`` aborted this process's collectives), every
launch raises ``Aborted``.

Why comparing at first launches suffices when programs agree: while every earlier launch on a
mesh matched, the members ran the same collective lists in the same order, so a list new to
one member is new to all of them at the same launch number.
"""
from __future__ import annotations

import hashlib

class Mismatch(RuntimeError):
    """Ranks' collectives differ (raised before the launch: nothing reached the transport)."""


class Aborted(RuntimeError):
    """This process's collectives were aborted (an MPMD mismatch found while a peer was blocked
    in the transport, ``distributed/mpmd.py``): every later launch over several processes
    raises it; a new run is needed, as after NCCL's communicator abort."""


aborted = None  # the reason (text) once this process's collectives were aborted
hook = None  # fn(devices, n, name, records) -> None; raises when members disagree
FAILED = -2  # in ``_Mesh.recent``: a launch whose check failed (nothing ran)
RECENT = 64  # launches per mesh whose programs are remembered (answers to a peer's probe)


class _Mesh:
    """Launch state of one device tuple: ``count`` launches so far; ``checked``: collective
    list fingerprint -> the launch number at which this process published it (-1: a program
    without collectives); ``known``: program key -> that number; ``recent``: ring of the
    numbers of the last ``RECENT`` launches' programs."""

    __slots__ = ("count", "checked", "known", "recent")

    def __init__(self):
        self.count = 0
        self.checked: dict = {}
        self.known: dict = {}
        self.recent = [-1] * RECENT


_meshes: dict = {}  # devices -> _Mesh

COLLECTIVES = ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter",
               "stablehlo.all_to_all", "stablehlo.collective_permute",
               "stablehlo.collective_broadcast")
_ATTRS = ("replica_groups", "source_target_pairs", "all_gather_dim", "scatter_dimension",
          "split_dimension", "concat_dimension", "split_count")


def launch(devices: tuple, key, describe) -> None:
    """Count a launch over ``devices`` of the program ``key`` (hashable, the caller's identity
    of one program); ``describe``: a function returning (program name, its collectives),
    called at the key's first launch: a list new on this mesh is checked with the other
    members first (``hook``). Steady state: two dict lookups and a list store."""
    if hook is None or len(devices) < 2:
        return
    if aborted is not None:
        raise Aborted(f"[tpu_dist] this process's collectives were aborted (a new run is "
                      f"needed): {aborted}")
    st = _meshes.get(devices)
    if st is None:
        st = _meshes[devices] = _Mesh()
    first = st.known.get(key)
    if first is None:
        name, records = describe()
        first = -1
        if records:
            fp = hashlib.sha256(repr(records).encode()).digest()
            first = st.checked.get(fp)
            if first is None:
                try:
                    hook(devices, st.count, name, records)
                except Mismatch:
                    # the failed launch keeps its number (every member failed it, or the
                    # process aborts): a later check never meets this check's store entries
                    st.recent[st.count % RECENT] = FAILED
                    st.count += 1
                    raise
                first = st.checked[fp] = st.count
        st.known[key] = first
    st.recent[st.count % RECENT] = first
    st.count += 1


def state_of(device_ids) -> tuple | None:
    """(launches so far, {launch number: the launch number at which that launch's program was
    published (-1: no collectives)} for the last ``RECENT`` launches) of the mesh whose
    devices have ``device_ids`` (global ids, in order); None if it never launched here."""
    for devices, st in list(_meshes.items()):
        if [d.id for d in devices] == list(device_ids):
            n = st.count
            return n, {k: st.recent[k % RECENT] for k in range(max(0, n - RECENT), n)}
    return None


def _short(t: str) -> str:
    """``tensor<2x3xf32>`` -> ``f32[2,3]``."""
    if t.startswith("tensor<") and t.endswith(">"):
        parts = t[7:-1].split("x")
        return f"{parts[-1]}[{','.join(parts[:-1])}]"
    return t


def _attr(v: str) -> str:
    return v.split(" : ")[0].replace("dense<", "").rstrip(">") if "dense<" in v else \
        v.split(" : ")[0]


def collectives_of(lowered) -> list:
    """The collectives of a lowered JAX program (``jax.stages.Lowered``), in program order:
    (kind, operand types, result types, attributes, reduction ops) as short strings."""
    out: list = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    o = o.operation
                    if o.name in COLLECTIVES:
                        a = o.attributes
                        attrs = tuple(f"{n}={_attr(str(a[n]))}" for n in _ATTRS if n in a)
                        body = tuple(x.operation.name.replace("stablehlo.", "")
                                     for r in o.regions for b in r.blocks
                                     for x in b.operations
                                     if x.operation.name != "stablehlo.return")
                        out.append((o.name.replace("stablehlo.", ""),
                                    tuple(_short(str(v.type)) for v in o.operands),
                                    tuple(_short(str(v.type)) for v in o.results),
                                    attrs, body))
                    walk(o)

    walk(lowered.compiler_ir("stablehlo").operation)
    return out


def describe(record) -> str:
    """One collective as text: ``all_reduce(add) f32[4] -> f32[4] replica_groups=[[0, 1]]``."""
    kind, ins, outs, attrs, body = record
    red = f"({','.join(body)})" if body else ""
    return f"{kind}{red} {','.join(ins)} -> {','.join(outs)} {' '.join(attrs)}".strip()
