"""The ``torch.compile`` backend "tpu": Dynamo -> aot_autograd -> one XLA executable per graph.

aot_autograd (min-cut partitioner, PyTorch's core aten decompositions for every op the lowering
table does not cover, input mutations kept in the graph) hands us forward, backward or inference
graphs; each becomes a ``CompiledGraph``: the FX graph lowered through the table
(``lower.GraphLowering``) under jax.jit, compiled ahead of time per input signature (shapes,
dtypes, static ints), cached in memory and on disk (``cache.py``). Inputs the graph overwrites
(optimizer state, BatchNorm statistics, KV caches) have their buffers donated when nothing else
holds them, so XLA updates them in place.
"""
from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Mapping

import jax
import numpy as np
import torch

from ..eager import checks as _checks
from ..eager import copy as _copy
from ..eager import rng as _rng
from ..eager import views as _views
from ..lowering import registry as _registry
from ..runtime import buffer as _buffer
from ..runtime import custom_calls as _custom_calls
from ..runtime import devices as _devices
from ..runtime import memory as _memory
from ..runtime import sync_debug as _sync_debug
from ..runtime.metrics import COUNTERS, count
from . import aot_cache as _aot_cache
from . import buckets as _buckets
from . import cache as _cache
from . import lower as _lower
from . import options as _options
from . import spmd as _spmd

Tensor = torch.Tensor
_wrap = _buffer.wrap
_NP = _views._NP  # torch dtype -> numpy dtype


class _Entry:
    __slots__ = ("compiled", "consts", "donate", "checks")

    def __init__(self, compiled, consts, donate, checks=()):
        self.compiled = compiled
        self.consts = consts
        self.donate = donate
        self.checks = checks  # (op name, exception type, message) per input-check flag


# refcount of a jax.Array held only by its Buffer, while it sits in our list and is passed to
# sys.getrefcount (measured once, at the first donation, so interpreter differences do not
# matter; not at import: making an array creates the JAX backend, and a process of a
# distributed job must join the job before that, and may import this module first)
def _baseline_refcount():
    if not _BASE_REFS:
        b = _buffer.Buffer(jax.numpy.zeros(()))
        lst = [b.array]
        _BASE_REFS.append(sys.getrefcount(lst[0]))
    return _BASE_REFS[0]


_BASE_REFS: list = []


def _no_storage():
    return None


# calls whose inputs all are tpu tensors' whole arrays, as the graph's last such call had them,
# check each against that call's shapes and dtypes instead of walking them afresh
# (CompiledGraph._walk_whole); False: every call walks (the reference, for tests)
WHOLE_WALK = True


class CompiledGraph:
    """One aten graph: a callable taking aot_autograd's boxed list of inputs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, name: str, opts: dict):
        # aot_autograd's boxed calling convention; an instance attribute because wrappers
        # (Dynamo's disable() around a backward) copy only __dict__
        self._boxed_call = True
        self.low = _lower.GraphLowering(gm, name)
        self.name = name
        self.opts = opts
        self.entries: dict = {}
        self.mutated = self.low.mutated
        self.n_random = len(self.low.random_nodes)
        self.out_devices = self._out_devices(gm)
        self.view_outputs = self.low.out_views if name.startswith("inference") else {}
        self._lock = threading.Lock()
        self._warned_dynamic = False
        self._plan = False  # buckets.analyse's answer, computed at the first call
        self._run = self.low  # what runs: the graph, or its masked rewrite (masking.py)
        # the input walk's answer for calls whose inputs are all tpu tensors passed as their
        # storages' whole arrays, as the last such call saw them: (per input (shape, numpy
        # dtype, torch dtype), the key's signature part); see _walk_whole
        self._whole_sig = None
        self._last_entry = None  # (signature part, donated positions, _Entry) of the last call

    @staticmethod
    def _out_devices(gm):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        outs = out if isinstance(out, (list, tuple)) else [out]
        devs = []
        for o in outs:
            v = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            devs.append(v.device.type if isinstance(v, Tensor) else None)
        return devs

    def __call__(self, args):
        _devices.check_fork()
        bucketed = None
        walked = (self._walk_whole(args) if self._whole_sig is not None and WHOLE_WALK
                  else None)
        if walked is not None:
            arrays, whole, sig_key = walked
            slots = self._whole_sig[3]
            statics = {}
            COUNTERS["compile_whole_walks"] += 1
        else:
            arrays, slots, statics, whole, sig_key, bucketed, orig_args = self._walk(args)
        donate = (self._donatable(args, arrays, slots, whole, walked is not None)
                  if self.mutated else ())
        if donate:
            COUNTERS["compile_donated_buffers"] += len(donate)
        key = (sig_key, donate)
        return self._run_entry(args, arrays, slots, statics, whole, key, donate, bucketed,
                               orig_args if bucketed is not None else None)

    def _entry(self, key, arrays, slots, statics, donate):
        """The executable for ``key``, compiled on a miss."""
        entry = self.entries.get(key)
        if entry is None:
            with self._lock:
                entry = self.entries.get(key)
                if entry is None:
                    COUNTERS["compile_cache_misses"] += 1
                    entry = self._compile(arrays, slots, statics, tuple(donate), key[0])
                    self.entries[key] = entry
                else:
                    COUNTERS["compile_cache_hits"] += 1
        else:
            COUNTERS["compile_cache_hits"] += 1
        return entry

    def _walk_whole(self, args):
        """The input walk of ``_walk`` for a call like the last one whose inputs were all tpu
        tensors that are their storages' whole arrays (a static-cache decode step: weights,
        caches, ids): each input checked against that call's shape and dtypes, and that it
        still is its storage's whole array (offset 0, contiguous, no conj/neg bit). None when
        any differs, or the matmul precision changed: ``_walk`` then does the full walk.
        Returns (arrays, {position: Buffer}, the key's signature part)."""
        specs, sig_key, precision, _ = self._whole_sig
        if len(args) != len(specs) or _registry.matmul_precision() != precision:
            return None
        arrays = []
        whole = {}
        i = 0
        for a, (shape, dt, tdt) in zip(args, specs):
            # a non-tensor, or a tensor with no tpu buffer (a CPU tensor), has no _tpu_buffer
            buf = getattr(getattr(a, "untyped_storage", _no_storage)(), "_tpu_buffer", None)
            if buf is None or type(buf) is not _buffer.Buffer:
                return None
            arr = buf.array
            if (a.dtype is not tdt or a.shape != shape or arr.shape != shape
                    or arr.dtype != dt or a.storage_offset() or not a.is_contiguous()
                    or a.is_conj() or a.is_neg()):
                return None
            arrays.append(arr)
            whole[i] = buf
            i += 1
        return arrays, whole, sig_key

    def _walk(self, args):
        """Every input to an array (``slots``: their positions), a static value, or a padded
        bucket input: (arrays, slots, statics, whole, the key's signature part, bucketed,
        the arguments before padding)."""
        bucketed = None
        orig_args = None
        if self._plan is False:
            self._plan = self._analyse()
        if isinstance(self._plan, _buckets.Plan):
            orig_args = list(args)
            bucketed = self._pad(args)
        arrays = []
        slots = []
        sig = []
        statics = {}
        whole = {}  # arg position -> its Buffer, for a tensor passed as its storage's array
        np_of = _NP.get
        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                buf = None if a.is_cpu else getattr(a.untyped_storage(), "_tpu_buffer", None)
                if buf is not None:
                    arr = buf.array
                    shape = arr.shape
                    dt = arr.dtype
                    # a tensor that is its storage's whole array (parameters, caches, most
                    # inputs) is that array; views go through value_of
                    if (shape == a.shape and not a.storage_offset() and a.is_contiguous()
                            and not a.is_conj() and not a.is_neg() and np_of(a.dtype) == dt):
                        whole[i] = buf
                    else:
                        arr = _copy.value_of(a)
                        shape = arr.shape
                        dt = arr.dtype
                elif a.device.type == "tpu":
                    arr = _copy.value_of(a)  # raises: a tpu tensor without a buffer
                    shape = arr.shape
                    dt = arr.dtype
                else:  # a CPU tensor (optimizer step counts): numpy, moved by the call itself
                    arr = np.array(_lower._torch_to_np(a.detach().cpu()), copy=True)
                    COUNTERS["transfers_host_to_device"] += 1
                    shape = arr.shape
                    dt = arr.dtype
                arrays.append(arr)
                slots.append(i)
                sig.append((shape, dt))
            else:
                if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                    a = a.node.hint if hasattr(a.node, "hint") else int(a)
                statics[i] = a
                sig.append(("s", type(a), a))
        if bucketed is not None and self._plan.masked:
            # the real sizes: traced inputs of the masked program, one program per bucket
            for k, sym in enumerate(self._plan.syms):
                arr = _size_scalar(bucketed[0][sym], _dev_of(arrays[0]) if arrays else None)
                arrays.append(arr)
                slots.append(len(args) + k)
                sig.append(((), arr.dtype))
        # the matmul precision lowerings read at trace time (it is part of the graph key too)
        precision = _registry.matmul_precision()
        sig_key = tuple(sig) + (("precision", precision),)
        if bucketed is None and not statics and len(whole) == len(args) == len(arrays):
            # every input is its storage's whole array: the next call like this one checks
            # its inputs against these (_walk_whole)
            self._whole_sig = (tuple((a.shape, a.dtype, args[i].dtype)
                                     for i, a in enumerate(arrays)), sig_key, precision,
                               list(slots))
        return arrays, slots, statics, whole, sig_key, bucketed, orig_args

    def _run_entry(self, args, arrays, slots, statics, whole, key, donate, bucketed, orig_args):
        """Find (or compile) the executable for ``key``, run it on ``arrays``, write the
        mutated inputs back and build the outputs."""
        last = self._last_entry
        if last is not None and last[0] is key[0] and last[1] == key[1]:
            # the key the last call ran (its signature part is _walk_whole's cached tuple):
            # its entry without hashing the key again
            entry = last[2]
            COUNTERS["compile_cache_hits"] += 1
        else:
            entry = self._entry(key, arrays, slots, statics, donate)
            self._last_entry = (key[0], key[1], entry)
        flat = arrays
        if self.n_random:
            words = np.stack([_rng.next_state(None) for _ in range(self.n_random)])
            flat = arrays + [words]
        try:
            outs, news, flags = entry.compiled(*flat)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            oom = _memory.oom_error(e)  # torch.OutOfMemoryError, as CUDA raises
            if oom is not None:
                raise oom from e
            if "not found" not in str(e) or self.opts.get("persistent_cache") is False:
                raise
            # a disk-cache executable that XLA cannot run ("Function ... not found", the
            # symptom of an incomplete XLA:CPU serialization, see cache.py), when XLA reports it
            # at dispatch: never trust the disk for this graph again; rebuild and rerun
            COUNTERS["compile_cache_corrupt"] += 1
            self.opts = dict(self.opts, persistent_cache=False)
            entry = self.entries[key] = self._compile(arrays, slots, statics, tuple(donate),
                                                      key[0])
            self._last_entry = (key[0], key[1], entry)
            outs, news, flags = entry.compiled(*flat)
        del flat
        if flags:
            _checks.add_program_flags(flags, entry.checks)
        # write back mutated inputs; CPU-side values are recomputed on the host when the graph
        # allows it (no sync), else they come back in one transfer
        host_writes = []
        host_mutated = self.low.host_mutated
        for i, new in zip(self.mutated, news):
            t = args[i]
            buf = whole.get(i)
            if buf is not None:
                # the whole array: assign's own first case (no view spec), without finding it
                # again; a cast or broadcast value still goes through assign
                arr = buf.array
                if new.shape == arr.shape and new.dtype == arr.dtype:
                    buf.array = new
                    continue
            if t.device.type == "tpu":
                _copy.assign(t, new)
            elif i not in host_mutated:
                host_writes.append((t, new))
        if host_mutated:
            self.low.replay_on_host(args)
        consts, is_seq = entry.consts
        devs = self.out_devices
        host_outs = [outs[v] for j, (kind, v) in enumerate(consts)
                     if kind == "array" and devs[j] == "cpu"]
        if host_writes or host_outs:
            _sync_debug.note("a compiled graph's host-side values")
            got = jax.device_get([n for _, n in host_writes] + host_outs)
            COUNTERS["host_syncs"] += 1
            with torch.no_grad():
                for (t, _), h in zip(host_writes, got):
                    t.copy_(_lower._np_to_torch(np.asarray(h)).view(t.shape))
            host_outs = [_lower._np_to_torch(np.asarray(h)) for h in got[len(host_writes):]]
        res = []
        k = 0
        for j, (kind, v) in enumerate(consts):
            if kind == "array":
                if devs[j] == "cpu":
                    res.append(host_outs[k])
                    k += 1
                else:
                    res.append(_wrap(outs[v]))
            elif kind == "input":
                res.append(args[v])
            elif kind == "new":  # a mutated input's new value (lower.py): shared, not copied
                res.append(_wrap(news[v]))
            elif kind == "mutview":  # a view of a written input (lower._mutation_views)
                i, chain = self._run.mut_views[v]
                t = args[i]
                for op, rest, kw in chain:
                    t = op(t, *rest, **kw)
                res.append(t)
            else:
                res.append(v)
        if bucketed is not None:
            res = self._cut(res, consts, orig_args, *bucketed)
        if self.view_outputs:
            # an inference graph's output that is a view of another output is that view, as in
            # eager (aot_autograd regenerates such aliases itself only around training graphs)
            for j, (base, chain) in self.view_outputs.items():
                v = res[base]
                for op, rest, kw in chain:
                    v = op(v, *rest, **kw)
                res[j] = v
        args.clear()  # boxed calling convention: let inputs die early
        return res if is_seq else res[0]

    def _analyse(self):
        """buckets.analyse for this graph, when bucketing is on: a Plan, a reason, or None."""
        if not _buckets.enabled(self._bucket_opts()):
            return "bucketing is off (bucket_size=0)"
        try:
            plan = _buckets.analyse(self.low.gm, self.mutated)
        except Exception as e:  # noqa: BLE001 - never fail a graph over the analysis
            plan = f"analysis failed ({type(e).__name__}: {e})"
        if isinstance(plan, _buckets.Plan) and (self.view_outputs or self.low.mut_views):
            plan = "outputs that are views of other outputs or of written inputs"
        if isinstance(plan, _buckets.Plan) and plan.masked and self.low.mesh is not None:
            return "a graph with collectives that would need masks"  # not tried over a mesh
        if isinstance(plan, _buckets.Plan) and plan.masked:
            try:
                self._run = _lower.GraphLowering(plan.masked_graph(self.low.gm), self.name)
            except Exception as e:  # noqa: BLE001 - a rewrite that fails: per size, said once
                return f"masking failed ({type(e).__name__}: {e})"
            count("compile_masked_graphs")
            for n, *_ in plan.masks:
                count("compile_masked_ops", op=_lower.op_name(n.target))
        return plan

    def _bucket_opts(self) -> dict:
        opts = dict(_options.dynamic_bucket_defaults())
        opts.update({k: self.opts[k] for k in ("bucket_size", "num_dynamic_buckets")
                     if k in self.opts})
        return opts

    def _pad(self, args):
        """Replace dynamic-size inputs by padded ones (bucket sizes): (sizes, buckets).

        A dim of size ``c * (s + k)`` (a flattened (batch, seq), ``seq - 1``) is padded as
        ``(c, s + k) -> (c, S + k)``, the layout the padded program gives it. The padding is
        zeros, or ``_buckets.DEBUG_PAD_VALUE`` in floating-point inputs (a test's NaN: it must
        not reach a result); a cut float output of a padded program is passed as its padded
        array (``_padded_storage``).
        """
        plan = self._plan
        vals = plan.symbol_values(args)
        opts = self._bucket_opts()
        buckets = {s: _buckets.bucket(v, opts) for s, v in vals.items()}
        for i, (kind, info) in enumerate(plan.inputs):
            a = args[i]
            if kind == "sym":
                args[i] = int(info.subs(buckets))
            elif kind == "tensor" and info and isinstance(a, Tensor):
                if all(int(e.subs(buckets)) == a.shape[d] for d, e in info):
                    continue
                on_tpu = a.device.type == "tpu"
                if on_tpu:
                    reused = _padded_storage(a, info, buckets)
                    if reused is not None:
                        # a cut output of a padded program (a forward's saved activation):
                        # its storage is already the padded array
                        COUNTERS["compile_bucket_pads_reused"] += 1
                        args[i] = _wrap(reused)
                        continue
                COUNTERS["compile_bucket_pads"] += 1
                if on_tpu:  # through the host: no program per size to compile
                    _sync_debug.note("a compiled graph's input padded to its size bucket")
                    arr = _copy.value_of(a)
                    host = np.asarray(jax.device_get(arr))
                    COUNTERS["host_syncs"] += 1
                else:
                    host = _lower._torch_to_np(a.detach())
                host = _pad_host(host, info, vals, buckets, _buckets.DEBUG_PAD_VALUE)
                if on_tpu:
                    args[i] = _wrap(jax.device_put(host, _dev_of(arr)))
                else:
                    args[i] = _lower._np_to_torch(host)
        return vals, buckets

    def _cut(self, res, consts, orig_args, vals, buckets):
        """Cut the padding off the outputs (views of the padded results)."""
        for j, dims in enumerate(self._plan.outputs):
            kind, v = consts[j]
            if type(dims) is tuple:  # a size output: its real value
                res[j] = int(dims[1].subs(vals))
                continue
            if kind == "input":
                res[j] = orig_args[v]
                continue
            t = res[j]
            if not dims or not isinstance(t, Tensor):
                continue
            for d, e in dims:
                real = int(e.subs(vals))
                padded = int(e.subs(buckets))
                if real == padded:
                    continue
                c = _buckets._block(e)[0]
                if c == 1:
                    t = t.narrow(d, 0, real)
                else:
                    t = t.unflatten(d, (c, padded // c)).narrow(d + 1, 0, real // c) \
                        .flatten(d, d + 1)
            res[j] = t
        return res

    def _donatable(self, args, arrays, slots, whole, walked=False):
        """Positions (in ``arrays``) of mutated inputs whose buffer nothing else holds.
        ``whole``: arg position -> Buffer of the inputs passed as their storage's array;
        ``walked``: ``_walk_whole`` made them (every input is a tpu tensor's whole array,
        ``arrays[i]`` is input i's)."""
        if not self.opts.get("donate", True):
            return ()
        pos = None if walked else {s: j for j, s in enumerate(slots)}
        ids = None
        unique = False
        donate = []
        for i in self.mutated:
            if walked:
                j = i
                buf = whole[i]
            else:
                j = pos.get(i)
                if j is None or args[i].device.type != "tpu":
                    continue
                buf = whole.get(i)
                if buf is None:
                    buf = _buffer.buffer_of(args[i])
            if buf.array is not arrays[j]:
                continue
            if ids is None:
                ids = list(map(id, arrays))
                unique = len(set(ids)) == len(ids)
            if not unique and ids.count(ids[j]) != 1:
                continue
            if sys.getrefcount(arrays[j]) > _baseline_refcount():  # someone else holds it
                continue
            donate.append(j)
        return tuple(donate)

    def _graph_key(self, sig, arrays, donate, copts):
        import hashlib

        gm = self._run.gm
        consts = []
        lowerings = []
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                v = _lower._fetch_attr(gm, n.target)
                if isinstance(v, Tensor):
                    v = v.detach()
                    v = _copy.device_to_host(_copy.value_of(v)) if v.device.type == "tpu" else v
                    consts.append(hashlib.sha256(_lower._torch_to_np(v).tobytes()).digest()
                                  + repr((tuple(v.shape), v.dtype)).encode())
                elif isinstance(v, torch.fx.GraphModule):  # a HOP's subgraph (score_mod)
                    from ..lowering.hops import graph_code

                    consts.append(graph_code(v).encode())
                else:
                    consts.append(repr(v).encode())
            elif n.op == "call_function":
                low = _lower.registry.get(n.target) if isinstance(n.target, torch._ops.OpOverload) \
                    else None
                if low is not None:
                    lowerings.append(low.fn)
        devs = [getattr(_dev_of(a), "id", 0) for a in arrays]
        return _cache.graph_key(gm.code, consts, (sig, devs), donate, self.n_random, copts,
                                lowerings)

    def _consts_fit(self, consts) -> bool:
        """Whether a stored program's output plan (``const_outputs``) is one this graph's
        lowering can serve: every output it leaves to the runtime as a view of a written input
        is one the lowering knows."""
        outs, _ = consts
        return all(kind != "mutview" or v in self._run.mut_views for kind, v in outs)

    def _compile(self, arrays, slots, statics, donate, sig=None):
        if any(isinstance(v, (torch.SymInt,)) for v in statics.values()):
            raise _lower.Unsupported("symbolic inputs without hints")
        if isinstance(self._plan, str) and not self._warned_dynamic:
            self._warned_dynamic = True
            warnings.warn("torchtpu.compile: a graph with dynamic sizes is specialised, "
                          "compiled once per distinct size, not per bucket: padding it could "
                          "change a result "
                          f"({self._plan}). Only graphs whose ops treat dynamic dimensions "
                          "position by position, or can be masked, are padded to buckets (see "
                          "torchtpu/compile/buckets.py, masking.py)",
                          stacklevel=5)  # _entry <- _run_entry <- __call__ <- its caller
        elif isinstance(self._plan, _buckets.Plan):
            count("compile_bucket_programs")
        t0 = time.perf_counter()
        copts = _options.compiler_options(self.opts)
        gkey = None
        if self._run.mesh is not None:
            return self._compile_spmd(arrays, slots, statics, donate, copts, t0)
        # the device the program runs on: part of the program key (the HLO does not name it),
        # and an executable from disk is loaded onto it alone
        dev = _dev_of(arrays[0]) if arrays else _devices.jax_device(0)
        if sig is not None and _options.get(self.opts, "persistent_cache", True):
            try:
                gkey = self._graph_key(sig, arrays, donate, copts)
                hit = _cache.load_graph(gkey, dev)
            except Exception:  # noqa: BLE001
                hit = None
            if hit is not None and not self._consts_fit(hit[1]["consts"]):
                # the stored program returns what this process's lowering of the graph does
                # not expect (facts derived from metadata the graph's code does not show):
                # compile it here instead of running it
                count("compile_disk_cache_mismatches")
                hit = None
            if hit is not None:
                count("compile_ms", int((time.perf_counter() - t0) * 1000))
                return _Entry(hit[0], hit[1]["consts"], donate, hit[1].get("checks", ()))
        fn = self._run.trace_fn(slots, statics, self.out_devices, all_flag=True)
        # the XLA module's name, for profiles (the kind only: the disk cache keys the HLO text)
        fn.__name__ = "compiled." + self.name.rstrip("0123456789")
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       sharding=jax.sharding.SingleDeviceSharding(_dev_of(a)))
                  for a in arrays]
        if self.n_random:
            shapes.append(jax.ShapeDtypeStruct((self.n_random, 4), np.uint32))
        jitted = jax.jit(fn, donate_argnums=donate)
        lowered = jitted.lower(*shapes)
        consts = self._run.const_outputs
        count("compile_traces")
        compiled = None
        key = None
        cacheable = not self._run.fallback_ops and _options.get(self.opts, "persistent_cache", True)
        targets = ()
        if cacheable:
            try:
                text = lowered.as_text()
                targets = _custom_calls.targets(text)
                # the arguments' avals too: jit drops unused arguments from the module, so a
                # graph that computes nothing from an input (returns it) has one text for every
                # size of it, and JAX's executable refuses arguments of other shapes
                avals = repr([(tuple(a.shape), str(a.dtype)) for a in shapes])
                key = _cache.key_of(text + avals, copts, (dev.id,))
                compiled = _cache.load(key, lowered, dev, targets)
            except Exception:  # noqa: BLE001
                compiled = None
        if compiled is None:
            t1 = time.perf_counter()
            compiled = lowered.compile(compiler_options=copts or None)
            count("xla_compiles")
            count("xla_compile_ms", int((time.perf_counter() - t1) * 1000))
            if key is not None:
                _cache.store(key, compiled, targets)
        if gkey is not None and key is not None and _custom_calls.storable(targets) is None:
            _cache.store_graph(gkey, key, {"in_tree": lowered.in_tree,
                                           "out_tree": lowered.out_tree, "consts": consts,
                                           "checks": self._run.check_info,
                                           "custom_calls": targets})
        count("compile_ms", int((time.perf_counter() - t0) * 1000))
        return _Entry(compiled, consts, donate, self._run.check_info)


    def _compile_spmd(self, arrays, slots, statics, donate, copts, t0):
        """A graph with collectives: one SPMD program over their mesh (spmd.py). Not in the
        persistent caches (an executable for several processes' devices)."""
        spmd = _spmd.SPMD(*self._run.mesh)
        fn = self._run.trace_fn(slots, statics, self.out_devices, all_flag=True)
        local = [(a.shape, a.dtype) for a in arrays]
        if self.n_random:
            local.append(((self.n_random, 4), np.uint32))
        body = spmd.wrap(fn, [s for s, _ in local])
        body.__name__ = "compiled_spmd." + self.name.rstrip("0123456789")
        jitted = jax.jit(body, donate_argnums=tuple(j + 1 for j in donate))
        lowered = jitted.lower(*spmd.shapes(local))
        count("compile_traces")
        count("compile_spmd_programs")
        t1 = time.perf_counter()
        compiled = lowered.compile(compiler_options=copts or None)
        count("xla_compiles")
        count("xla_compile_ms", int((time.perf_counter() - t1) * 1000))
        count("compile_ms", int((time.perf_counter() - t0) * 1000))
        return _Entry(spmd.program(compiled, lowered, body.__name__), self._run.const_outputs,
                      donate,
                      self._run.check_info)


_aot_cache.register_graph_type(CompiledGraph)


def _pad_host(x, dims, vals, buckets, fill=None):
    """numpy ``x`` padded along ``dims`` ((dim, c * (s + k))) from the real sizes ``vals`` to
    the bucket sizes ``buckets``, as ``(c, s + k) -> (c, S + k)``."""
    for d, e in dims:
        c, s, k = _buckets._block(e)
        n, b = vals[s] + k, buckets[s] + k
        if n == b:
            continue
        shape = x.shape
        x = x.reshape(shape[:d] + (c, n) + shape[d + 1:])
        pads = [(0, 0)] * x.ndim
        pads[d + 1] = (0, b - n)
        if fill is not None and np.issubdtype(x.dtype, np.floating):
            x = np.pad(x, pads, constant_values=fill)
        else:
            x = np.pad(x, pads)
        x = x.reshape(shape[:d] + (c * b,) + shape[d + 1:])
    return x


def _padded_storage(a, dims, buckets):
    """The array behind ``a`` when ``a`` is the leading block of it that ``_cut`` made of a
    padded result (a narrow view of the whole storage along plain dynamic dims), with
    floating-point values: the padded input as is, its padding whatever the program left
    there. Integer inputs are never reused: index inputs rely on their zero padding."""
    if not a.dtype.is_floating_point or a.storage_offset() != 0:
        return None
    try:
        arr = _buffer.buffer_of(a).array
    except RuntimeError:
        return None
    if not isinstance(arr, jax.Array) or arr.ndim != a.dim() or arr.is_deleted():
        return None
    shape = list(a.shape)
    for d, e in dims:
        if _buckets._block(e)[0] != 1:  # c blocks: a leading block is not their layout
            return None
        shape[d] = int(e.subs(buckets))
    if tuple(arr.shape) != tuple(shape) or _lower.to_torch(arr.dtype) != a.dtype:
        return None
    st = 1
    for d in reversed(range(len(shape))):  # the storage's contiguous strides
        if shape[d] != 1 and a.stride(d) != st:
            return None
        st *= shape[d]
    return arr


_SIZE_SCALARS: dict = {}


def _size_scalar(n, dev):
    """A real size as a 0-d int32 on ``dev`` (cached: sizes repeat, a transfer per call not)."""
    key = (n, dev)
    arr = _SIZE_SCALARS.get(key)
    if arr is None:
        if len(_SIZE_SCALARS) > 4096:
            _SIZE_SCALARS.clear()
        arr = _SIZE_SCALARS[key] = jax.device_put(np.int32(n), dev or _devices.jax_device(0))
    return arr


def _dev_of(a):
    try:
        return next(iter(a.devices()))
    except Exception:  # noqa: BLE001
        return _devices.jax_device(0)


# ---- the Dynamo backend ----

def _decompositions():
    """PyTorch's decompositions for every op the lowering table does not cover."""
    from torch._decomp import core_aten_decompositions, decomposition_table

    table = {}
    core = core_aten_decompositions()
    for op, fn in core.items():
        if not _lower.has_lowering(op):
            table[op] = fn
    for op, fn in decomposition_table.items():
        if op in table or _lower.has_lowering(op) or not isinstance(op, torch._ops.OpOverload):
            continue
        if op._schema.is_mutable or _is_view(op):
            continue
        table[op] = fn
    from .decomp import extra_decompositions

    for op, fn in extra_decompositions(_lower.has_lowering).items():
        table.setdefault(op, fn)
    return table


class _LazyDecompositions(Mapping):
    """``_decompositions()``, built on first read and kept while the lowering table is
    unchanged. Building it costs ~0.5 s; a warm start whose graphs all come from
    AOTAutogradCache never traces, so never reads it."""

    _built: tuple = (None, None)  # (size of the lowering table, decompositions for it)

    def _table(self) -> dict:
        n = len(_registry.LOWERINGS)
        if _LazyDecompositions._built[0] != n:
            _LazyDecompositions._built = (n, _decompositions())
        return _LazyDecompositions._built[1]

    def __getitem__(self, op):
        return self._table()[op]

    def __iter__(self):
        return iter(self._table())

    def __len__(self):
        return len(self._table())


def decompositions() -> Mapping:
    """{op: PyTorch's decomposition} for the ops the lowering table does not cover (what
    aot_autograd decomposes for the "tpu" backend; also used to trace subgraphs to aten)."""
    return _LazyDecompositions()


def _is_view(op) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


_graph_counter = [0]


def _compiler(kind: str, opts: dict, serializable: bool):
    """aot_autograd's compiler for one kind of graph; ``serializable``: its results go into
    AOTAutogradCache (``aot_cache.GraphCode``)."""
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        _graph_counter[0] += 1
        count("compile_graphs")
        name = f"{kind}{_graph_counter[0]}"
        if serializable:
            return _aot_cache.GraphCode(gm, name, opts)
        return CompiledGraph(gm, example_inputs, name, opts)

    if serializable:
        from torch._functorch.aot_autograd import SerializableAOTDispatchCompiler

        return SerializableAOTDispatchCompiler(_aot_cache.GraphCode, compile_graph)
    return compile_graph


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None, **kwargs):
    """``torch.compile(model, backend="tpu")``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from torch._functorch import config as functorch_config

    opts = _options.resolve(mode, options, kwargs)
    from . import gc_freeze

    gc_freeze.install()  # for the next compiles (after a torch._dynamo.reset())
    # effect tokens (ordering _linalg_check_errors and other effectful ops) are made inside the
    # graphs, as for Inductor: a graph loaded from AOTAutogradCache is called without token
    # inputs (its runtime wrapper adds none), so graphs that took them failed on a warm start
    with _aot_cache.enabled(opts) as serializable, \
            functorch_config.patch(unlift_effect_tokens=True):
        backend = aot_autograd(
            fw_compiler=_compiler("forward", opts, serializable),
            bw_compiler=_compiler("backward", opts, serializable),
            inference_compiler=_compiler("inference", opts, serializable),
            partition_fn=min_cut_rematerialization_partition,
            decompositions=decompositions(),
            keep_inference_input_mutations=True,
        )
        return backend(gm, example_inputs)
