"""An aten FX graph -> one pure JAX function, using the same lowering table as eager.

``GraphLowering(gm)`` analyses the graph once (placeholders, input mutations, random ops);
``trace_fn(static)`` returns a function of flat jax arrays that jax.jit can trace. Each node is
evaluated at trace time:

- an ``OpOverload`` with a lowering in the table: the lowering (random lowerings get a key
  derived from the generator's (seed, offset) words, which are a graph input);
- ``copy_`` onto a graph input (aot_autograd's kept input mutations) and any other in-place
  op: computed functionally; the new value is returned so the runtime can write it back
  (donating the input's buffer where it can);
- an op with no lowering: run on CPU inside the XLA program through ``jax.pure_callback``,
  counted as ``compile_cpu_fallbacks`` with a one-time warning (decompositions were already
  applied by aot_autograd, see backend.py);
- Python functions on sizes (``operator.*``, ``sym_size``): evaluated on the concrete shapes,
  so graphs with symbolic shapes are specialised per concrete shape.
"""
from __future__ import annotations

import operator
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import ml_dtypes
import numpy as np
import torch
from torch._ops import OpOverload

from ..eager import rng as _rng
from ..lowering import hops, registry
from ..runtime.dtypes import to_jax, to_torch
from ..runtime.metrics import count

aten = torch.ops.aten
_warned: set = set()
_WITH_EFFECTS = torch.ops.higher_order.with_effects
# a mutable custom op's call, functionalized: (op, **its arguments)
_FUNCTIONALIZED = tuple(getattr(torch.ops.higher_order, n) for n in (
    "auto_functionalized", "auto_functionalized_v2") if hasattr(torch.ops.higher_order, n))
_late_lowerings: list = []  # registered once, when the first graph is lowered


def op_name(op) -> str:
    if isinstance(op, OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    return getattr(op, "__name__", str(op))


def has_lowering(op) -> bool:
    return registry.get(op) is not None


def _functional_of(op: OpOverload):
    """The functional overload of an in-place op (``add_.Tensor`` -> ``add.Tensor``)."""
    base = op._schema.name.split("::", 1)[1]
    if not base.endswith("_"):
        return None
    packet = getattr(aten, base[:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)


def _is_inplace(op) -> bool:
    if not isinstance(op, OpOverload):
        return False
    s = op._schema
    return bool(s.arguments) and s.arguments[0].alias_info is not None \
        and s.arguments[0].alias_info.is_write and s.name.split("::", 1)[1].endswith("_")


class Unsupported(RuntimeError):
    pass


def _is_view_op(target) -> bool:
    return isinstance(target, OpOverload) and any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def _output_views(outs):
    """{output index: (index of the output it views, [(view op, other args, kwargs)...])} for
    each graph output made by view ops (with static arguments) from another output. In an
    inference graph aot_autograd leaves such aliasing to the compiler, as eager has it."""
    index = {o: j for j, o in enumerate(outs) if isinstance(o, torch.fx.Node)}
    res = {}
    for j, o in enumerate(outs):
        for n, chain in _view_steps(o):
            if n in index and index[n] != j:
                res[j] = (index[n], chain)
                break
    return res


def _view_steps(o):
    """Walk from node ``o`` down through view ops with static arguments: yields each base
    reached with the views ``[(view op, other args, kwargs)...]`` that lead from it to ``o``."""
    chain = []
    n = o
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and _is_view_op(n.target) \
            and n.args and isinstance(n.args[0], torch.fx.Node) \
            and not any(isinstance(a, torch.fx.Node) for a in n.args[1:]) \
            and not any(isinstance(a, torch.fx.Node) for a in n.kwargs.values()):
        chain.append((n.target, tuple(n.args[1:]), dict(n.kwargs)))
        n = n.args[0]
        yield n, chain[::-1]


def _mutation_views(gm, outs, ph_index):
    """{output index: (placeholder index, [(view op, other args, kwargs)...])} for each graph
    output made by view ops (static arguments) from the value a ``copy_`` writes back into an
    input (functionalized ``x[2:4].fill_(v)`` returned: a view of ``x`` in eager). The runtime
    returns that view of the written input: as an XLA output it was computed again from the
    updated value, and XLA:CPU then copied the whole donated input twice (measured: 1.6 s for a
    2-row write into 512 MiB)."""
    written = {}  # value node -> placeholder index, for the last copy_ into each placeholder
    last = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.copy_.default \
                and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder" \
                and isinstance(n.args[1], torch.fx.Node):
            last[n.args[0]] = n.args[1]
    for ph, src in last.items():
        a, b = ph.meta.get("val"), src.meta.get("val")
        if a is not None and b is not None and tuple(a.shape) == tuple(b.shape) \
                and a.dtype == b.dtype:
            written[src] = ph_index[ph]
    res = {}
    for j, o in enumerate(outs):
        for n, chain in _view_steps(o):
            if n in written:
                res[j] = (written[n], chain)
                break
    return res


class GraphLowering:
    """Static facts about one aten graph, and the traceable function for it."""

    def __init__(self, gm: torch.fx.GraphModule, name: str = "graph"):
        if not _late_lowerings:
            from ..lowering.copy import register_inductor_prims

            register_inductor_prims()
            _late_lowerings.append(True)
        self.gm = gm
        self.name = name
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.ph_index = {n: i for i, n in enumerate(self.placeholders)}
        self.random_nodes = []
        self.mutated = []  # placeholder indices whose value the graph overwrites
        self._checks_acc = None  # while tracing: the checked ops' flags (eager/checks.py)
        self._effect_outs: list = []  # while tracing: effectful ops' results (kept)
        self.check_info = ()
        self.fallback_ops = set()
        # node -> a JAX function applied to that node's value as it is traced (set by a caller
        # that builds on the lowering, e.g. the single-trace trainer; empty: none)
        self.node_hooks: dict = {}
        for n in gm.graph.nodes:
            if n.op != "call_function" or not isinstance(n.target, OpOverload):
                continue
            low = registry.get(n.target)
            if low is None and _is_inplace(n.target):
                f = _functional_of(n.target)
                low = registry.get(f) if f is not None else None
            if low is not None and low.random and low.draws(n.args, n.kwargs):
                self.random_nodes.append(n)
            for name in (low.mutates if low is not None else ()):
                dst = _arg_by_name(n, name)
                if isinstance(dst, torch.fx.Node) and dst.op == "placeholder":
                    if self.ph_index[dst] not in self.mutated:
                        self.mutated.append(self.ph_index[dst])
                elif dst is not None:
                    raise Unsupported(f"{op_name(n.target)} writes {name}, a non-input value")
            if _is_inplace(n.target) or n.target is aten.copy_.default:
                dst = n.args[0]
                if isinstance(dst, torch.fx.Node) and dst.op == "placeholder":
                    i = self.ph_index[dst]
                    if i not in self.mutated:
                        self.mutated.append(i)
                else:
                    raise Unsupported(f"{op_name(n.target)} writes to a non-input value")
        self.random_index = {n: i for i, n in enumerate(self.random_nodes)}
        self.mesh = self._mesh()
        self.host_plan, self.host_mutated = self._host_plan()
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        self.out_node = out_node
        # outputs that are graph inputs unchanged: the runtime returns the input itself
        outs = out_node.args[0]
        self.out_is_input = {}
        if isinstance(outs, (list, tuple)):
            for j, o in enumerate(outs):
                if isinstance(o, torch.fx.Node) and o.op == "placeholder" \
                        and self.ph_index[o] not in self.mutated:
                    self.out_is_input[j] = self.ph_index[o]
        self.out_views = _output_views(outs if isinstance(outs, (list, tuple)) else [outs])
        self.mut_views = _mutation_views(gm, outs if isinstance(outs, (list, tuple)) else [outs],
                                         self.ph_index)

    def _mesh(self):
        """(axis, devices, this process's position) that the graph's collectives need, or None
        (registry ``meta["mesh"]``; see spmd.py)."""
        facts = set()
        for n in self.gm.graph.nodes:
            target, args = (n.target, n.args) if n.op == "call_function" else (None, ())
            if target is _WITH_EFFECTS:  # an effectful op (send/recv): (token, op, *args)
                target, args = args[1], args[2:]
            elif target in _FUNCTIONALIZED:  # a collective that writes its input in place
                target, args = args[0], ()
            low = registry.get(target) if isinstance(target, OpOverload) else None
            spec = low.meta.get("mesh") if low is not None else None
            if spec is None:
                continue
            fact = spec[1](_schema_arg(target, args, n.kwargs, spec[0]))
            if fact is not None:
                facts.add((fact[0], tuple(fact[1]), fact[2]))
        if len(facts) > 1:
            raise Unsupported(
                f"{self.name}: collectives over different process groups in one graph "
                f"({sorted(f[0] for f in facts)}) are not supported by the tpu compiler yet")
        return facts.pop() if facts else None

    # ---- mutations of CPU inputs, replayed on the host ----

    def _host_plan(self):
        """The nodes that recompute every mutated CPU input on the host, or ([], ()).

        A CPU input the graph overwrites (an optimizer's ``step`` count when not capturable)
        would otherwise come back from the device after the program ran: a host sync per call.
        When each such write depends only on CPU inputs, the runtime replays those nodes with
        PyTorch's CPU kernels on the real tensors instead (the device program still computes
        its own copy of the values it needs), and the call stays asynchronous.
        """
        def on_cpu(n):
            if "val" not in n.meta:  # unknown (e.g. stripped by aot_cache): not a host value
                return False
            v = n.meta["val"]
            vals = v if isinstance(v, (list, tuple)) else (v,)
            return all(x.device.type == "cpu" for x in vals if isinstance(x, torch.Tensor))

        cpu_mutated = {i for i in self.mutated if on_cpu(self.placeholders[i])
                       and isinstance(self.placeholders[i].meta.get("val"), torch.Tensor)}
        if not cpu_mutated:
            return [], ()
        host_ok = {}
        writers = []
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                host_ok[n] = on_cpu(n)
            elif n.op == "call_function" and (isinstance(n.target, OpOverload)
                                              or n.target is operator.getitem):
                host_ok[n] = (on_cpu(n) and n not in self.random_index
                              and all(host_ok.get(a, False) for a in n.all_input_nodes))
                dst = n.args[0] if n.args else None
                if isinstance(n.target, OpOverload) and (_is_inplace(n.target) or n.target is aten.copy_.default) \
                        and isinstance(dst, torch.fx.Node) and dst.op == "placeholder" \
                        and self.ph_index[dst] in cpu_mutated:
                    if not host_ok[n]:
                        return [], ()  # some CPU input's new value needs the device
                    writers.append(n)
            else:
                host_ok[n] = False
        needed = set()
        stack = list(writers)
        while stack:
            n = stack.pop()
            if n in needed or n.op == "placeholder":
                continue
            needed.add(n)
            stack.extend(n.all_input_nodes)
        plan = [n for n in self.gm.graph.nodes if n in needed]
        return plan, tuple(sorted(cpu_mutated))

    def replay_on_host(self, args) -> None:
        """Run ``host_plan`` on the call's real inputs (writing the mutated CPU tensors)."""
        env = {p: args[i] for i, p in enumerate(self.placeholders)}
        with torch.no_grad():
            for n in self.host_plan:
                env[n] = n.target(*torch.fx.node.map_arg(n.args, env.__getitem__),
                                  **torch.fx.node.map_arg(n.kwargs, env.__getitem__))

    # ---- tracing ----

    def trace_fn(self, tensor_slots, statics, out_devices, all_flag=False):
        """A function ``f(*arrays[, rng_words]) -> (outputs, new_values_of_mutated_inputs,
        input-check flags)`` (the flags of ops with a registry ``check``, described by
        ``self.check_info`` after the trace). ``all_flag``: with two or more flags, their AND
        leads them (one flag for a sync to read, ``eager/checks.add_program_flags``).

        ``tensor_slots``: placeholder indices fed by arrays, in order; ``statics``: placeholder
        index -> concrete non-tensor value. The outputs that are not arrays (ints, None) are
        recorded into ``self.const_outputs`` during the trace.
        """
        gm = self.gm
        nodes = list(gm.graph.nodes)
        n_arr = len(tensor_slots)
        has_rng = bool(self.random_nodes)
        lowering = self

        def f(*flat):
            env = {}
            lowering._checks_acc = checks = []  # (flag, check info) of checked ops, this trace
            for j, i in enumerate(tensor_slots):
                env[self.placeholders[i]] = flat[j]
            for i, v in statics.items():
                env[self.placeholders[i]] = v
            rng = flat[n_arr] if has_rng else None
            mutated_vals = {}
            lowering._effect_outs = []
            for n in nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outs = n.args[0]
                    break
                if n.op == "get_attr":
                    env[n] = _constant(_fetch_attr(gm, n.target))
                    continue
                if n.op != "call_function":
                    raise Unsupported(f"{self.name}: FX node kind {n.op} ({n.target})")
                args = _plain(torch.fx.node.map_arg(n.args, env.__getitem__))
                kwargs = _plain(torch.fx.node.map_arg(n.kwargs, env.__getitem__))
                env[n] = lowering._eval(n, args, kwargs, rng, mutated_vals)
                hook = lowering.node_hooks.get(n)
                if hook is not None:
                    env[n] = hook(env[n])
            flat_outs = []
            const_outs = []
            new_vals = [mutated_vals[i] for i in lowering.mutated]
            out_list = outs if isinstance(outs, (list, tuple)) else [outs]
            for j, o in enumerate(out_list):
                if j in lowering.out_is_input:
                    const_outs.append(("input", lowering.out_is_input[j]))
                    continue
                if j in lowering.mut_views and (out_devices is None or out_devices[j] != "cpu"):
                    const_outs.append(("mutview", j))  # made by the runtime (_mutation_views)
                    continue
                v = env[o] if isinstance(o, torch.fx.Node) else o
                k = None
                if out_devices is None or out_devices[j] != "cpu":
                    k = next((k for k, nv in enumerate(new_vals) if nv is v), None)
                if k is not None:
                    # an output that is a mutated input's new value (``return x.index_copy_()``):
                    # returned once, as that value (a second output would be a full copy of a
                    # buffer the donated input's one already holds); both tensors share it
                    const_outs.append(("new", k))
                elif _is_array(v):
                    const_outs.append(("array", len(flat_outs)))
                    flat_outs.append(v)
                else:
                    const_outs.append(("const", v))
            # effectful ops' results, after the graph's (no const_outs entry: the runtime
            # never reads them)
            flat_outs.extend(lowering._effect_outs)
            lowering._effect_outs = []
            lowering.const_outputs = (const_outs, isinstance(outs, (list, tuple)))
            lowering.check_info = tuple(info for _, info in checks)
            lowering._checks_acc = None
            flags = tuple(ok for ok, _ in checks)
            if all_flag and len(flags) >= 2:
                flags = (jnp.all(jnp.stack(flags)),) + flags
            return tuple(flat_outs), tuple(new_vals), flags

        return f

    def _eval(self, n, args, kwargs, rng, mutated_vals):
        target = n.target
        if not isinstance(target, OpOverload):
            if target is operator.getitem:
                return args[0][args[1]]
            if getattr(target, "__module__", None) in ("_operator", "operator", "math", "builtins") \
                    or target in (torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min,
                                  torch.sym_not, torch.sym_sqrt):
                return target(*args, **kwargs)
            if target is _WITH_EFFECTS:
                # an op with side effects (_linalg_check_errors), ordered by a token: the
                # token passes through; the op's results follow it, as with_effects returns
                token, op, *rest = args
                # the token orders the effects in the program too: the op's array arguments
                # wait for it, the next token waits for the op's results (an optimization
                # barrier each: XLA may not reorder two sends/recvs that share no data)
                token, rest = _after(token, tuple(rest))
                out = self._call(n, op, rest, kwargs, rng)
                token, out = _after(token, out)
                # its results leave the program even if the graph drops them, so that XLA
                # keeps the effect (a send whose token nothing reads)
                self._effect_outs.extend(
                    o for o in (out if isinstance(out, tuple) else (out,)) if _is_array(o))
                return (token, *out) if isinstance(out, tuple) else (token, out)
            if isinstance(target, torch._ops.HigherOrderOperator):
                hop = hops.get(target)  # subgraph arguments are GraphModules (get_attr)
                if hop is None:
                    raise Unsupported(f"{self.name}: higher-order op {target} is not supported "
                                      "by the tpu compiler")
                return hop(*args, **kwargs)
            return target(*args, **kwargs)
        if target is aten.sym_size.int:
            return int(args[0].shape[args[1]])
        if target is aten.sym_numel.default:
            return int(args[0].size)
        if target is aten.sym_stride.int:
            shape = args[0].shape
            st = 1
            for s in shape[args[1] + 1:]:
                st *= s
            return st
        if target is aten.copy_.default:
            dst, src = args[0], args[1]
            new = jnp.broadcast_to(src.astype(dst.dtype), dst.shape)
            mutated_vals[self.ph_index[n.args[0]]] = new
            return new
        if _is_inplace(target):
            # a direct in-place lowering returns the new value of self; else use the functional op
            func = target if registry.get(target) is not None else _functional_of(target)
            if func is None:
                raise Unsupported(f"{self.name}: in-place op {op_name(target)} has no functional form")
            new = self._call(n, func, args, kwargs, rng)
            dst = args[0]
            new = jnp.broadcast_to(new.astype(dst.dtype), dst.shape)
            if isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder":
                mutated_vals[self.ph_index[n.args[0]]] = new
            return new
        low = registry.get(target)
        if low is not None and low.mutates:
            out = self._call(n, target, args, kwargs, rng)
            nres = len(target._schema.returns)
            for name, new in zip(low.mutates, out[nres:]):
                dst = _arg_by_name(n, name)
                if new is not None and isinstance(dst, torch.fx.Node):
                    old = self._value_of_node_arg(dst, args, kwargs, name, n)
                    mutated_vals[self.ph_index[dst]] = new.astype(old.dtype).reshape(old.shape)
            res = tuple(out[:nres])
            return res[0] if nres == 1 else res
        return self._call(n, target, args, kwargs, rng)

    @staticmethod
    def _value_of_node_arg(dst, args, kwargs, name, n):
        for i, a in enumerate(n.target._schema.arguments):
            if a.name == name:
                if a.kwarg_only or i >= len(args):
                    return kwargs[name]
                return args[i]
        raise KeyError(name)

    def _call(self, n, op, args, kwargs, rng):
        low = registry.get(op)
        dyn = low is not None and low.dynamic_shape
        if dyn and dyn is not True:
            dyn = dyn(args, kwargs)  # a per-call predicate (e.g. boolean-mask indexing)
        if low is not None and not dyn:
            if low.reads_layout:
                val = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
                if val is None:
                    raise Unsupported(f"{self.name}: {op_name(op)} needs its input's layout")
                kwargs = {**kwargs, "layout": (tuple(int(s) for s in val.stride()),
                                               int(val.storage_offset()))}
            if low.check is not None and self._checks_acc is not None:
                ok = jnp.asarray(low.check[0](*args, **kwargs), jnp.bool_)
                self._checks_acc.append((ok, (op_name(op),) + tuple(low.check[1:])))
            if "mesh" in low.meta:
                count("compile_collectives", op=op_name(op))  # once per program built
            if low.random:
                kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
                if not low.draws(n.args, n.kwargs):  # this call draws nothing
                    return low.fn(None, *args, **kwargs)
                i = self.random_index.get(n)
                if i is None:  # an in-place random op traced through its functional form
                    raise Unsupported(f"{self.name}: random op {op_name(op)} outside the table")
                return low.fn(_rng.key_from(rng[i]), *args, **kwargs)
            return low.fn(*args, **kwargs)
        return self._cpu_callback(op, args, kwargs)

    def _cpu_callback(self, op, args, kwargs):
        """Run ``op`` on CPU inside the program (jax.pure_callback): slow, never wrong."""
        name = op_name(op)
        from ..eager import fallback as _fallback

        if not _fallback.enabled():
            raise NotImplementedError(
                f"Could not run '{name}' in a graph compiled for the 'tpu' backend: it has no "
                "lowering and the CPU fallback is disabled (torch.tpu.enable_cpu_fallback = False).")
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"torchtpu.compile: {name} has no lowering; it runs on CPU inside the "
                          "compiled program (slow). Counted in torch.tpu.metrics()['per_op']"
                          "['compile_cpu_fallbacks'].", stacklevel=2)
        count("compile_cpu_fallbacks", op=name)
        self.fallback_ops.add(name)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_array)
        arr_pos = [i for i, x in enumerate(leaves) if _is_array(x)]
        arrays = [leaves[i] for i in arr_pos]
        # output shapes from PyTorch's meta kernels on the concrete input shapes
        meta_leaves = list(leaves)
        for i in arr_pos:
            meta_leaves[i] = torch.empty(leaves[i].shape, dtype=to_torch(leaves[i].dtype),
                                         device="meta")
        meta_leaves = [_to_device(x, "meta") for x in meta_leaves]
        margs, mkwargs = jax.tree_util.tree_unflatten(treedef, meta_leaves)
        try:
            with torch.no_grad():
                mout = op(*margs, **mkwargs)
        except Exception as e:
            # no shape without the data: .item() or nonzero captured into the graph
            # (torch._dynamo.config.capture_scalar_outputs / capture_dynamic_output_shape_ops)
            raise Unsupported(
                f"{self.name}: {name} has a data-dependent result, which a graph compiled for "
                "the 'tpu' backend (static shapes) cannot hold; leave torch._dynamo.config."
                "capture_scalar_outputs and capture_dynamic_output_shape_ops off, so that "
                "Dynamo breaks the graph there") from e
        out_leaves, out_tree = jax.tree_util.tree_flatten(mout, is_leaf=lambda x: isinstance(x, torch.Tensor))
        shapes = [jax.ShapeDtypeStruct(tuple(t.shape), to_jax(t.dtype)) for t in out_leaves]
        cpu_leaves = [_to_device(x, "cpu") for x in leaves]

        def host(*np_arrays):
            ls = list(cpu_leaves)
            for i, a in zip(arr_pos, np_arrays):
                ls[i] = _np_to_torch(np.asarray(a))
            a_, k_ = jax.tree_util.tree_unflatten(treedef, ls)
            with torch.no_grad():
                out = op(*a_, **k_)
            outs = jax.tree_util.tree_flatten(out, is_leaf=lambda x: isinstance(x, torch.Tensor))[0]
            return tuple(_torch_to_np(o) for o in outs)

        if not arrays and torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
            # a factory (iota, arange...): its value is a constant of the program
            return jax.tree_util.tree_unflatten(out_tree, [jnp.asarray(x) for x in host()])
        res = jax.pure_callback(host, tuple(shapes), *arrays, vmap_method="sequential")
        return jax.tree_util.tree_unflatten(out_tree, list(res))


def _after(token, tree):
    """(token, tree) behind one optimization barrier over the token and the tree's arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_array)
    idx = [i for i, v in enumerate(leaves) if _is_array(v)]
    if not _is_array(token) or not idx:
        return token, tree
    token, arrays = lax.optimization_barrier((token, [leaves[i] for i in idx]))
    for i, a in zip(idx, arrays):
        leaves[i] = a
    return token, jax.tree_util.tree_unflatten(treedef, leaves)


def _arg_by_name(n, name):
    """The FX argument of node ``n`` bound to schema argument ``name`` (None if absent)."""
    return _schema_arg(n.target, n.args, n.kwargs, name)


def _schema_arg(op, args, kwargs, name):
    """The argument bound to schema argument ``name`` in a call of ``op`` (None if absent)."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            if a.name in kwargs:
                return kwargs[a.name]
            if not a.kwarg_only and i < len(args):
                return args[i]
            return None
    return None


def _plain(x):
    """FX's immutable containers -> plain list/tuple/dict (what kernels receive)."""
    t = type(x)
    if t is tuple:
        return tuple(_plain(e) for e in x)
    if isinstance(x, list):
        return [_plain(e) for e in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def _to_device(x, dev):
    if isinstance(x, torch.device):
        return torch.device(dev)
    return x


def _np_to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


# graph constants: shared with the HOP subgraph runner (lowering/hops.py)
_torch_to_np = hops.torch_to_np
_fetch_attr = hops.fetch_attr
_constant = hops.constant
