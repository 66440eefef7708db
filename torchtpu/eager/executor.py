"""Strict and Debug eager execution: one cached jitted XLA program per (op, static args, views).

The hot path (``run``) does: walk the arguments once (tensors out, static values into a key),
look the key up, call the cached ``jax.jit`` function on the storage arrays, wrap outputs and
write back mutated storages. Everything else happens once per key, at a cache miss.
"""
from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..lowering.registry import matmul_precision
from ..runtime import buffer as _buffer
from ..runtime import devices as _devices
from ..runtime import memory as _memory
from ..runtime import program_cache as _program_cache
from ..runtime import sync_debug as _sync_debug
from ..runtime.metrics import COUNTERS, count
from ..runtime.dtypes import TORCH_TO_JAX as _T2J
from . import copy as _copy
from . import checks as _checks
from . import deferred as _deferred
from . import fastpath as _fastpath
from . import modes, views
from . import key_guess as _key_guess
from . import rng as _rng

Tensor = torch.Tensor
_NP = {k: np.dtype(v) for k, v in _T2J.items()}
_wrap = _buffer.wrap_noted  # every output here is a Program's, which inflight.note has seen
_default_dtype = torch.get_default_dtype

# kinds of kernel, derived from the schema at registration
FUNCTIONAL, INPLACE, OUT, DIRECT_INPLACE, FUNCTIONAL_RAW = range(5)


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


_SCALARS: dict = {}


class Traced:
    """A Python scalar (or list of scalars) passed to the program as a traced value, not baked
    into it (registry flag ``scalar_args``): changing it does not recompile."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def flat(self):
        v = self.value
        if type(v) is list or type(v) is tuple:
            return np.asarray(v)  # one argument for a whole Scalar[] (a foreach step size)
        return v  # a Python scalar: jax makes it a weakly typed 0-d value

    def device_value(self):
        """``flat()`` for a jit call: a Python number as a cached weakly typed device scalar
        (a Python float argument costs jit a host-to-device transfer per call, ~6 us here;
        the cache makes a repeated value as cheap as a baked-in constant)."""
        v = self.value
        tv = type(v)
        if tv is float or tv is int:
            if v != v or v == 0:  # nan is never equal to itself; 0.0 == -0.0 == 0 as keys
                return v
            return _device_scalar((tv, v), v)
        return self.flat()

    def key(self):
        v = self.value
        if type(v) is list or type(v) is tuple:
            return (Traced, len(v), type(v[0]) if v else None)
        return (Traced, type(v))


def with_layout(args, kwargs):
    """Registry flag ``reads_layout``: the first tensor argument's (strides, storage offset)."""
    t = args[0] if args else kwargs["self"]
    return {**kwargs, "layout": (tuple(t.stride()), t.storage_offset())}


def _trace_scalars(lowering, args, kwargs):
    """Wrap the lowering's ``scalar_args`` in Traced."""
    pos = lowering.meta.get("scalar_pos")
    if pos is None:
        names = [a.name for a in lowering.op._schema.arguments]
        pos = lowering.meta["scalar_pos"] = tuple(
            (names.index(n), n) for n in lowering.scalar_args if n in names)
    a = kw = None
    for i, name in pos:
        if i < len(args):
            if _traceable(args[i]):
                if a is None:
                    a = list(args)
                a[i] = Traced(args[i])
        elif _traceable(kwargs.get(name)):
            if kw is None:
                kw = dict(kwargs)
            kw[name] = Traced(kwargs[name])
    return (args if a is None else tuple(a)), (kwargs if kw is None else kw)


def _traceable(x) -> bool:
    """A ``scalar_args`` value that is traced: not None, not a tensor, and not the int 0 or 1
    (bools included), which stay in the key: a lowering may pick cheaper code for them
    (``add``'s default ``alpha=1``)."""
    if x is None or isinstance(x, Tensor):
        return False
    return not (type(x) in (int, bool) and 0 <= x <= 1)


_INT64 = (-(1 << 63), 1 << 63)


def _trace_wrapped(args, positions):
    """Python numbers where the schema has a ``Tensor`` (wrapped numbers: ``x * lr``,
    ``1 - beta ** step``) become Traced, so a value that changes every step does not
    recompile; the key keeps their kind (int or float: it decides the result dtype), and the
    ints 0 and 1 stay static (see ``_traceable``). ``args`` itself when there is none."""
    out = None
    for i in positions:
        if i < len(args):
            x = args[i]
            tx = type(x)
            if tx is float or (tx is int and (x > 1 or x < 0) and _INT64[0] <= x < _INT64[1]):
                if out is None:
                    out = list(args)
                out[i] = Traced(x)
    return args if out is None else tuple(out)


def offset_value(off: int):
    """A view's traced storage offset as a jit argument: a cached weakly typed device scalar
    (as ``Traced.device_value``: a Python int costs jit a host-to-device transfer per call);
    the C++ fast path passes the same object for the same offset."""
    return _device_scalar((int, off), off)


def _device_scalar(k, v):
    """The cached device scalar of Python number ``v`` under key ``k`` (type, value)."""
    d = _SCALARS.get(k)
    if d is None:
        if len(_SCALARS) >= 4096:
            _SCALARS.clear()
        d = _SCALARS[k] = jax.device_put(v)  # uncommitted: usable on any device
    return d


def trace_scalars(lowering, args, kwargs):
    """(args, kwargs, wrapped positions): the lowering's ``scalar_args`` as Traced, and the
    positions whose wrapped numbers ``arg_keys`` traces; neither once the lowering turned out
    to branch on such a value (``static_scalars``: then they are baked in)."""
    if lowering.meta.get("static_scalars"):
        return args, kwargs, ()
    if lowering.scalar_args:
        args, kwargs = _trace_scalars(lowering, args, kwargs)
    return args, kwargs, lowering.wrapped_pos


def _key(x, tensors):
    """Hashable static key of one argument; appends its tensors (and Traced scalars) to
    ``tensors``."""
    tx = type(x)
    if tx is int or x is None or tx is str:
        return x
    if tx is float:
        # nan != nan and 0.0 == -0.0: key those by their spelling (x * -0.0 is not x * 0.0)
        return (float, x) if x == x and x != 0.0 else (float, repr(x))
    if tx is bool:
        return (bool, x)
    if tx is complex:
        # 1 + 0j == 1 == True (and hashes alike): keyed bare, ``x * (1 + 0j)`` found the
        # program of ``x * 1`` and returned a real tensor. By spelling, as floats: -0.0, nan
        return (complex, repr(x))
    if isinstance(x, Tensor):
        tensors.append(x)
        return Tensor
    if tx is Traced:
        tensors.append(x)
        return x.key()
    if tx is list or tx is tuple:
        return tuple([_key(e, tensors) for e in x])
    return x


def arg_keys(args, kwargs, tensors, wrapped=()):
    """(key of the positional arguments, key of the keyword arguments); the tensors (and Traced
    scalars) go to ``tensors``. Shared by the Strict and Fused hot paths: the common argument,
    a plain tensor, is handled without a call. A Python number at one of the ``wrapped``
    positions becomes a Traced (the same test as ``_trace_wrapped``, which rebuilds the
    arguments for tracing at a cache miss)."""
    ka = []
    for x in args:
        if type(x) is Tensor:
            tensors.append(x)
            ka.append(Tensor)
        else:
            tx = type(x)
            if wrapped and (tx is float or (tx is int and (x > 1 or x < 0) and
                                            _INT64[0] <= x < _INT64[1])) and len(ka) in wrapped:
                x = Traced(x)
                tensors.append(x)
                ka.append((Traced, tx))
            else:
                ka.append(_key(x, tensors))
    return tuple(ka), (tuple([(k, _key(v, tensors)) for k, v in kwargs.items()]) if kwargs else ())


def _skeleton(x, counter):
    """The argument with each tensor replaced by a _Slot (built at a cache miss only)."""
    if isinstance(x, Tensor) or type(x) is Traced:
        s = _Slot(counter[0])
        counter[0] += 1
        return s
    if isinstance(x, (list, tuple)):
        return type(x)(_skeleton(e, counter) for e in x)
    return x


def _fill(x, vals):
    if type(x) is _Slot:
        return vals[x.i]
    if isinstance(x, (list, tuple)):
        return type(x)(_fill(e, vals) for e in x)
    return x


_CACHE: dict = {}


class _Entry:
    """A cache entry: the program, the flat positions of the storages it writes (one per
    storage), and its variants that donate written storages' arrays (``_donation``)."""
    __slots__ = ("jitted", "writes", "donated")

    def __init__(self, jitted, writes):
        self.jitted = jitted
        self.writes = writes
        self.donated = None  # {(donated positions, argument map): Program}


@jax.tree_util.register_pytree_node_class
class _Static:
    """A Python scalar result of a lowering (a SymInt return such as ``max_q``): a pytree node
    without leaves, so it passes through ``jax.jit`` as static data instead of an array."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def tree_flatten(self):
        return (), self.value

    @classmethod
    def tree_unflatten(cls, value, children):
        return cls(value)


def _static_results(out):
    if type(out) is tuple or type(out) is list:
        if any(isinstance(o, (int, float)) for o in out):
            return type(out)(_Static(o) if isinstance(o, (int, float)) else o for o in out)
    return out


def _result(o):
    if o is None:
        return None
    if type(o) is _Static:
        return o.value
    if type(o) is list:  # a Tensor[] result (the fused optimizers' outputs)
        return [_result(x) for x in o]
    return _wrap(o)


def _write_mutated(lowering, args, kwargs, out):
    """Registry flag ``mutates``: the lowering's trailing results are the new values of those
    arguments; write them back and return the op's own results."""
    names = [a.name for a in lowering.op._schema.arguments]
    n = len(lowering.mutates)
    for name, new in zip(lowering.mutates, out[-n:]):
        i = names.index(name)
        t = args[i] if i < len(args) else kwargs.get(name)
        if t is not None and new is not None:
            _copy.assign(t, new)
    res = out[:-n]
    return res[0] if len(res) == 1 else tuple(res)


def _check_cast(op_name, result_dt, self_dt):
    if not torch.can_cast(result_dt, self_dt):
        raise RuntimeError(
            f"result type {_copy._tname(result_dt)} can't be cast to the "
            f"desired output type {_copy._tname(self_dt)}")


def _device_index(dev) -> int:
    """The index a device argument names: "tpu" alone is the current device, as for CUDA (in a
    multi-process job, every index names this process's one device: devices.canonical_index)."""
    if dev is None or dev.index is None:
        return _devices.current_index()
    return _devices.canonical_index(dev.index)


def _device_for_factory(kwargs, args):
    dev = kwargs.get("device")
    if dev is None:
        for a in args:
            if isinstance(a, torch.device):
                dev = a
    return _devices.jax_device(_device_index(dev))


def _build(lowering, kind, args, kwargs, specs, tensors, write_slots, device=None,
           groups=None, key=None):
    """The program for one cache key (see make_traced; ``key`` also keys its executables in
    the compile cache folder, runtime/program_cache.py). ``device``: pin the outputs there
    (with several devices, an output that does not depend on an input would otherwise land
    on JAX's default device)."""
    traced = make_traced(lowering, kind, args, kwargs, specs, tensors, write_slots,
                         with_check=True, groups=groups)
    name = lowering.name

    def compiled(*flat):
        # runs once per program jax builds (a new key, or new shapes/dtypes for a key)
        count("eager_compiles", op=name)
        return traced(*flat)

    compiled.__name__ = name  # the XLA module's name (jit_aten.add.Tensor): profiles show it

    jit_kwargs = {}
    if not tensors:
        device = _device_for_factory(kwargs, args)
    if device is not None:
        jit_kwargs["out_shardings"] = jax.sharding.SingleDeviceSharding(device)
    return _program_cache.Program("eager", compiled, key, **jit_kwargs)


_multi = []


def _multi_device() -> bool:
    if not _multi:
        _multi.append(_devices.device_count() > 1)
    return _multi[0]


def _device_of_inputs(flat):
    for a in flat:
        sh = getattr(a, "sharding", None)
        if sh is not None:
            return next(iter(sh.device_set))
    return None


def make_traced(lowering, kind, args, kwargs, specs, tensors, write_slots, with_check=False,
                groups=None):
    """The pure function of one op application, shared by the Strict and Fused executors.

    It takes flat positional arguments: one storage array per tensor, then the traced storage
    offsets of strided views, then the RNG words for a random op (no pytrees on the hot path).
    It returns the op's outputs, or the new storage arrays of the tensors it writes; with
    ``with_check`` and a lowering that has a ``check``, the pair (that, inputs-valid flag).
    ``groups`` (from ``storage_groups``): the op writes a list of tensors some of which share
    a storage with another of its tensors; it then runs element by element (see
    ``_sequential``).
    """
    if groups is not None:
        return _sequential(lowering, args, kwargs, specs, tensors, write_slots, with_check,
                           groups)
    counter = [0]
    sk_args = _skeleton(args, counter)
    sk_kwargs = {k: _skeleton(v, counter) for k, v in kwargs.items()}
    fn = lowering.fn
    is_random = lowering.draws(args, kwargs)
    if lowering.random and not is_random:  # a random op's call that draws nothing
        fn = functools.partial(fn, None)
    op_name = lowering.name
    n = len(tensors)
    strided = [i for i, sp in enumerate(specs) if views.has_offset(sp)]
    functional = kind == FUNCTIONAL or kind == FUNCTIONAL_RAW
    check_fn = lowering.check[0] if with_check and lowering.check is not None else None
    # results a functional lowering must return: the schema's, then one per mutated argument
    n_results = len(lowering.op._schema.returns) + len(lowering.mutates)

    def traced(*flat):
        arrays = flat[:n]
        offsets = [None] * n
        for j, i in enumerate(strided):
            offsets[i] = flat[n + j]
        vals = [views.read(a, s, o) for a, s, o in zip(arrays, specs, offsets)]
        a = _fill(sk_args, vals)
        kw = {k: _fill(v, vals) for k, v in sk_kwargs.items()}
        out = apply(flat, arrays, offsets, vals, a, kw)
        if check_fn is None:
            return out
        return out, jnp.asarray(check_fn(*a, **kw), jnp.bool_)

    def apply(flat, arrays, offsets, vals, a, kw):
        if is_random:
            out = fn(_rng.key_from(flat[-1]), *a, **kw)
        else:
            out = fn(*a, **kw)
        if functional:
            if n_results > 1 and (type(out) not in (tuple, list) or len(out) != n_results):
                # checked while tracing: a wrong count would crash in C++ when the kernel returns
                raise RuntimeError(f"torchtpu: the lowering of {op_name} returned "
                                   f"{len(out) if type(out) in (tuple, list) else 1} results "
                                   f"where its schema has {n_results} (a torchtpu bug)")
            return _static_results(out)
        # in-place: out holds the new value(s) of the written tensor(s)
        news = out if isinstance(out, (list, tuple)) else (out,)
        if len(news) != len(write_slots):
            raise RuntimeError(f"{op_name}: lowering returned {len(news)} values for "
                               f"{len(write_slots)} mutated tensors")
        new_storages = []
        for v, slot in zip(news, write_slots):
            # the written tensor's dtype from its traced value: the cache key has no dtypes
            # (jit retraces per dtype), so a dtype captured at the first build can be stale
            dt = _buffer.dtypes.to_torch(vals[slot].dtype)
            _check_cast(op_name, _buffer.dtypes.to_torch(v.dtype), dt)
            shape = tuple(vals[slot].shape)
            if tuple(v.shape) != shape and jnp.broadcast_shapes(tuple(v.shape), shape) != shape:
                raise RuntimeError(f"output with shape {list(shape)} doesn't match the broadcast "
                                   f"shape {list(v.shape)}")
            new_storages.append(views.write(arrays[slot], specs[slot], offsets[slot], v))
        return tuple(new_storages)

    return traced


def storage_groups(kind, args, kwargs, tensors, lowering=None):
    """For an in-place op on a list ``self`` (it writes ``tensors[:len(self)]``), or one whose
    lowering's ``writes`` flag names several arguments: None when no written tensor shares its
    storage with another tensor of the op (the common case), else each tensor's group, the
    index of the first tensor on the same storage (part of the cache key: it changes the
    program)."""
    if kind != INPLACE and kind != DIRECT_INPLACE:
        return None
    if lowering is not None and lowering.writes:
        written = set(_named_slots(lowering, args, kwargs))
        n_writes = -1
    else:
        first = args[0] if args else kwargs.get("self")
        if type(first) is not list and type(first) is not tuple:
            return None
        n_writes = len(first)
        written = None
    seen: dict = {}
    groups = []
    shared = False
    for j, t in enumerate(tensors):
        st = getattr(t.untyped_storage(), "_tpu_buffer", None) if isinstance(t, Tensor) else None
        if st is None:
            groups.append(j)
            continue
        g = seen.setdefault(id(st), j)
        if g != j and (g < n_writes or j < n_writes if written is None else
                       g in written or j in written):
            shared = True
        groups.append(g)
    return tuple(groups) if shared else None


class _Sliced:
    """A skeleton slot whose value (a traced Scalar[] array) is taken at one list position."""
    __slots__ = ("i", "pos")

    def __init__(self, i, pos):
        self.i = i
        self.pos = pos


def _at_position(x, pos, n, tensors):
    """Skeleton argument ``x`` restricted to list position ``pos`` of an ``n``-long list op:
    a top-level list of length ``n`` becomes its one element (as a list), a traced Scalar[]
    its one value; anything else is shared by every position."""
    if isinstance(x, (list, tuple)) and len(x) == n:
        return type(x)([x[pos]])
    if type(x) is _Slot and type(tensors[x.i]) is Traced and type(tensors[x.i].value) in (list, tuple):
        return _Sliced(x.i, pos)
    return x


def _fill_lazy(x, get):
    """_fill, reading each slot's value through ``get(slot index)`` when it is used."""
    if type(x) is _Slot:
        return get(x.i)
    if type(x) is _Sliced:
        return get(x.i)[x.pos:x.pos + 1]
    if isinstance(x, (list, tuple)):
        return type(x)(_fill_lazy(e, get) for e in x)
    return x


def _sequential(lowering, args, kwargs, specs, tensors, write_slots, with_check, groups):
    """An in-place list op whose written tensors share storage with each other or with its
    other tensors (FSDP's copy-in into split views of one flat buffer, ``clip_grad_norm_``
    over views of one gradient buffer, a view and its base in one list), computed as the CPU
    kernels do: position by position, each reading the storage as the positions before it
    left it and writing into it, so no write is lost and later positions see earlier writes.

    The lowering is applied to the one-element lists of each position. An op with a tensor
    argument outside its lists (``_foreach_addcdiv_(..., scalars: Tensor)``, whose per-position
    meaning the skeleton cannot tell) or a random one is applied to the whole lists at each
    position and position ``i``'s result is taken (XLA drops the rest)."""
    if lowering.writes:
        # (the fused optimizers' kernels take another path when storages are shared)
        raise NotImplementedError(f"{lowering.name}: written tensors that share a storage "
                                  "(a torchtpu bug: its kernel composes it of other ops then)")
    counter = [0]
    sk_args = _skeleton(args, counter)
    sk_kwargs = {k: _skeleton(v, counter) for k, v in kwargs.items()}
    fn = lowering.fn
    is_random = lowering.draws(args, kwargs)
    if lowering.random and not is_random:  # a random op's call that draws nothing
        fn = functools.partial(fn, None)
    op_name = lowering.name
    n = len(tensors)
    n_writes = len(write_slots)
    # one new array per written storage (``_write_slots`` with the groups: its first tensor)
    out_groups = [s for s in write_slots if groups[s] == s]
    strided = [i for i, sp in enumerate(specs) if views.has_offset(sp)]
    check_fn = lowering.check[0] if with_check and lowering.check is not None else None
    top = list(sk_args) + list(sk_kwargs.values())
    whole = is_random or any(
        type(x) is _Slot and isinstance(tensors[x.i], Tensor) for x in top)
    per_pos = []
    for pos in range(n_writes):
        if whole:
            per_pos.append((sk_args, sk_kwargs))
        else:
            per_pos.append((tuple(_at_position(x, pos, n_writes, tensors) for x in sk_args),
                            {k: _at_position(v, pos, n_writes, tensors)
                             for k, v in sk_kwargs.items()}))

    def traced(*flat):
        offsets = [None] * n
        for j, i in enumerate(strided):
            offsets[i] = flat[n + j]
        state = {}
        for j in range(n):
            state.setdefault(groups[j], flat[j])

        def get(j):
            return views.read(state[groups[j]], specs[j], offsets[j])

        ok = None
        for pos, slot in enumerate(write_slots):
            a_sk, kw_sk = per_pos[pos]
            a = _fill_lazy(a_sk, get)
            kw = {k: _fill_lazy(v, get) for k, v in kw_sk.items()}
            if is_random:
                out = fn(_rng.key_from(flat[-1]), *a, **kw)
            else:
                out = fn(*a, **kw)
            if check_fn is not None:
                flag = jnp.asarray(check_fn(*a, **kw), jnp.bool_)
                ok = flag if ok is None else ok & flag
            news = out if isinstance(out, (list, tuple)) else (out,)
            v = news[pos] if whole else news[0]
            old = get(slot)
            _check_cast(op_name, _buffer.dtypes.to_torch(v.dtype),
                        _buffer.dtypes.to_torch(old.dtype))
            shape = tuple(old.shape)
            if tuple(v.shape) != shape and jnp.broadcast_shapes(tuple(v.shape), shape) != shape:
                raise RuntimeError(f"output with shape {list(shape)} doesn't match the broadcast "
                                   f"shape {list(v.shape)}")
            g = groups[slot]
            state[g] = views.write(state[g], specs[slot], offsets[slot], v)
        out = tuple(state[g] for g in out_groups)
        if check_fn is None:
            return out
        return out, (jnp.asarray(True) if ok is None else ok)

    return traced


# ---- donation: an in-place write reuses its storage's buffer ----
# A write into a storage produces the storage's whole new array. When nothing but the storage's
# Buffer holds the old array, the program gets it donated (XLA input/output aliasing): the new
# array is written into the old one's memory, so a write costs the bytes it writes, not the
# storage's size, and the storage never exists twice. Anything else that can still read the
# old array keeps a Python reference to it and so blocks donation (the write then copies, as
# it always did): another storage sharing the immutable array (zero-copy ``.to``, ``copy_`` of
# a whole tensor, ``value_of``), a pending Fused graph's inputs, an Event's snapshot, a cached
# device scalar, a user's jax array. Buffers with external references (a numpy view of the
# array on the CPU platform, a DLPack capsule) are refused by PJRT itself, which then copies
# (measured: no error, the view keeps its value). Arrays on several devices are never donated.
DONATE = os.environ.get("TORCHTPU_DONATE", "1") not in ("0", "")
_refcount = sys.getrefcount


def _probe(flat, s):
    a = flat[s]
    return _refcount(a)


class _Holder:
    __slots__ = ("array",)


def _sole_count() -> int:
    """What ``_donation`` reads as the reference count of an array that only its storage's
    Buffer and the call's argument list hold (measured, not assumed: it differs between Python
    versions)."""
    h = _Holder()
    h.array = object()
    return _probe([h.array], 0)


_SOLE = _sole_count()


def _donation(entry, flat):
    """(program, arguments) for a call of an entry that writes storages: the variant that
    donates every written array nothing else holds. An array passed at several positions of
    the call (``x.mul_(x)``, views of one storage in one list) is passed once to the donating
    variant (part of its key), since PJRT refuses an argument donated and read in one call."""
    donate = []
    dups = None
    for s in entry.writes:
        a = flat[s]
        n = _refcount(a)
        if n > _SOLE or not DONATE:
            if not DONATE:
                _copied("disabled")
                continue
            k = 0  # extra references the call itself holds: the array at other positions
            for b in flat:
                if b is a:
                    k += 1
            b = None
            if n - (k - 1) > _SOLE or type(a) is not _ArrayImpl:
                _copied("shared")
                continue
            if dups is None:
                dups = {}
            dups[s] = [j for j, b in enumerate(flat) if b is a and j != s]
        if _multi_device() and len(a.sharding.device_set) != 1:
            _copied("sharded")
            continue
        donate.append(s)
    a = None
    if not donate:
        return entry.jitted, flat
    COUNTERS["eager_donated_writes"] += len(donate)
    if dups is None:
        variant = (tuple(donate), None)
        call = flat
    else:  # pass each donated array once: the others map to its position
        drop = {}
        for s, js in dups.items():
            if s in donate:
                for j in js:
                    drop[j] = s
        keep = [j for j in range(len(flat)) if j not in drop]
        new_pos = {j: i for i, j in enumerate(keep)}
        expand = tuple(new_pos[drop.get(j, j)] for j in range(len(flat)))
        variant = (tuple(new_pos[s] for s in donate), expand)
        call = [flat[j] for j in keep]
    progs = entry.donated
    if progs is None:
        progs = entry.donated = {}
    prog = progs.get(variant)
    if prog is None:
        prog = progs[variant] = _donating(entry.jitted, *variant)
    return prog, call


def _copied(reason: str) -> None:
    count("eager_copied_writes", op=reason)


def _donating(prog, donate, expand):
    """The variant of Program ``prog`` that donates flat arguments ``donate`` (positions in its
    own argument list); ``expand``: for each of ``prog``'s arguments, the position it is taken
    from (None: the same arguments)."""
    fn = prog.fn
    if expand is not None:
        inner = fn

        def fn(*args):
            return inner(*[args[i] for i in expand])

        fn.__name__ = inner.__name__
    key = None if prog.key is None else prog.key + (("donate", donate, expand),)
    return _program_cache.Program(prog.kind, fn, key, donate_argnums=donate, **prog.jit_kwargs)


def _index_of_flat(flat) -> int:
    """The device index of a call's first committed array (for an out-of-memory message)."""
    for a in flat:
        if type(a) is _ArrayImpl:
            try:
                return _devices.devices().index(next(iter(a.sharding.device_set)))
            except Exception:  # noqa: BLE001 - a deleted array, another platform's device
                return 0
    return _devices.current_index()


def _guess_next(key, flat, ctx) -> None:
    try:
        _key_guess.observe(key, _program_cache.signature(flat), _key_guess.remember(ctx),
                           _CACHE, _guessed_entry)
    except Exception as e:  # noqa: BLE001 - a guess never fails the op that was run
        count("eager_key_guess_errors")
        _key_guess.debug(e)


def _guessed_entry(ctx, key):
    """The cache entry the executor would make for a guessed key (eager/key_guess.py)."""
    lowering, kind, args, kwargs, _ka, _kk, n, ws, wrapped, _flat = ctx
    return _Entry(_build(lowering, kind, _trace_wrapped(args, wrapped), kwargs, key[4],
                         [None] * n, ws, None, None, key), ws)


def _write_slots(kind, args, kwargs, lowering=None, groups=None):
    """Which flattened tensors an in-place kernel writes: ``self`` (a tensor or a list), or
    every tensor of the arguments the lowering's ``writes`` flag names. With storage
    ``groups``, one slot per written storage (its first tensor): the program returns one new
    array per storage."""
    if kind != INPLACE and kind != DIRECT_INPLACE:
        return ()
    if lowering is not None and lowering.writes:
        ws = _named_slots(lowering, args, kwargs)
    else:
        first = args[0] if args else kwargs.get("self")
        if isinstance(first, Tensor):
            return (0,)
        ws = tuple(range(len(first)))
    if groups is not None:
        ws = tuple(s for s in ws if groups[s] == s)
    return ws


def _n_flat(x) -> int:
    """How many flat program arguments (tensors, Traced scalars) argument ``x`` gives
    (``_key``'s walk)."""
    if isinstance(x, Tensor) or type(x) is Traced:
        return 1
    if type(x) is list or type(x) is tuple:
        n = 0
        for e in x:
            n += _n_flat(e)
        return n
    return 0


def _named_slots(lowering, args, kwargs):
    """The flat positions of every tensor of the arguments named by the lowering's ``writes``
    flag, in that order (the order of the new values its lowering returns)."""
    names = lowering.writes
    if callable(names):
        names = names(args, kwargs)
    schema = [a.name for a in lowering.op._schema.arguments]
    wrapped = () if lowering.meta.get("static_scalars") else lowering.wrapped_pos
    spans = {}
    pos = 0
    for i, x in enumerate(args):
        n = _n_flat(x)
        if i in wrapped and (type(x) is float or (type(x) is int and (x > 1 or x < 0) and
                                                  _INT64[0] <= x < _INT64[1])):
            n = 1  # a wrapped number: arg_keys passes it as a Traced
        spans[schema[i]] = (pos, pos + n)
        pos += n
    for name, x in kwargs.items():
        n = _n_flat(x)
        spans[name] = (pos, pos + n)
        pos += n
    out = []
    for name in names:
        if name in spans:
            out.extend(range(*spans[name]))
    return tuple(out)


def run_strict(lowering, kind, args, kwargs, mode=None):
    """One op, now: the Strict (and Debug) executor, whatever the current mode."""
    return run(lowering, kind, args, kwargs, _STRICT if mode is None else mode)


from jax._src.array import ArrayImpl as _ArrayImpl  # noqa: E402  (no backend at import)

# Set by the fused executor (eager/fused.py) when it is loaded: run(...) hands every op to it
# while the mode is DEFER_AND_FUSE.
fused_run = None
_FUSED = modes.EagerMode.DEFER_AND_FUSE
_DEBUG = modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
_STRICT = modes.EagerMode.DEFER_NEVER
_mode_state = modes._state


def cpu_scalar(t, lowering, tensors):
    """A 0-dim CPU tensor operand of a tpu op (CUDA accepts these too), as a jit argument; it
    promotes as a 0-dim tensor. (A Python number operand never arrives here: PyTorch hands
    wrapped numbers to Python kernels as Python scalars.) PyTorch's device-mismatch error for
    any other non-tpu tensor."""
    if t.device.type == "cpu" and t.dim() == 0:
        return _copy.host_to_device(t)
    raise _device_error(lowering, tensors)


def spec_for(t, arr):
    """(view spec, offset) of tensor ``t`` over a storage array (or its aval)."""
    shape = t.shape
    if t.storage_offset() == 0 and t.is_contiguous() and not t.is_conj() and not t.is_neg() \
            and arr.shape == shape and _NP[t.dtype] == arr.dtype:
        return None, None
    return views.spec_of(t, arr)


def run(lowering, kind, args, kwargs, mode=None):
    """Execute one op eagerly. Returns what the aten kernel must return.

    ``mode``: None reads the current eager mode (and hands the op to the Fused executor while
    it records); the Fused executor passes its own to run an op now (Strict).
    """
    if mode is None:
        mode = _mode_state["mode"]
        if mode is _FUSED and fused_run is not None:
            return fused_run(lowering, kind, args, kwargs)
    dyn = lowering.dynamic_shape
    if dyn and (dyn is True or dyn(args, kwargs)):
        return run_dynamic(lowering, kind, args, kwargs)
    gen = None
    if lowering.random and "generator" in kwargs:
        kwargs = dict(kwargs)
        gen = kwargs.pop("generator")
    draws = lowering.random and lowering.draws(args, kwargs)
    if lowering.reads_layout:
        kwargs = with_layout(args, kwargs)
    orig = (args, kwargs)
    args, kwargs, wrapped = trace_scalars(lowering, args, kwargs)
    traced_scalars = args is not orig[0] or kwargs is not orig[1]
    tensors: list = []
    key_args, key_kwargs = arg_keys(args, kwargs, tensors, wrapped)
    flat = []
    specs = []
    offs = None
    plain = True  # every tensor a storage's array, no CPU scalar (the C++ fast path's condition)
    for t in tensors:
        if type(t) is Traced:
            flat.append(t.device_value())
            specs.append(None)
            traced_scalars = True
            continue
        try:
            arr = t.untyped_storage()._tpu_buffer.array
        except AttributeError:
            flat.append(cpu_scalar(t, lowering, tensors))
            specs.append(None)
            plain = False
            continue
        flat.append(arr)
        # spec_for's fast path, inlined: this loop runs for every tensor of every op
        if t.storage_offset() == 0 and t.is_contiguous() and not t.is_conj() and not t.is_neg() \
                and arr.shape == t.shape and _NP[t.dtype] == arr.dtype:
            specs.append(None)
            continue
        spec, off = views.spec_of(t, arr)
        specs.append(spec)
        if off is not None:
            if offs is None:
                offs = []
            offs.append(offset_value(off))
    if offs is not None:
        flat.extend(offs)
    specs = tuple(specs)
    # the default dtype decides factories' and int-tensor-with-Python-float results: keyed
    key = (lowering, kind, key_args, key_kwargs, specs, _default_dtype())
    if lowering.reads_precision:
        key = key + (matmul_precision(),)
    groups = None
    if kind != FUNCTIONAL and kind != FUNCTIONAL_RAW:
        groups = storage_groups(kind, args, kwargs, tensors)
        if groups is not None:
            key = key + (groups,)
    dev = None
    if not tensors:  # a factory: its program is bound to the current device
        key = key + (_device_index(None),)
    elif _multi_device():
        dev = _device_of_inputs(flat)
        key = key + (dev,)
    entry = _CACHE.get(key)
    if entry is None:
        COUNTERS["eager_cache_misses"] += 1
        ws = _write_slots(kind, args, kwargs, lowering)
        entry = _CACHE[key] = _Entry(
            _build(lowering, kind, _trace_wrapped(args, wrapped), kwargs, specs, tensors, ws,
                   dev, groups, key),
            ws if groups is None else _write_slots(kind, args, kwargs, lowering, groups))
        guess = dev is None and groups is None and _key_guess.enabled()
    else:
        guess = False
        COUNTERS["eager_cache_hits"] += 1
    if draws:
        flat.append(_rng.next_state(gen))
    prog = entry.jitted
    call = flat
    if entry.writes:
        arr = None  # (the loop's last array: not a holder)
        prog, call = _donation(entry, flat)
    try:
        if _deferred.ON[0] and mode is not _DEBUG and not draws and groups is None \
                and dev is None and kind != FUNCTIONAL_RAW:
            # no executable yet for these shapes: built on a worker while this call runs on
            # the host, where that is exact (deferred.py)
            try:
                out = prog.call_or_defer(call, lambda: _deferred.eligible(
                    lowering, orig[0], orig[1], tensors, entry.writes, not entry.writes),
                    _deferred.HOLD[0])
            except _program_cache.Deferred:
                return _deferred.serve(lowering, orig[0], orig[1],
                                       tensors[entry.writes[0]] if entry.writes else None)
        else:
            out = prog(*call)
        del call
        if guess:  # a miss: guess the next key if this op's static arguments grow
            _guess_next(key, flat, (lowering, kind, args, kwargs, key_args, key_kwargs,
                                    len(tensors), ws, wrapped, flat))
        if lowering.check is not None:
            out, ok = out
            if mode is _DEBUG:
                _checks.check_now(ok, lowering.name, *lowering.check[1:])
            else:
                _checks.add(ok, lowering.name, *lowering.check[1:])
    except (TypeError, ValueError, RuntimeError) as e:
        oom = _memory.oom_error(e, _index_of_flat(flat))
        if oom is not None:
            raise oom from e
        if isinstance(e, RuntimeError):
            raise
        if traced_scalars and isinstance(e, jax.errors.ConcretizationTypeError):
            # the lowering branches on a scalar_args value: bake its scalars in from now on
            lowering.meta["static_scalars"] = True
            _fastpath.clear()  # its entries pass traced scalars the Python path now bakes in
            _CACHE.pop(key, None)
            return run(lowering, kind, orig[0], orig[1], mode)
        err = _trace_error(lowering, tensors, e)
        if err is e:
            raise
        raise err from e
    if mode is _DEBUG:
        _memory.block_until_ready(out)
    if lowering.mutates:
        out = _write_mutated(lowering, args, kwargs, out)
    if kind == FUNCTIONAL:
        res = _results(out)
        if plain and _fastpath.pending() is lowering and mode is _STRICT:
            _offer(lowering, entry, flat, tensors, out, groups, dev, draws, orig[0])
        return res
    if kind == FUNCTIONAL_RAW:
        if type(out) is tuple or type(out) is list:
            return type(out)(o.value if type(o) is _Static else o for o in out)
        return out
    for slot, new in zip(entry.writes, out):
        tensors[slot].untyped_storage()._tpu_buffer.array = new
    return args[0] if args else kwargs["self"]


def _offer(lowering, entry, flat, tensors, out, groups, dev, draws, args) -> None:
    """Hand an eligible call to the C++ fast path (eager/fastpath.py), which serves the next
    calls with the same key itself. Eligible: nothing but the program's call happens on this
    path for that key (no random state drawn, mutated arguments, written storages, storage
    groups, several devices; a check's flag goes to checks.add, as in ``run``; an
    ``eager_layout`` only where ``eager_layout_like`` says which argument each result is laid
    out like: the entry restrides it so). A factory's entry is made for tpu:0 (the only device
    where ``_multi_device`` is false)."""
    like = lowering.meta.get("eager_layout_like")
    if (draws or lowering.mutates or entry.writes
            or lowering.reads_layout or groups is not None or dev is not None
            or _multi_device()
            or (lowering.meta.get("eager_layout") is not None and like is None)):
        return
    if not tensors and _device_index(None) != 0:  # a factory: the C++ path makes tpu:0 outputs
        return
    try:
        check = None if lowering.check is None else _check_adder(lowering)
        layout = None
        if like is not None:  # each result's order (None: as returned), from the key's metadata
            layout = tuple(args[p] if p < len(args) and isinstance(args[p], torch.Tensor)
                           else None for p in like)
        _fastpath.offer(lowering, entry.jitted, flat, tensors, out, Traced, check,
                        static_type=_Static, layout_like=layout)
    except Exception as e:  # noqa: BLE001 - an entry not installed is the Python path
        count("eager_fastpath_offer_errors")
        _fastpath._log.debug("torchtpu: fast path entry not installed: %r", e)


_CHECK_ADDERS: dict = {}  # lowering -> its _check_adder


def _check_adder(lowering):
    """What a checked op's fast-path entry passes its flag to: ``checks.add`` with the op's
    name, exception and message bound (the Strict call in ``run``)."""
    fn = _CHECK_ADDERS.get(lowering)
    if fn is None:
        fn = _CHECK_ADDERS[lowering] = functools.partial(
            _checks.add, name=lowering.name, exc=lowering.check[1], message=lowering.check[2])
    return fn


def _results(out):
    """The tensors a functional kernel returns for the lowering's result(s)."""
    if type(out) is _ArrayImpl:
        return _wrap(out)
    if type(out) is tuple or type(out) is list:
        return type(out)(_result(o) for o in out)
    return _result(out)


def run_dynamic(lowering, kind, args, kwargs):
    """A data-dependent-shape op (registry flag ``dynamic_shape``): run the lowering un-jitted
    on the concrete values (its output shape is known only then); counted as a host sync."""
    tensors: list = []
    _key(args, tensors)
    _key(tuple(kwargs.values()), tensors)
    vals = [_copy.value_of(t) for t in tensors]
    counter = [0]
    a = _fill(_skeleton(args, counter), vals)
    kw = {k: _fill(_skeleton(v, counter), vals) for k, v in kwargs.items()}
    _sync_debug.note(f"{lowering.name} (its output's shape depends on the data)")
    count("host_syncs", op=lowering.name)
    if lowering.check is not None:
        _checks.check_now(lowering.check[0](*a, **kw), lowering.name, *lowering.check[1:])
    out = lowering.fn(*a, **kw)
    if kind == FUNCTIONAL:
        return _results(out)
    if kind == FUNCTIONAL_RAW:
        return out
    news = out if isinstance(out, (list, tuple)) else (out,)
    for slot, new in zip(_write_slots(kind, args, kwargs), news):
        _check_cast(lowering.name, _buffer.dtypes.to_torch(new.dtype), tensors[slot].dtype)
        _copy.assign(tensors[slot], new)
    return args[0] if args else kwargs["self"]


def run_out(lowering, args, kwargs, outs):
    """An out= kernel: compute functionally, then write into (and resize) the out tensors."""
    if _mode_state["mode"] is _FUSED and fused_run is not None:
        return _run_out_recorded(lowering, args, kwargs, outs)
    out = run(lowering, FUNCTIONAL_RAW, args, kwargs)
    vals = out if isinstance(out, (list, tuple)) else (out,)
    for t, v in zip(outs, vals):
        _copy.assign_out(t, v, lowering.name)
    return outs[0] if len(outs) == 1 else tuple(outs)


_COPY = []


def copy_lowering():
    """The table's copy_ lowering (a recorded tpu->tpu assignment), looked up once."""
    if not _COPY:
        from ..lowering import registry

        _COPY.append(registry.get(torch.ops.aten.copy_.default))
    return _COPY[0]


def _run_out_recorded(lowering, args, kwargs, outs):
    """out= while recording: the functional result, then a recorded copy_ into each out."""
    res = run(lowering, FUNCTIONAL, args, kwargs)
    vals = res if isinstance(res, (list, tuple)) else (res,)
    for t, v in zip(outs, vals):
        if not torch.can_cast(v.dtype, t.dtype):
            raise RuntimeError(f"result type {_copy._tname(v.dtype)} can't be cast to the desired "
                               f"output type {_copy._tname(t.dtype)}")
        if tuple(t.shape) != tuple(v.shape):
            _copy.resize(t, list(v.shape))
        run(copy_lowering(), DIRECT_INPLACE, (t, v), {})
    return outs[0] if len(outs) == 1 else tuple(outs)


def _broadcast_message(shapes):
    """PyTorch's wording for the first pair of operand shapes that do not broadcast."""
    for i, a in enumerate(shapes):
        for b in shapes[i + 1:]:
            n = max(len(a), len(b))
            for d in range(1, n + 1):
                x = a[-d] if d <= len(a) else 1
                y = b[-d] if d <= len(b) else 1
                if x != y and x != 1 and y != 1:
                    return (f"The size of tensor a ({x}) must match the size of tensor b ({y}) "
                            f"at non-singleton dimension {n - d}")
    return None


def _trace_error(lowering, tensors, e):
    """PyTorch's exception for what JAX rejected while building an op's program."""
    msg = str(e)
    if "incompatible devices" in msg:  # tpu:0 and tpu:1 tensors in one op
        return _device_error(lowering, tensors)
    if "Incompatible shapes for broadcasting" in msg or "incompatible shapes" in msg.lower():
        shapes = [tuple(t.shape) for t in tensors if isinstance(t, Tensor)]
        return RuntimeError(_broadcast_message(shapes) or f"{lowering.name}: {msg.splitlines()[0]}")
    if isinstance(e, TypeError):
        return e  # ours (an unsupported dtype) or PyTorch-style already
    return RuntimeError(f"{lowering.name} on device tpu: {msg.splitlines()[0]}")


def _device_error(lowering, tensors):
    devs = sorted({str(t.device) for t in tensors})
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{', '.join(devs)}! (when checking argument for {lowering.name})")
