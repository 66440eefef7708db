"""The ILP: one binary per (unit, tp option) and per (parameter group, tp option of its unit,
dp option), solved with PuLP's bundled CBC.

    minimise   sum(cost * x)              (step time, or memory for objective="memory")
    subject to one tp option per unit; per group, its dp options sum to its unit's chosen tp
               option (z[g, t, d] <= y[u, t]); predicted memory <= memory_budget; on a 2-D
               mesh one dp option for all groups; with tp > 1 at least one unit sharded;
               sequence parallelism (one binary, where the model allows it) only with every
               unit sharded; loss parallelism (one binary, where the model computes its own
               cross-entropy) only with the head sharded; saving the blocks' inputs
               sharded on the sequence (one binary) only with sequence parallelism.
The k best assignments of a factorisation come from re-solving with a no-good cut on each
solution found.
"""
from __future__ import annotations

import pulp

from .cost import Costs, evaluate


def solve(c: Costs, budget: float, objective: str = "step_time", k: int = 1) -> list:
    """Up to ``k`` best (unit_choice, group_choice, sequence_parallel, loss_parallel,
    sp_regather, Term) of ``c`` within
    ``budget`` bytes, best first; [] when none fits."""
    prob = pulp.LpProblem("auto_parallel", pulp.LpMinimize)
    y = {(u, o): pulp.LpVariable(f"y_{i}_{j}", cat="Binary")
         for i, (u, opts) in enumerate(c.unit_opts.items()) for j, o in enumerate(opts)}
    z = {(g, t, d): pulp.LpVariable(f"z_{i}_{j}", cat="Binary")
         for i, (g, opts) in enumerate(c.group_opts.items())
         for j, (t, d) in enumerate(opts)}

    def metric(term):
        return term.time if objective == "step_time" else term.memory

    sp = pulp.LpVariable("sp", cat="Binary") if c.sp is not None else None
    lp = pulp.LpVariable("lp", cat="Binary") if c.lp is not None else None
    sg = pulp.LpVariable("sg", cat="Binary") if sp is not None and c.sg is not None else None
    sp_terms = [(t, v) for t, v in ((c.sp, sp), (c.lp, lp), (c.sg, sg)) if v is not None]
    prob += (metric(c.const)
             + pulp.lpSum(metric(c.unit_opts[u][o]) * v for (u, o), v in y.items())
             + pulp.lpSum(metric(c.group_opts[g][(t, d)]) * v for (g, t, d), v in z.items())
             + pulp.lpSum(metric(t) * v for t, v in sp_terms))
    if sp is not None:
        for u in c.unit_opts:
            prob += sp <= 1 - y[(u, "none")]
    if sg is not None:
        prob += sg <= sp
    if lp is not None:
        prob += lp <= 1 - y[(c.head, "none")]
    for u, opts in c.unit_opts.items():
        prob += pulp.lpSum(y[(u, o)] for o in opts) == 1
    for g, opts in c.group_opts.items():
        owner = c.owner[g]
        for t in {t for t, _ in opts}:
            chosen = y[(owner, t)] if owner is not None else 1
            prob += pulp.lpSum(z[(g, t, d)] for tt, d in opts if tt == t) == chosen
    if c.tp > 1:
        # a tp axis that shards nothing would only repeat the computation on idle devices
        sharded = [v for (u, o), v in y.items() if o != "none"]
        if not sharded:
            return []
        prob += pulp.lpSum(sharded) >= 1
    if c.dp > 1 and c.tp > 1:
        # on a 2-D mesh every group takes the same dp option (apply.py: parameters replicated
        # over dp would live on the tp mesh while FSDP's live on the 2-D mesh, and one
        # optimizer's foreach ops cannot mix meshes)
        w = pulp.LpVariable("fsdp_all", cat="Binary")
        for g, opts in c.group_opts.items():
            prob += pulp.lpSum(z[(g, t, d)] for t, d in opts if d == "fsdp") == w
    if budget != float("inf"):
        prob += (c.const.memory
                 + pulp.lpSum(c.unit_opts[u][o].memory * v for (u, o), v in y.items())
                 + pulp.lpSum(c.group_opts[g][(t, d)].memory * v for (g, t, d), v in z.items())
                 + pulp.lpSum(t.memory * v for t, v in sp_terms)
                 <= budget)
    found = []
    solver = pulp.PULP_CBC_CMD(msg=False)
    for _ in range(k):
        prob.solve(solver)
        if pulp.LpStatus[prob.status] != "Optimal":
            break
        units = {u: o for (u, o), v in y.items() if v.value() > 0.5}
        groups = {g: d for (g, t, d), v in z.items() if v.value() > 0.5}
        on = sp is not None and sp.value() > 0.5
        lon = lp is not None and lp.value() > 0.5
        gon = sg is not None and sg.value() > 0.5
        found.append((units, groups, on, lon, gon, evaluate(c, units, groups, on, lon, gon)))
        every = list(y.values()) + list(z.values()) + [v for _, v in sp_terms]
        ones = [v for v in every if v.value() > 0.5]
        zeros = [v for v in every if v.value() <= 0.5]
        # exclude this solution (the zeros count too: with sp a solution can be a superset)
        prob += pulp.lpSum(ones) - pulp.lpSum(zeros) <= len(ones) - 1
    return found
