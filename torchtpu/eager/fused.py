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

import hashlib
import os
import sys
import threading
import warnings

import jax
import numpy as np
import torch

from ..lowering.attention import layout_order as _layout_order
from ..lowering.registry import matmul_precision
from ..runtime import buffer as _buffer
from ..runtime import disk_cache as _disk
from ..runtime import memory as _memory
from ..runtime import program_cache as _program_cache
from ..runtime import sync as _sync
from ..runtime.metrics import COUNTERS, count
from . import checks as _checks
from . import fastpath as _fastpath
from . import fused_shapes as _shapes
from . import executor, modes, views
from .executor import FUNCTIONAL, FUNCTIONAL_RAW, Traced, _NP
from .executor import arg_keys as _arg_keys

Tensor = torch.Tensor
MAX_NODES = int(os.environ.get("TORCHTPU_FUSED_MAX_OPS", "4000"))
DONATE = os.environ.get("TORCHTPU_FUSED_DONATE", "1") not in ("0", "")
# Cut where a backward pass starts when the graph recorded so far is large: the backward, the
# optimizer and the next forward then form one program instead of forward + backward +
# optimizer, and the backward records while the forward runs. Measured on XLA:CPU
# (docs/benchmarks.md): the small GPT's Fused step 10% faster; the MLP's graph (~30 ops) was
# not helped, so small graphs are not cut.
CUT_AT_BACKWARD = os.environ.get("TORCHTPU_FUSED_CUT_AT_BACKWARD", "1") not in ("0", "")
BACKWARD_CUT_MIN_OPS = 100
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass


class PendingBuffer(_buffer.Buffer):
    """A storage buffer whose array is an output of the pending graph.

    Reading ``.array`` cuts the graph. Writing it (a non-recorded kernel assigning a concrete
    value) simply replaces the value.
    """

    __slots__ = ("_value", "ref", "aval", "error")

    def __init__(self, ref, aval):
        self._value = None
        self.ref = ref  # ("n", node index, output index) in the current graph
        self.aval = aval

    @property
    def array(self):
        if self._value is None:
            if self.ref is None:
                raise self.lost()
            flush("read")
        return self._value

    def lost(self) -> RuntimeError:
        """The error for a value whose graph failed to run (it will never be computed)."""
        return RuntimeError("this tpu tensor's value was never computed: the Fused graph that "
                            f"produces it failed ({self.error})")

    @array.setter
    def array(self, value):
        self._value = value
        self.ref = None

    @property
    def pending(self) -> bool:
        return self._value is None and self.ref is not None

    def __repr__(self):
        return f"PendingBuffer({self.aval}, ref={self.ref})"


class _Graph:
    """The ops recorded since the last cut. A node is (abstract key, pure function, refs): per
    flat argument of the function, ``("i", input index)`` or ``("n", node, output)``."""

    __slots__ = ("nodes", "inputs", "input_ids", "pending", "task")

    def __init__(self):
        self.nodes: list = []
        self.inputs: list = []
        self.input_ids: dict = {}
        # every PendingBuffer made, in creation order; at the cut, those nothing else refers to
        # any more (their tensors died) are dead values and are not materialised
        self.pending: list = []
        self.task = -1  # the autograd graph task its ops were recorded in (-1: none)

    def input_ref(self, arr):
        i = self.input_ids.get(id(arr))
        if i is None:
            i = self.input_ids[id(arr)] = len(self.inputs)
            self.inputs.append(arr)
        return ("i", i)


_ShapeDtype = jax.ShapeDtypeStruct
_wrap_pending = _buffer.wrap_pending
_default_dtype = torch.get_default_dtype
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


_shapes._aval = _aval
_shapes._static = executor._Static

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


# The pending graph is one for every thread: recording and cutting own it (re-entrant per
# thread; another thread waits). The C++ Kernels' lock where they record (install), else this.
_lock = threading.RLock()
_enter, _exit = _lock.acquire, _lock.release


def record(lowering, kind, args, kwargs):
    """Record one op (the executor hands it over while the mode is DEFER_AND_FUSE)."""
    _enter()
    try:
        return _record(lowering, kind, args, kwargs)
    finally:
        _exit()


def _record(lowering, kind, args, kwargs):
    dyn = lowering.dynamic_shape
    if dyn and (dyn is True or dyn(args, kwargs)):
        flush("dynamic_shape")
        return executor.run_strict(lowering, kind, args, kwargs)
    if executor._multi_device() and not _on_device0(args, kwargs):
        # pending tensors are created on tpu:0; ops on other devices run strict (uncut graph
        # on tpu:0 keeps recording)
        return executor.run_strict(lowering, kind, args, kwargs)
    g = _graph[0]
    if CUT_AT_BACKWARD:
        task = _graph_task()
        if task != g.task:
            if task >= 0 and len(g.nodes) >= BACKWARD_CUT_MIN_OPS:  # entering a backward
                flush("backward_boundary")
                g = _graph[0]
            g.task = task
    gen = None
    if lowering.random and "generator" in kwargs:
        kwargs = dict(kwargs)
        gen = kwargs.pop("generator")
    draws = lowering.random and lowering.draws(args, kwargs)
    if lowering.reads_layout:
        kwargs = executor.with_layout(args, kwargs)
    orig = (args, kwargs)
    args, kwargs, wrapped = executor.trace_scalars(lowering, args, kwargs)
    tensors: list = []
    key_args, key_kwargs = _arg_keys(args, kwargs, tensors, wrapped)
    refs = []
    aval_ids = []
    flat_avals = []
    specs = []
    offs = None
    input_ids = g.input_ids
    # what the C++ recording path needs to replay this call (fastpath.offer_fused): per
    # reference a tensor ordinal or a traced scalar's value; None once it cannot (a CPU scalar)
    plan = [] if _fastpath.pending() is lowering else None
    for t in tensors:
        if type(t) is Traced:
            v = t.flat()
            aval = _scalar_aval(v)
            spec = None
            if plan is not None:
                plan.append(("c", v))
        else:
            try:
                buf = t.untyped_storage()._tpu_buffer
            except AttributeError:
                v = executor.cpu_scalar(t, lowering, tensors)
                aval = _scalar_aval(v)
                spec = None
                plan = None
            else:
                if plan is not None:
                    plan.append(None)  # the next tensor ordinal (numbered in _offer)
                if type(buf) is PendingBuffer and buf._value is None:
                    v = None
                    if buf.ref is None:
                        raise buf.lost()
                    refs.append(buf.ref)
                    aval = buf.aval
                else:
                    v = buf.array
                    aval = _aval(v.shape, v.dtype)
                # executor.spec_for, inlined
                if t.storage_offset() == 0 and t.is_contiguous() and aval.shape == t.shape \
                        and not t.is_conj() and not t.is_neg() and _NP[t.dtype] == aval.dtype:
                    spec = None
                else:
                    spec, off = views.spec_of(t, aval)
                    if off is not None:
                        if offs is None:
                            offs = []
                        offs.append(off)
        if v is not None:  # a graph input (g.input_ref, inlined)
            i = input_ids.get(id(v))
            if i is None:
                i = input_ids[id(v)] = len(g.inputs)
                g.inputs.append(v)
            refs.append(("i", i))
        flat_avals.append(aval)
        aval_ids.append(id(aval))
        specs.append(spec)
    specs = tuple(specs)
    if offs is not None:
        off_aval = _SCALAR_AVALS[int]  # executor.offset_value: weakly typed, as Strict passes it
        inputs = g.inputs
        for off in offs:
            # the cached device scalar Strict passes (a host number cost the graph's call a
            # transfer per offset); one input per offset, as before: the graph's key holds no
            # offset value, so offsets that happen to be equal do not change it
            refs.append(("i", len(inputs)))
            inputs.append(executor.offset_value(off))
            if plan is not None:
                plan.append(("o", inputs[-1]))
            flat_avals.append(off_aval)
            aval_ids.append(id(off_aval))
    if draws:
        words = executor._rng.next_state(gen)
        refs.append(g.input_ref(words))
        words_aval = _aval(words.shape, np.dtype(words.dtype))
        flat_avals.append(words_aval)
        aval_ids.append(id(words_aval))
    skey = (lowering, kind, key_args, key_kwargs, specs, _default_dtype())
    if lowering.reads_precision:
        skey = skey + (matmul_precision(),)
    groups = None
    if kind != FUNCTIONAL and kind != FUNCTIONAL_RAW:
        groups = executor.storage_groups(kind, args, kwargs, tensors, lowering)
        if groups is not None:
            skey = skey + (groups,)
    akey = (skey, tuple(aval_ids))
    hit = _AVALS.get(akey)
    if hit is None:
        traced_scalars = args is not orig[0] or kwargs is not orig[1] or any(
            type(t) is Traced for t in tensors)
        text = _shapes.spell(skey)
        hit = _trace_node(lowering, kind, executor._trace_wrapped(args, wrapped), kwargs, specs,
                          tensors, flat_avals, traced_scalars, groups,
                          _shapes.key_text(text, flat_avals))
        if hit is None:  # it branches on a scalar: its scalars are baked in from now on
            return record(lowering, kind, orig[0], orig[1])
        hit = _AVALS[akey] = hit + (text,)
    traced, out_avals, ws, check_aval, nest, text = hit
    nodes = g.nodes
    node_index = len(nodes)
    nodes.append((akey, traced, tuple(refs), text))
    COUNTERS["fused_ops_recorded"] += 1
    pending = g.pending
    if kind == FUNCTIONAL or kind == FUNCTIONAL_RAW:
        if type(out_avals) is _ShapeDtype and not lowering.mutates:  # the common case
            pb = PendingBuffer(("n", node_index, 0), out_avals)
            pending.append(pb)
            res = _wrap_pending(out_avals, pb)
        else:
            is_seq = isinstance(out_avals, (tuple, list))
            outs = out_avals if is_seq else (out_avals,)
            results = [_result(node_index, i, aval, pending) for i, aval in enumerate(outs)]
            if lowering.mutates:
                n = len(lowering.mutates)
                _write_mutated(lowering, args, kwargs, results[-n:])
                results = results[:-n]
                res = results[0] if len(results) == 1 else tuple(results)
            elif nest is not None:  # regroup the flat outputs into the op's Tensor[] results
                it = iter(results)
                res = tuple([next(it) for _ in range(n)] if n is not None else next(it)
                            for n in nest)
            else:
                res = type(out_avals)(results) if is_seq else results[0]
    else:
        outs = out_avals if isinstance(out_avals, (tuple, list)) else (out_avals,)
        for i, (slot, aval) in enumerate(zip(ws, outs)):
            pb = PendingBuffer(("n", node_index, i), aval)
            pending.append(pb)
            tensors[slot].untyped_storage()._tpu_buffer = pb
        res = args[0] if args else kwargs["self"]
    if plan is not None and kind == FUNCTIONAL and not draws and gen is None \
            and nest is None and _replayable(lowering):
        _offer(lowering, akey, traced, text, plan, tensors, flat_avals, out_avals, orig[0],
               None if check_aval is None else (check_aval, executor._check_adder(lowering)))
    if check_aval is not None:
        n_out = len(out_avals) if isinstance(out_avals, (tuple, list)) else 1
        pb = PendingBuffer(("n", node_index, n_out), check_aval)
        pending.append(pb)
        _checks.add(pb, lowering.name, *lowering.check[1:])
    if node_index + 1 >= MAX_NODES:
        flush("size_limit")
    return res


_REPLAYABLE: dict = {}  # lowering -> whether the C++ path may replay its recordings


def _replayable(lowering) -> bool:
    """Whether recording ``lowering`` is, past its key, a function of the inputs' abstract
    values alone (what the C++ recording path checks): no data-dependent shape, random state
    drawn whatever the scalars (``random=True``; a call that draws is never offered: whether it
    draws is a function of its scalars, which the key holds by value, as for Strict's entries,
    unless the lowering traces some: then it is not replayed), mutated
    arguments, layout read from the arguments, restrided results other than ``eager_layout_like``
    ones (the entry restrides them as the Python kernel does), host tensors, and one device
    (ops on tpu:N>0 run strict)."""
    ok = _REPLAYABLE.get(lowering)
    if ok is None:
        ok = _REPLAYABLE[lowering] = not (
            lowering.dynamic_shape or lowering.random is True or lowering.mutates
            or (lowering.random and lowering.scalar_args)
            or lowering.reads_layout
            or (lowering.meta.get("eager_layout") is not None
                and lowering.meta.get("eager_layout_like") is None)
            or lowering.meta.get("host_tensors"))
    return ok and not executor._multi_device()


def _offer(lowering, akey, traced, text, plan, tensors, flat_avals, out_avals, args,
           check=None) -> None:
    """Hand this call's recording to the C++ path (eager/fastpath.py ``offer_fused``): the next
    call with the same Kernel key and inputs' abstract values appends the same node and makes
    the same outputs without this function. A result of an ``eager_layout_like`` op carries
    its order (lowering/attention.py ``layout_order`` of the positional argument it is laid out
    like, read from metadata the key holds): the entry restrides it as the kernel's
    ``eager_layout`` does with ``record``'s result. ``check``: a checked op's (flag aval, what
    the flag goes to: ``checks.add`` with the op's name, exception and message bound)."""
    like = lowering.meta.get("eager_layout_like")
    if type(out_avals) is tuple:
        results, tuple_out = out_avals, True
    elif type(out_avals) is _ShapeDtype:
        results, tuple_out = (out_avals,), False
    else:
        return
    outs = []
    for a in results:
        if a is None:
            outs.append(None)
        elif type(a) is executor._Static:
            outs.append(("s", a.value))
        elif type(a) is _ShapeDtype:
            out = (a, tuple(a.shape), _buffer._meta(tuple(a.shape), a.dtype)[1])
            p = like[len(outs)] if like is not None and len(outs) < len(like) else None
            if p is not None and p < len(args) and isinstance(args[p], Tensor):
                order = _layout_order(len(a.shape), args[p])
                if order is not None:
                    out = out + (order,)
            outs.append(out)
        else:
            return
    ins = []
    for i, t in enumerate(tensors):
        if plan[i] is None:  # a tensor: its ordinal among the Kernel's tensors
            plan[i] = len(ins)
            a = flat_avals[i]
            ins.append((a, tuple(a.shape), a.dtype))
    try:
        _fastpath.offer_fused(lowering, akey, traced, text, plan, ins, tuple_out, outs, check)
    except Exception as e:  # noqa: BLE001 - an entry not installed: record runs each time
        count("fused_fastpath_offer_errors")
        _fastpath._log.debug("torchtpu: fused recording entry not installed: %r", e)


def _trace_node(lowering, kind, args, kwargs, specs, tensors, flat_avals, traced_scalars,
                groups=None, text=None):
    """A new node kind: its pure function and abstract outputs (None: retry with static
    scalars). ``text``: the key's persistent spelling, under which an earlier process may have
    kept the outputs (fused_shapes.py: then nothing is traced)."""
    ws = executor._write_slots(kind, args, kwargs, lowering)
    checked = lowering.check is not None
    traced = executor.make_traced(lowering, kind, args, kwargs, specs, tensors, ws,
                                  with_check=checked, groups=groups)
    if groups is not None:  # one new array per written storage
        ws = executor._write_slots(kind, args, kwargs, lowering, groups)
    out_avals = _shapes.lookup(text) if text is not None else None
    if out_avals is None:
        try:
            out_avals = _canonical(jax.eval_shape(traced, *flat_avals))
        except (TypeError, ValueError) as e:
            if traced_scalars and isinstance(e, jax.errors.ConcretizationTypeError):
                lowering.meta["static_scalars"] = True
                _fastpath.clear()  # entries that pass traced scalars the op now bakes in
                return None
            err = executor._trace_error(lowering, tensors, e)  # PyTorch's exception, as Strict
            if err is e:
                raise
            raise err from e
        count("fused_op_traces", op=lowering.name)
        if text is not None:
            _shapes.keep(text, out_avals)
    check_aval = None
    if checked:  # (outputs, inputs-valid flag): the flag is the node's last output
        out_avals, check_aval = out_avals
        traced = _flat_checked(traced)
    nest = None
    if isinstance(out_avals, tuple) and any(isinstance(o, list) for o in out_avals):
        # results that are lists of tensors: the node's outputs are the flattened arrays
        nest = tuple(len(o) if isinstance(o, list) else None for o in out_avals)
        out_avals = tuple(a for o in out_avals for a in (o if isinstance(o, list) else (o,)))
        traced = _flat_nested(traced)
    return traced, out_avals, ws, check_aval, nest


def _flat_nested(traced):
    def flat(*args):
        out = traced(*args)
        return tuple(a for o in out for a in (o if isinstance(o, list) else (o,)))

    return flat


def _flat_checked(traced):
    """A checked op's function with its flag appended to its flat outputs."""
    def flat(*args):
        out, ok = traced(*args)
        return (tuple(out) if isinstance(out, (tuple, list)) else (out,)) + (ok,)

    return flat


def _result(node_index, i, aval, pending):
    if aval is None:
        return None
    if type(aval) is executor._Static:
        return aval.value
    pb = PendingBuffer(("n", node_index, i), aval)
    pending.append(pb)
    return _wrap_pending(aval, pb)


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
    """What the graph's program computes: per node its traced function and references (the
    program is made of nothing else), the live outputs and the donated inputs. A node's traced
    function is the one ``_AVALS`` holds for its recording key (the C++ entries replay that
    same object), so it stands for the key; it hashes and compares by identity (hashing the
    nested keys cost ~75 us per cut of a 200-node graph), and the key held in ``_PROGRAMS``
    keeps it alive (its id is not reused)."""
    return (tuple([(n[1], n[2]) for n in g.nodes]), tuple([pb.ref for pb in live]), donate)


def _make_program(g, out_refs, donate=()):
    nodes = [(n[1], n[2]) for n in g.nodes]

    def program(*inputs):
        env = []
        for traced, refs in nodes:
            args = [inputs[r[1]] if r[0] == "i" else env[r[1]][r[2]] for r in refs]
            out = traced(*args)
            env.append(tuple(out) if isinstance(out, (tuple, list)) else (out,))
        return tuple(env[r[1]][r[2]] for r in out_refs)

    program.__name__ = f"fused_graph_{len(_PROGRAMS)}"  # the XLA module's name, for profiles
    # the graph's key in the compile cache folder: each node's Strict key and references
    # (the program's input signature, which fixes every node's shapes, is added there),
    # spelled from each node kind's stable spelling (made once per kind and process: spelling
    # every node's key again cost a warm generate's first call ~0.3 s)
    key = None
    if all(n[3] is not None for n in g.nodes):
        h = hashlib.sha256()
        for n in g.nodes:
            h.update(n[3].encode())
            h.update(repr(n[2]).encode())
        h.update(repr((tuple(out_refs), tuple(donate))).encode())
        key = "fused-graph:" + h.hexdigest()
    elif _disk.cache_dir() is not None:  # as a Program counts a key it cannot spell
        count("fused_disk_cache_unkeyable")
    return _program_cache.Program("fused", program, key, donate_argnums=donate)


def _live(pending):
    """The pending buffers still referenced outside the graph (by a storage, a check), once
    each, in creation order."""
    counts = _refcounts(pending)
    return [pb for pb, n in zip(pending, counts)
            if n > _BASE and pb._value is None and pb.ref is not None]


def flush(reason: str = "explicit") -> None:
    """Cut: compile (or fetch) the pending graph's program, run it, fill live pending buffers."""
    _enter()
    try:
        _flush(reason)
    finally:
        _exit()


def _flush(reason):
    g = _graph[0]
    if not g.nodes or _flushing[0]:
        return
    _flushing[0] = True
    try:
        _graph[0] = _Graph()
        pending = g.pending
        g.pending = None
        live = _live(pending)
        del pending
        count("fused_graph_cuts", op=reason)
        n_nodes = len(g.nodes)
        COUNTERS["fused_ops_executed"] += n_nodes
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
            prog = _PROGRAMS[fp] = _make_program(g, [pb.ref for pb in live], donate)
        else:
            count("fused_graph_cache_hits")
        if donate:
            count("fused_donated_buffers", len(donate))
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                results = prog(*inputs)
        except Exception as e:  # name the user's ops, as Debug mode would
            ops = sorted({str(n[0][0][0].op) for n in g.nodes})
            msg = f"torchtpu fused graph of {n_nodes} ops failed (ops: {', '.join(ops[:20])}): {e}"
            _PROGRAMS.pop(fp, None)  # a later graph of the same shape builds its own
            for pb in live:  # their nodes are gone: a later use must not refer to them
                pb.ref = None
                pb.error = msg.splitlines()[0]
            oom = _memory.oom_error(e)
            if oom is not None:
                raise oom from e
            raise RuntimeError(msg) from e
        if modes.get_eager_mode() is modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING:
            _memory.block_until_ready(results)
        for pb, v in zip(live, results):
            pb._value = v
            pb.ref = None
    finally:
        _flushing[0] = False


def _on_switch(old, new):
    if old is modes.EagerMode.DEFER_AND_FUSE:
        flush("mode_switch")


def install() -> None:
    global _enter, _exit
    executor.fused_run = record
    if _fastpath.setup_fused(modes.EagerMode.DEFER_AND_FUSE, globals(), PendingBuffer,
                             _graph_task):
        _enter, _exit = _fastpath.fused_lock()
    modes.on_switch(_on_switch)
    _sync.on_synchronize(lambda: flush("synchronize"))
