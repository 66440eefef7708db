"""Verification by compilation: the candidate plans as one global SPMD program each, compiled by
XLA for the mesh's device count.

The train step (forward, the loss -- the user's ``loss_fn``, else the sum of the float outputs --,
backward, an Adam-like update of
every parameter with ``optimizer_states`` state tensors) is traced once to an aten graph
(``make_fx`` on fake CPU tensors, torchtpu's decompositions), lowered through torchtpu's own
FX -> JAX lowering (``compile/lower.py``: the same table every executor uses) and exported with
``jax.export`` for one device. Each candidate then calls that program under ``jax.jit`` with
its parameter / optimizer-state / batch shardings on a ("dp", "tp") mesh; XLA's SPMD
partitioner inserts the collectives; ``memory_analysis()``, ``cost_analysis()`` and the
collectives of the compiled HLO are read back (``xla_worker.py``). Where this process has fewer
devices than the mesh, the compile runs in a subprocess with that many virtual XLA:CPU devices.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from .analysis import eager, fake_like, fake_mode, namer
from .layouts import lowered, markers, needs_layouts

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_worker.py")


def trace_step(model, args, kwargs, optimizer_states: int, loss_fn=None, loss_args=(),
               plan=None):
    """(GraphModule, parameter names, number of inputs) of one functional train step; the loss
    is ``loss_fn(output, *loss_args)`` (its tensors are inputs of the step), else the sum of
    the float outputs. ``plan``: its activation layouts (sequence / loss parallelism,
    ``sp_regather``) are put into the step as ``layouts.py`` markers."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ...compile.backend import _LazyDecompositions

    names = [n for n, _ in model.named_parameters()]
    bnames = [n for n, _ in model.named_buffers()]
    flat_in, spec = pytree.tree_flatten((args, kwargs, tuple(loss_args)))
    from torch.nn.attention.flex_attention import BlockMask

    # a BlockMask (not a pytree) enters the graph as constants, real small tensors on "tpu"
    flat_in = [x.to("tpu") if isinstance(x, BlockMask) else x for x in flat_in]
    tensor_pos = [i for i, x in enumerate(flat_in) if isinstance(x, torch.Tensor)]
    n_p, n_b, k = len(names), len(bnames), optimizer_states

    def step(*flat):
        params = dict(zip(names, flat[:n_p]))
        states = flat[n_p:n_p * (1 + k)]
        bufs = dict(zip(bnames, flat[n_p * (1 + k):n_p * (1 + k) + n_b]))
        ins = list(flat_in)
        for j, i in enumerate(tensor_pos):
            ins[i] = flat[n_p * (1 + k) + n_b + j]
        a, kw, la = pytree.tree_unflatten(ins, spec)

        def step_loss(ps):
            out = torch.func.functional_call(model, (ps, bufs), a, kw)
            if loss_fn is not None:
                return loss_fn(out, *la)
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                    and t.is_floating_point()]
            return sum(o.float().sum() for o in outs)

        leaves = {n_: p.detach().requires_grad_() for n_, p in params.items()}
        with torch.enable_grad():
            loss = step_loss(leaves)
            gl = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        grads = {n_: torch.zeros_like(params[n_]) if g is None else g
                 for n_, g in zip(names, gl)}
        loss = loss.detach()
        new_p, new_s = [], []
        for i, nme in enumerate(names):
            p, g = params[nme], grads[nme]
            st = [states[j * n_p + i] for j in range(k)]
            if k == 0:
                new_p.append(p - 1e-3 * g)
                continue
            m = 0.9 * st[0] + 0.1 * g
            upd = m
            new = [m]
            if k >= 2:
                v = 0.999 * st[1] + 0.001 * g * g
                new.append(v)
                upd = m / (v.sqrt() + 1e-8)
                new.extend(s for s in st[2:])
            new_p.append(p - 1e-3 * upd)
            new_s.append(new)
        flat_s = [new_s[i][j] for j in range(k) for i in range(n_p)] if k else []
        return (loss, *new_p, *flat_s)

    fm = fake_mode()
    ps = [fake_like(fm, p) for p in model.parameters()]
    fake = ps + [fake_like(fm, p) for _ in range(k) for p in model.parameters()] + \
        [fake_like(fm, b) for b in model.buffers()] + \
        [fake_like(fm, flat_in[i]) for i in tensor_pos]
    with fm, eager(), markers(model, plan):
        gm = make_fx(step, decomposition_table=_LazyDecompositions(),
                     tracing_mode="real")(*fake)
        # autograd is traced away above; functionalize the in-place ops of the result
        gm = make_fx(torch.func.functionalize(gm, remove="mutations"),
                     decomposition_table=_LazyDecompositions(), tracing_mode="real")(*fake)
    return gm, names, len(fake)


def export_step(gm, path: str):
    """The lowered step exported for one CPU device (``jax.export``), written to ``path``;
    returns the input shapes."""
    import jax
    from jax import export

    from ...compile.lower import GraphLowering

    low = GraphLowering(gm, "auto_parallel_step")
    n = len(low.placeholders)
    fn = low.trace_fn(list(range(n)), {}, None)
    shapes = []
    for p in low.placeholders:
        v = p.meta["val"]
        shapes.append(jax.ShapeDtypeStruct(tuple(v.shape), _jnp_dtype(v.dtype)))
    if low.random_nodes:  # the (seed, offset) words of each random op, as the runtime passes
        shapes.append(jax.ShapeDtypeStruct((len(low.random_nodes), 4), np.uint32))

    def program(*arrays):
        return fn(*arrays)[0]

    # one trace of the program: the export's (the lowering notes its host fallbacks while
    # it traces)
    try:
        exp = export.export(jax.jit(program), platforms=["cpu"])(*shapes)
    except Exception as e:
        if low.fallback_ops:
            raise _fallback_error(low) from e
        raise
    if low.fallback_ops:
        raise _fallback_error(low)
    with open(path, "wb") as f:
        f.write(exp.serialize())
    return shapes


def _fallback_error(low) -> RuntimeError:
    return RuntimeError(f"auto_parallelize(verify=True): the train step has ops without a "
                        f"tpu lowering ({sorted(map(str, low.fallback_ops))}), which run on "
                        f"the host and cannot be compiled as one SPMD program; pass "
                        f"verify=False")


def _jnp_dtype(dt):
    from ...runtime.dtypes import to_jax

    return to_jax(dt)


def param_spec(shape, dp_choice: str, tp_place: str) -> list:
    """The PartitionSpec (as a JSON list) of a parameter on the ("dp", "tp") mesh, as
    ``apply`` lays it out."""
    dims = [[] for _ in shape]
    if not dims:
        return []
    if tp_place.startswith("Shard("):
        d = int(tp_place[6:-1])
        if d < len(dims):
            dims[d].append("tp")
    if dp_choice == "fsdp":
        # on a dimension tp also shards, FSDP2 shards each tp rank's slice over dp
        # (``_StridedShard``): tp is the outer factor, ("tp", "dp"). The other order
        # (dp outer) is not the layout TP computes in: XLA reorders every such parameter
        # and gradient with all-to-alls and collective-permutes
        dims[0].append("dp")
    return [None if not a else (a[0] if len(a) == 1 else a) for a in dims]


def candidate_specs(plan, names, shapes, n_states, n_buffers, batch, n_inputs, gn) -> dict:
    specs = []
    for nme, s in zip(names, shapes):
        g = plan.groups[gn(nme)]
        specs.append(param_spec(s.shape, g["dp"], g["tp"]))
    param_specs = list(specs)
    specs += param_specs * n_states
    specs += [[None] * len(s.shape) for s in shapes[len(specs):len(specs) + n_buffers]]
    for s in shapes[len(specs):n_inputs]:
        sp = [None] * len(s.shape)
        if sp and s.shape[0] == batch and batch % plan.dp == 0 and plan.dp > 1:
            sp[0] = "dp"
        specs.append(sp)
    specs += [[None, None]] * (len(shapes) - n_inputs)  # random words: replicated
    out_specs = [[]] + param_specs * (1 + n_states)
    return {"dp": plan.dp, "tp": plan.tp, "in_specs": specs, "out_specs": out_specs}


def _trunk(model):
    """(container, number of children) of the model's longest ``ModuleList`` / ``ModuleDict`` of
    repeated layers, or (None, 0)."""
    best, n = None, 0
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) > n:
            kids = list(m.children())
            if len({type(k) for k in kids}) == 1:
                best, n = m, len(m)
    return best, n


@contextlib.contextmanager
def _depth(container, d: int):
    """The container holds only its first ``d`` layers inside (restored on exit)."""
    if container is None:
        yield
        return
    saved = container._modules
    container._modules = type(saved)(list(saved.items())[:d])
    try:
        yield
    finally:
        container._modules = saved


def _extrapolate(r1: dict, r2: dict, n: int) -> dict:
    """XLA's figures of ``n`` layers from those of 1 and 2, linearly (each layer adds what the
    second added: the same parameters, collectives and activations). The collectives keep both
    programs' lists, weighted ``2 - n`` and ``n - 1`` (XLA may combine a layer's collectives
    with its neighbour's, so the lists are not one inside the other)."""
    out = dict(r2)
    for k in ("memory_bytes", "argument_bytes", "temp_bytes", "flops", "collective_bytes"):
        out[k] = r1[k] + (n - 1) * (r2[k] - r1[k])
    out["collective_list"] = ([list(c[:3]) + [2 - n] for c in r1["collective_list"]]
                              + [list(c[:3]) + [n - 1] for c in r2["collective_list"]])
    kinds = {}
    for k in set(r1["collectives"]) | set(r2["collectives"]):
        a, b = r1["collectives"].get(k, 0), r2["collectives"].get(k, 0)
        kinds[k] = a + (n - 1) * (b - a)
    out["collectives"] = dict(sorted(kinds.items()))
    out["compile_s"] = r1.get("compile_s", 0) + r2.get("compile_s", 0)
    out["depth"] = f"extrapolated from 1 and 2 of {n} layers"
    return out


def compile_plans(model, args, kwargs, plans, optimizer_states: int, batch: int,
                  timeout: float = 600, full_depth: bool = False, measure: int = 0,
                  loss_fn=None, loss_args=()) -> list:
    """XLA's figures (a dict per plan, see ``xla_worker``) for each plan (same mesh size).

    A model with a stack of more than four repeated layers is traced and compiled with 1 and
    with 2 of them, and the figures extrapolated linearly to the whole stack (the layers share
    one decision, so each adds the same parameters, collectives and activations): on a 16-layer
    Llama that is most of the verification's time saved. ``full_depth=True`` compiles the whole
    model (tests compare the two). ``measure=k``: also run each compiled step ``k`` times on
    the virtual devices (the whole model, compiled with XLA's full optimisation) and report the
    median as ``measured_step_s`` (a sanity figure: XLA:CPU devices sharing this host's
    cores). ``loss_fn`` / ``loss_args``: the user's loss on the outputs (``auto_parallelize``)."""
    import jax

    n = plans[0].world_size
    trunk, layers = _trunk(model)
    depths = [None] if full_depth or measure or layers <= 4 else [1, 2]
    # the plans whose activations the parameters' shardings do not determine (SP, loss
    # parallelism) are traced with their own layout markers;
    # the others share one program; plans whose markers are the same (they differ only in
    # the dp choice of their parameters) share one trace
    own = {}
    for i, p in enumerate(plans):
        if needs_layouts(p):
            own.setdefault(_marker_key(p), []).append(i)
    shared = [i for i, p in enumerate(plans) if not needs_layouts(p)]
    groups = ([(None, shared)] if shared else []) + [(plans[idx[0]], idx)
                                                     for idx in own.values()]
    spent = {"traces": 0, "trace_s": 0.0, "export_s": 0.0, "xla_s": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        programs = []
        for d in depths:
            with _depth(trunk, d if d is not None else layers):
                n_b = len(list(model.buffers()))
                for j, (marked, idx) in enumerate(groups):
                    t0 = time.perf_counter()
                    gm, names, n_inputs = trace_step(model, args, kwargs, optimizer_states,
                                                     loss_fn, loss_args, plan=marked)
                    path = os.path.join(tmp, f"step{d}_{j}.jaxexport")
                    t1 = time.perf_counter()
                    shapes = export_step(gm, path)
                    spent["traces"] += 1
                    spent["trace_s"] += t1 - t0
                    spent["export_s"] += time.perf_counter() - t1
                    programs.append({
                        "exported": path, "devices": n,
                        "donate": list(range(len(names) * (1 + optimizer_states))),
                        "measure": measure,
                        "candidates": [candidate_specs(plans[i], names, shapes,
                                                       optimizer_states, n_b, batch, n_inputs,
                                                       namer(model)) for i in idx]})
        req = {"programs": programs}
        t0 = time.perf_counter()
        if jax.default_backend() == "cpu" and jax.local_device_count() >= n:
            res = [_worker().compile_candidates(p) for p in programs]
        else:
            res = _run_worker(req, n, timeout, optimise=bool(measure))
        spent["xla_s"] = time.perf_counter() - t0
    per_depth = []
    for k in range(len(depths)):
        out = [None] * len(plans)
        for (_, idx), r in zip(groups, res[k * len(groups):(k + 1) * len(groups)]):
            for i, ri in zip(idx, r):
                ri["lowered"] = lowered(plans[i])
                ri["verify_spent"] = spent  # the whole call's: traces, their time, XLA's
                out[i] = ri
        per_depth.append(out)
    if len(per_depth) == 1:
        return per_depth[0]
    return [_extrapolate(a, b, layers) for a, b in zip(*per_depth)]


def _marker_key(plan) -> tuple:
    """What ``layouts.markers`` reads of a plan: its mesh, its activation layouts and its
    tensor-parallel units."""
    return (plan.dp, plan.tp, plan.sequence_parallel, plan.loss_parallel, plan.sp_regather,
            plan.loss_head, tuple(sorted((u, d["choice"]) for u, d in plan.units.items())))


def _run_worker(req: dict, n: int, timeout: float, optimise: bool = False) -> list:
    env = dict(os.environ)
    # the figures come from the partitioned HLO and its buffer assignment; LLVM's
    # optimisation of the CPU kernels (most of the compile time) changes neither (kept
    # where the steps are run and timed)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={n}" +
                        ("" if optimise else " --xla_backend_optimization_level=0"
                                             " --xla_llvm_disable_expensive_passes=true")
                        ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, _WORKER], input=json.dumps(req), text=True,
                       capture_output=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"auto_parallelize: compiling the candidate plans for {n} "
                           f"virtual devices failed:\n{p.stderr[-3000:]}")
    res = [[] for _ in req["programs"]]
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            i, r = json.loads(line[7:])
            res[i].append(r)
    return res


def _worker():
    spec = importlib.util.spec_from_file_location("_torchtpu_xla_worker", _WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def judge(plan, compiled: dict, spec, sec_per_flop: float) -> dict:
    """Adds to ``compiled`` its step-time estimate (XLA's FLOPs + its collectives on the
    device's axis bandwidth) and the collective kinds the cost model did not predict."""
    predicted = set()
    if plan.dp > 1:
        dps = {g["dp"] for g in plan.groups.values()}
        if "fsdp" in dps:
            predicted |= {"all-gather", "reduce-scatter", "all-reduce"}
        if "replicate" in dps:
            predicted.add("all-reduce")
    if plan.tp > 1:
        predicted |= {"all-reduce", "all-gather", "reduce-scatter"}
    from .xla_worker import sent_bytes

    comm = 0.0
    for kind, nbytes, g, *w in compiled.pop("collective_list", []):
        if g > 1:  # w: the weight of an extrapolated figure (_extrapolate)
            comm += (w[0] if w else 1) * (2 * (g - 1) * spec.latency
                                          + sent_bytes(kind, nbytes, g) / spec.axis_bandwidth)
    compiled["step_time_s"] = compiled["flops"] * sec_per_flop + comm
    compiled["unpredicted"] = sorted(k for k in compiled["collectives"] if k not in predicted)
    return compiled
