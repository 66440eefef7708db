"""Compile one exported train step under several shardings and report XLA's figures.

Imports only JAX and NumPy, so it runs as a plain script in a subprocess whose XLA:CPU backend
has ``--xla_force_host_platform_device_count=N`` virtual devices (``verify.py``), or in-process
on a host that already has N devices. Input: JSON on stdin {"programs": [{"exported": path,
"devices": n, "donate": [...], "candidates": [{"dp", "tp", "in_specs": [[axes per dim] ...],
"out_specs": [...]}]}, ...]}; output: one JSON line [program index, figures] per candidate.
"""
from __future__ import annotations

import json
import re
import sys
import time

_COLL = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                   r"collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([0-9,]*)\]")
_SIZES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _bytes(shape_text: str) -> int:
    tot = 0
    for dt, dims in _SHAPE.findall(shape_text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        tot += n * _SIZES[dt]
    return tot


def _group_size(line: str, axes: dict, default: int) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in
                     (kv.split("=") for kv in m.group(1).split(",")))
        n = 1
        for a in re.findall(r"'([^']+)'", m.group(2)):
            n *= sizes.get(a, 1)
        return n
    return default


def collectives(hlo: str, n: int) -> list:
    """(kind, result bytes, group size) of every collective in an HLO module's text."""
    res = []
    for line in hlo.splitlines():
        if "-done(" in line:
            continue
        m = _COLL.search(line)
        if m:
            res.append((m.group(2), _bytes(m.group(1)), _group_size(line, {}, n)))
    return res


def sent_bytes(kind: str, nbytes: int, g: int) -> float:
    """Bytes one device sends in a ring implementation of the collective (result size)."""
    if g <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (g - 1) / g * nbytes
    if kind == "reduce-scatter":
        return (g - 1) * nbytes
    if kind == "collective-permute":
        return nbytes
    return (g - 1) / g * nbytes


def compile_candidates(req: dict) -> list:
    import jax
    import numpy as np
    from jax import export
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_enable_x64", True)  # torchtpu's programs take int64 / float64
    with open(req["exported"], "rb") as f:
        exp = export.deserialize(bytearray(f.read()))
    n = req["devices"]
    devs = jax.devices()[:n]
    if len(devs) < n:
        raise RuntimeError(f"need {n} devices, have {len(devs)}")
    out = []
    for cand in req["candidates"]:
        mesh = Mesh(np.array(devs).reshape(cand["dp"], cand["tp"]), ("dp", "tp"))

        def spec(s):
            return NamedSharding(mesh, P(*[tuple(a) if isinstance(a, list) else a for a in s]))

        ins = [spec(s) for s in cand["in_specs"]]
        outs = tuple(spec(s) for s in cand["out_specs"])
        fn = jax.jit(exp.call, in_shardings=ins, out_shardings=outs,
                     donate_argnums=tuple(req["donate"]))
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(exp.in_avals, ins)]
        t0 = time.perf_counter()
        lowered = fn.lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        mem = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        if isinstance(cost, list):
            cost = cost[0] if cost else {}
        colls = collectives(compiled.as_text(), n)
        kinds = {}
        for kind, b, g in colls:
            k = kinds.setdefault(kind, [0, 0.0])
            k[0] += 1
            k[1] += sent_bytes(kind, b, g)
        out.append({
            "devices": n,
            "memory_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "flops": float(cost.get("flops", 0.0)),
            "collectives": {k: v[0] for k, v in sorted(kinds.items())},
            "collective_bytes": float(sum(v[1] for v in kinds.values())),
            "collective_list": colls,
            "lower_s": t1 - t0, "compile_s": t2 - t1,
        })
        if req.get("measure"):
            out[-1]["measured_step_s"] = _measure(compiled, exp.in_avals, ins, req["measure"])
    return out


def _measure(compiled, avals, shardings, reps: int) -> float:
    """The median wall time of ``reps`` runs of the compiled step on the virtual devices (after
    one warm-up), each ended by ``block_until_ready``; fresh inputs per run (they are
    donated), small floats and zero integers (token ids 0, random words 0)."""
    import statistics

    import jax
    import numpy as np

    def inputs():
        res = []
        for a, sh in zip(avals, shardings):
            dt = np.dtype(a.dtype)
            v = np.full(a.shape, 0.01, dt) if np.issubdtype(dt, np.floating) else \
                np.zeros(a.shape, dt)
            res.append(jax.device_put(v, sh))
        return res

    times = []
    for i in range(reps + 1):
        args = inputs()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    req = json.loads(sys.stdin.read())
    for i, prog in enumerate(req["programs"]):
        for r in compile_candidates(prog):
            print("RESULT " + json.dumps([i, r]), flush=True)


if __name__ == "__main__":
    main()
