"""Fused eager mode (``torch.tpu.EagerMode.DEFER_AND_FUSE``): record ops, compile at a cut.

While the mode is on, every op that the Strict executor would run is recorded instead: its
outputs are ordinary tpu tensors whose storage holds a ``PendingBuffer`` (shape and dtype known
from a cached abstract evaluation, value not computed yet). A *cut* compiles the recorded
sequence as one XLA program, cached by its fingerprint (ops, static args, views, which values
are still alive), runs it, and fills the pending buffers that are still referenced. Values no
longer referenced are never materialised.

Cuts happen when a value is read (``.item()``, ``.cpu()``, printing, a kernel that needs the
concrete array), at ``torch.tpu.synchronize()``, on a mode switch, when the pending graph reaches
its size limit, and before ops with data-dependent output shapes.

A recorded node applies the same per-op pure function that Strict mode jits
(``executor.make_traced``), so the two modes share the lowering table and its semantics.
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref

import jax
import numpy as np
import torch

from ..lowering.registry import matmul_precision
from ..runtime import buffer as _buffer
from ..runtime import sync as _sync
from ..runtime.metrics import COUNTERS, count
from . import checks as _checks
from . import executor, modes

Tensor = torch.Tensor
MAX_NODES = int(os.environ.get("TORCHTPU_FUSED_MAX_OPS", "4000"))
DONATE = os.environ.get("TORCHTPU_FUSED_DONATE", "1") not in ("0", "")


class PendingBuffer(_buffer.Buffer):
    """A storage buffer whose array is an output of the pending graph.

    Reading ``.array`` cuts the graph. Writing it (a non-recorded kernel assigning a concrete
    value) simply replaces the value.
    """

    __slots__ = ("_value", "ref", "aval")

    def __init__(self, ref, aval):
        self._value = None
        self.ref = ref  # (node index, output index) in the current graph
        self.aval = aval

    @property
    def array(self):
        if self._value is None:
            flush("read")
        return self._value

    @array.setter
    def array(self, value):
        self._value = value
        self.ref = None

    @property
    def pending(self) -> bool:
        return self._value is None and self.ref is not None

    def __repr__(self):
        return f"PendingBuffer({self.aval}, ref={self.ref})"


class _Node:
    __slots__ = ("key", "traced", "refs", "n_out")

    def __init__(self, key, traced, refs, n_out):
        self.key = key
        self.traced = traced
        self.refs = refs  # per flat argument: ("i", input index) or ("n", node, output)
        self.n_out = n_out


class _Graph:
    def __init__(self):
        self.nodes: list[_Node] = []
        self.inputs: list = []
        self.input_ids: dict = {}
        self.pending: list = []  # weakrefs to PendingBuffers, in creation order

    def input_ref(self, arr):
        i = self.input_ids.get(id(arr))
        if i is None:
            i = self.input_ids[id(arr)] = len(self.inputs)
            self.inputs.append(arr)
        return ("i", i)


_graph = [_Graph()]
_AVALS: dict = {}  # per-op abstract evaluation: (strict key, input avals) -> (traced, out avals)
_PROGRAMS: dict = {}  # fingerprint -> jitted program
_flushing = [False]


_AVAL_CACHE: dict = {}


def _aval(shape, dtype, weak=False):
    """The canonical ShapeDtypeStruct for (shape, dtype, weak): one object each, so recording
    keys on its id (constructing or hashing one costs microseconds)."""
    a = _AVAL_CACHE.get((shape, dtype, weak))
    if a is None:
        a = _AVAL_CACHE[(shape, dtype, weak)] = jax.ShapeDtypeStruct(shape, dtype,
                                                                     weak_type=weak)
    return a


_SCALAR_AVALS = {t: _aval((), np.dtype(jax.dtypes.canonicalize_dtype(t)), True)
                 for t in (bool, int, float, complex)}


def _scalar_aval(v):
    """The abstract value jit gives a scalar argument: Python numbers are weakly typed."""
    a = _SCALAR_AVALS.get(type(v))
    if a is not None:
        return a
    return _aval(np.shape(v), np.dtype(v.dtype))


def _canonical(out):
    if isinstance(out, jax.ShapeDtypeStruct):
        return _aval(tuple(out.shape), np.dtype(out.dtype), bool(out.weak_type))
    if isinstance(out, (tuple, list)):
        return type(out)(_canonical(o) for o in out)
    return out


def _on_device0(args, kwargs) -> bool:
    tensors: list = []
    executor._key(args, tensors)
    executor._key(list(kwargs.values()), tensors)
    for t in tensors:
        if isinstance(t, Tensor) and t.device.type == "tpu":
            return not t.device.index
    return executor._device_index(kwargs.get("device")) == 0


def record(lowering, kind, args, kwargs):
    """Record one op (the executor hands it over while the mode is DEFER_AND_FUSE)."""
    dyn = lowering.dynamic_shape
    if dyn and (dyn is True or dyn(args, kwargs)):
        flush("dynamic_shape")
        return executor.run_strict(lowering, kind, args, kwargs)
    if executor._multi_device() and not _on_device0(args, kwargs):
        # pending tensors are created on tpu:0; ops on other devices run strict (uncut graph
        # on tpu:0 keeps recording)
        return executor.run_strict(lowering, kind, args, kwargs)
    g = _graph[0]
    gen = None
    if lowering.random and "generator" in kwargs:
        kwargs = dict(kwargs)
        gen = kwargs.pop("generator")
    orig = (args, kwargs)
    traced_scalars = lowering.scalar_args and not lowering.meta.get("static_scalars")
    if traced_scalars:
        args, kwargs = executor._trace_scalars(lowering, args, kwargs)
    tensors: list = []
    key_args = executor._key(args, tensors)
    key_kwargs = tuple([(k, executor._key(v, tensors)) for k, v in kwargs.items()]) if kwargs else ()
    refs = []
    flat_avals = []
    specs = []
    offs = []
    for t in tensors:
        if type(t) is executor.Traced:
            v = t.flat()
            refs.append(g.input_ref(v))
            flat_avals.append(_scalar_aval(v))
            specs.append(None)
            continue
        try:
            buf = t.untyped_storage()._tpu_buffer
        except AttributeError:
            v = executor.cpu_scalar(t, lowering, tensors)
            refs.append(g.input_ref(v))
            flat_avals.append(_scalar_aval(v))
            specs.append(None)
            continue
        if type(buf) is PendingBuffer and buf.pending:
            refs.append(("n",) + buf.ref)
            aval = buf.aval
        else:
            arr = buf.array
            refs.append(g.input_ref(arr))
            aval = _aval(arr.shape, arr.dtype)
        flat_avals.append(aval)
        spec, off = executor.spec_for(t, aval)
        specs.append(spec)
        if off is not None:
            offs.append(off)
    specs = tuple(specs)
    for off in offs:
        a = np.asarray(off, dtype=np.int64)
        refs.append(g.input_ref(a))
        flat_avals.append(_aval((), np.dtype(np.int64)))
    if lowering.random:
        words = executor._rng.next_state(gen)
        refs.append(g.input_ref(words))
        flat_avals.append(jax.ShapeDtypeStruct(words.shape, words.dtype))
    skey = (lowering, kind, key_args, key_kwargs, specs)
    if lowering.reads_precision:
        skey = skey + (matmul_precision(),)
    akey = (skey, tuple([id(a) for a in flat_avals]))
    hit = _AVALS.get(akey)
    if hit is None:
        ws = executor._write_slots(kind, args, kwargs)
        checked = lowering.check is not None
        traced = executor.make_traced(lowering, kind, args, kwargs, specs, tensors, ws,
                                      with_check=checked)
        try:
            out_avals = _canonical(jax.eval_shape(traced, *flat_avals))
        except jax.errors.ConcretizationTypeError:
            if not traced_scalars:
                raise
            lowering.meta["static_scalars"] = True  # it branches on a scalar: bake them in
            return record(lowering, kind, orig[0], orig[1])
        check_aval = None
        if checked:  # (outputs, inputs-valid flag): the flag is the node's last output
            out_avals, check_aval = out_avals
            traced = _flat_checked(traced)
        hit = _AVALS[akey] = (traced, out_avals, ws, check_aval)
        count("fused_op_traces", op=lowering.name)
    traced, out_avals, ws, check_aval = hit
    node_index = len(g.nodes)
    is_seq = isinstance(out_avals, (tuple, list))
    outs = out_avals if is_seq else (out_avals,)
    g.nodes.append(_Node(akey, traced, tuple(refs), len(outs) + (check_aval is not None)))
    COUNTERS["fused_ops_recorded"] += 1

    def pending(i, aval):
        pb = PendingBuffer((node_index, i), aval)
        g.pending.append(weakref.ref(pb))
        return pb

    if kind == executor.FUNCTIONAL or kind == executor.FUNCTIONAL_RAW:
        results = [_result(i, aval, pending) for i, aval in enumerate(outs)]
        if lowering.mutates:
            n = len(lowering.mutates)
            _write_mutated(lowering, args, kwargs, results[-n:])
            results = results[:-n]
            res = results[0] if len(results) == 1 else tuple(results)
        else:
            res = type(out_avals)(results) if is_seq else results[0]
    else:
        for i, (slot, aval) in enumerate(zip(ws, outs)):
            tensors[slot].untyped_storage()._tpu_buffer = pending(i, aval)
        res = args[0] if args else kwargs["self"]
    if check_aval is not None:
        _checks.add(pending(len(outs), check_aval), lowering.name, *lowering.check[1:])
    if len(g.nodes) >= MAX_NODES:
        flush("size_limit")
    return res


def _flat_checked(traced):
    """A checked op's function with its flag appended to its flat outputs."""
    def flat(*args):
        out, ok = traced(*args)
        return (tuple(out) if isinstance(out, (tuple, list)) else (out,)) + (ok,)

    return flat


def _result(i, aval, pending):
    if aval is None:
        return None
    if type(aval) is executor._Static:
        return aval.value
    return _buffer.wrap_pending(aval, pending(i, aval))


def _write_mutated(lowering, args, kwargs, news):
    """Registry flag ``mutates``: record a copy of each new value into its argument."""
    names = [a.name for a in lowering.op._schema.arguments]
    for name, new in zip(lowering.mutates, news):
        i = names.index(name)
        t = args[i] if i < len(args) else kwargs.get(name)
        if t is not None and new is not None:
            record(executor.copy_lowering(), executor.DIRECT_INPLACE, (t, new), {})


def _refcounts(inputs):
    counts = []
    for i in range(len(inputs)):
        x = inputs[i]
        counts.append(sys.getrefcount(x))
    return counts


# what _refcounts reports for an object that only the list refers to
_BASE = _refcounts([object()])[0]


def _unreferenced(inputs):
    """Indices of input arrays nothing but the graph refers to any more (their storages were
    overwritten in place, or their tensors died): safe to donate to the program."""
    return tuple(i for i, (x, n) in enumerate(zip(inputs, _refcounts(inputs)))
                 if n <= _BASE and isinstance(x, jax.Array))


def _fingerprint(g, live, donate):
    return (tuple(n.key for n in g.nodes), tuple(n.refs for n in g.nodes),
            tuple(pb.ref for pb in live), donate)


def _make_program(nodes, out_refs, donate=()):
    nodes = [(n.traced, n.refs) for n in nodes]

    def program(*inputs):
        env = []
        for traced, refs in nodes:
            args = [inputs[r[1]] if r[0] == "i" else env[r[1]][r[2]] for r in refs]
            out = traced(*args)
            env.append(tuple(out) if isinstance(out, (tuple, list)) else (out,))
        return tuple(env[n][i] for n, i in out_refs)

    return jax.jit(program, donate_argnums=donate)


def flush(reason: str = "explicit") -> None:
    """Cut: compile (or fetch) the pending graph's program, run it, fill live pending buffers."""
    g = _graph[0]
    if not g.nodes or _flushing[0]:
        return
    _flushing[0] = True
    try:
        _graph[0] = _Graph()
        live = []
        seen = set()
        for w in g.pending:
            pb = w()
            if pb is not None and pb._value is None and pb.ref is not None and id(pb) not in seen:
                seen.add(id(pb))
                live.append(pb)
        count("fused_graph_cuts", op=reason)
        COUNTERS["fused_ops_executed"] += len(g.nodes)
        if not live:
            return
        inputs = g.inputs
        g.inputs = None
        g.input_ids = None
        donate = _unreferenced(inputs) if DONATE else ()
        fp = _fingerprint(g, live, donate)
        prog = _PROGRAMS.get(fp)
        if prog is None:
            count("fused_graph_compiles")
            prog = _PROGRAMS[fp] = _make_program(g.nodes, [pb.ref for pb in live], donate)
        else:
            count("fused_graph_cache_hits")
        if donate:
            count("fused_donated_buffers", len(donate))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                results = prog(*inputs)
        except Exception as e:  # name the user's ops, as Debug mode would
            ops = sorted({str(n.key[0][0].op) for n in g.nodes})
            raise RuntimeError(f"torchtpu fused graph of {len(g.nodes)} ops failed "
                               f"(ops: {', '.join(ops[:20])}): {e}") from e
        if modes.get_eager_mode() is modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            jax.block_until_ready(results)
        for pb, v in zip(live, results):
            pb._value = v
            pb.ref = None
    finally:
        _flushing[0] = False


def _on_switch(old, new):
    if old is modes.EagerMode.DEFER_AND_FUSE:
        flush("mode_switch")


def install() -> None:
    executor.fused_run = record
    modes.on_switch(_on_switch)
    _sync.on_synchronize(lambda: flush("synchronize"))
