"""Lowerings of higher-order ops (HOPs) for graphs compiled with ``torch.compile(backend="tpu")``.

A HOP node carries subgraphs (``torch.fx.GraphModule``s: FlexAttention's ``score_mod`` and
``mask_mod``) as static arguments. A HOP lowering is, like every lowering, a pure JAX function
of arrays and static values; it runs its subgraphs with ``run_subgraph``, which evaluates each
node through the same aten lowering table (so a subgraph means what the op table says, and
jax.vmap/jit can trace it). ``compile/lower.py`` looks HOPs up with ``get``.
"""
from __future__ import annotations

import math
import operator

import jax.numpy as jnp
import numpy as np
import torch
from torch._ops import OpOverload

from . import registry

HOPS: dict = {}


def register_hop(*hops):
    def deco(fn):
        for h in hops:
            HOPS[h] = fn
        return fn

    return deco


_filled = [False]


def get(hop):
    """The lowering of a higher-order op, or None."""
    if not _filled[0]:  # not "if not HOPS": a module may have registered one of its own already
        _filled[0] = True
        _register_functionalized()
    return HOPS.get(hop)


def _plain(x):
    if type(x) is tuple or isinstance(x, list):
        return type(x)(_plain(e) for e in x) if type(x) is tuple else [_plain(e) for e in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def torch_to_np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's value as a numpy array (bfloat16 through ml_dtypes); PyTorch's lazy
    conjugate/negative bits are applied (numpy() refuses such a tensor: a CPU op inside a
    compiled graph may return one, e.g. ``conj``)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# reads a tpu tensor's jax array: the executors register theirs (eager/copy.py) when they load,
# so lowering never imports a layer above it
_tensor_value: list = [None]


def register_tensor_value(fn) -> None:
    _tensor_value[0] = fn


def constant(v):
    """A graph constant (``get_attr``) as a jax value: tpu tensors by their array."""
    if isinstance(v, torch.Tensor):
        if v.device.type == "tpu":
            return _tensor_value[0](v)
        return jnp.asarray(torch_to_np(v.detach().cpu()))
    return v


def fetch_attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _name(op) -> str:
    if isinstance(op, OpOverload):
        return f"{op._schema.name}.{op._overloadname}"
    return getattr(op, "__name__", str(op))


# value-preserving ops that a traced mask_mod may hold (context parallelism's load-balanced
# mask_mod detaches its index tables in place): on arrays they are the identity
_IDENTITY = {torch.ops.aten.detach.default, torch.ops.aten.detach_.default,
             torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default}


def _call(gm, target, args, kwargs):
    if target is operator.getitem:
        return args[0][args[1]]
    if isinstance(target, torch._ops.HigherOrderOperator) and get(target) is not None:
        return get(target)(*args, **kwargs)  # a nested one (a scan or region inside a region)
    if not isinstance(target, OpOverload):
        if getattr(target, "__module__", None) in ("_operator", "operator", "math", "builtins"):
            return target(*args, **kwargs)
        raise NotImplementedError(
            f"{type(gm).__name__}: {_name(target)} inside a subgraph is not supported by the "
            "tpu compiler")
    if target in _IDENTITY:
        return args[0]
    low = registry.get(target)
    dyn = low is not None and low.dynamic_shape
    if dyn and dyn is not True:
        dyn = dyn(args, kwargs)  # a per-call predicate (boolean-mask indexing)
    draws = low is not None and low.random and low.draws(args, kwargs)
    if low is None or draws or dyn or low.reads_layout or low.mutates:
        why = "has no lowering" if low is None else "is random, data-dependent or writes its input"
        raise NotImplementedError(
            f"Could not run '{_name(target)}' inside a subgraph (a FlexAttention score_mod/"
            f"mask_mod, a torch.cond branch or a torch.while_loop function) compiled for the "
            f"'tpu' backend: it {why} (subgraphs run on the device only)")
    if low.random:  # a random op's call that draws nothing
        return low.fn(None, *args, **kwargs)
    return low.fn(*args, **kwargs)


def run_subgraph(gm: torch.fx.GraphModule, *args):
    """Evaluate ``gm`` on jax values (arrays, 0-d arrays under vmap, Python scalars)."""
    env = {}
    pos = iter(args)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(pos)
        elif n.op == "get_attr":
            env[n] = constant(fetch_attr(gm, n.target))
        elif n.op == "call_function":
            a = _plain(torch.fx.node.map_arg(n.args, env.__getitem__))
            k = _plain(torch.fx.node.map_arg(n.kwargs, env.__getitem__))
            env[n] = _call(gm, n.target, a, k)
        elif n.op == "output":
            return _plain(torch.fx.node.map_arg(n.args[0], env.__getitem__))
        else:
            raise NotImplementedError(f"FX node kind {n.op} in a subgraph")
    raise RuntimeError("subgraph without output")


def placeholder_dtypes(gm: torch.fx.GraphModule, default=np.int32) -> list:
    """The jax dtypes of ``gm``'s inputs, from their example values (``default`` if absent)."""
    from ..runtime.dtypes import to_jax

    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        out.append(to_jax(v.dtype) if isinstance(v, torch.Tensor) else np.dtype(default))
    return out


def graph_code(gm) -> str:
    """The code of ``gm`` and every subgraph it holds, without comments (a cache-key part)."""
    parts = []
    for name, m in gm.named_modules():
        if isinstance(m, torch.fx.GraphModule):
            code = "\n".join(line for line in m.code.splitlines()
                             if not line.lstrip().startswith("#"))
            parts.append(f"{name}:\n{code}")
    return "\n".join(parts)


LN2 = math.log(2.0)


# ---- functionalized mutable ops (custom ops that write an argument: a KV cache update) ----
# aot_autograd turns a call of a mutable custom op into ``auto_functionalized_v2(op, **kwargs)``
# (``auto_functionalized`` in older graphs): the written arguments are given as views of
# ``_all_bases`` and the node returns ``(op results..., new value of every base)``; a later
# ``copy_`` writes a new base back into its graph input. The op itself runs through its entry
# in the lowering table: registered on the mutable overload, a lowering returns the new value of
# the argument it writes (several: a tuple in schema order); with the ``mutates`` flag, the op's
# results followed by the new values of the named arguments.

def _mutable_args(schema):
    return [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _read_view(kwargs, name):
    """(base index, view) of mutable argument ``name`` from auto_functionalized_v2's keys."""
    p = f"_{name}"
    base = kwargs.pop(f"{p}_base_index", None)
    if f"{p}_alias" in kwargs:
        kwargs.pop(f"{p}_alias")
        return base, None
    if f"{p}_storage_offset" in kwargs:
        return base, ("as_strided", tuple(kwargs.pop(f"{p}_size")),
                      tuple(kwargs.pop(f"{p}_stride")), int(kwargs.pop(f"{p}_storage_offset")))
    if f"{p}_slice_dim" in kwargs:
        return base, ("slice", int(kwargs.pop(f"{p}_slice_dim")),
                      kwargs.pop(f"{p}_slice_start"), kwargs.pop(f"{p}_slice_end"))
    return base, None


def _strided_index(size, stride, offset):
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return idx


def _view_of(base, view):
    """The value of a view of ``base`` (a contiguous graph value, as functional graphs have)."""
    if view is None:
        return base
    if view[0] == "slice":
        _, dim, start, end = view
        n = base.shape[dim]
        start = 0 if start is None else (start + n if start < 0 else min(start, n))
        end = n if end is None else (end + n if end < 0 else min(end, n))
        return jax_lax().slice_in_dim(base, start, end, axis=dim)
    _, size, stride, offset = view
    return base.reshape(-1)[_strided_index(size, stride, offset)]


def _write_view(base, view, new):
    if view is None:
        return new.astype(base.dtype).reshape(base.shape)
    if view[0] == "slice":
        _, dim, start, end = view
        n = base.shape[dim]
        start = 0 if start is None else (start + n if start < 0 else min(start, n))
        return jax_lax().dynamic_update_slice_in_dim(base, new.astype(base.dtype), start, axis=dim)
    _, size, stride, offset = view
    flat = base.reshape(-1).at[_strided_index(size, stride, offset).reshape(-1)].set(
        new.astype(base.dtype).reshape(-1))
    return flat.reshape(base.shape)


def jax_lax():
    from jax import lax

    return lax


def _run_functionalized(op, kwargs, bases, views):
    schema = op._schema
    name = _name(op)
    low = registry.get(op)
    if low is None:
        raise NotImplementedError(
            f"Could not run '{name}' in a graph compiled for the 'tpu' backend: the mutable op "
            "has no lowering (register one on its mutable overload, or call it outside the "
            "compiled region)")
    if low.random or low.dynamic_shape or low.reads_layout:
        raise NotImplementedError(f"'{name}': a random, data-dependent or layout-reading "
                                  "mutable op is not supported inside compiled graphs yet")
    mut = _mutable_args(schema)
    vals = {}
    for a in mut:
        info = views[a.name]
        if isinstance(info, list):  # a Tensor(a!)[] argument: one (base, view) per element
            vals[a.name] = [None if b is None else _view_of(bases[b], v) for b, v in info]
        else:
            b, v = info
            vals[a.name] = None if b is None else _view_of(bases[b], v)
    args, kw = [], {}
    for a in schema.arguments:
        if a.name in vals:
            val = vals[a.name]
        elif a.name in kwargs:
            val = kwargs[a.name]
        elif a.has_default_value():
            val = a.default_value
        else:
            raise NotImplementedError(f"'{name}': argument {a.name} missing in its "
                                      "functionalized call")
        if a.kwarg_only:
            kw[a.name] = val
        else:
            args.append(val)
    out = low.fn(*args, **kw)
    nres = len(schema.returns)
    if low.mutates:
        results = tuple(out[:nres])
        news = dict(zip(low.mutates, out[nres:]))
    else:
        written = [a.name for a in mut if vals[a.name] is not None]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != len(written):
            raise RuntimeError(f"torchtpu: the lowering of {name} returned {len(outs)} values "
                               f"for {len(written)} written arguments (a torchtpu bug)")
        news = dict(zip(written, outs))
        # an in-place op returning its argument (``x.add_(y)`` style) returns the new value
        results = tuple(news[mut[0].name] for _ in range(nres)) if nres else ()
    new_bases = list(bases)
    for a in mut:
        info, new = views[a.name], news.get(a.name)
        if new is None:
            continue
        for (b, v), x in (zip(info, new) if isinstance(info, list) else [(info, new)]):
            if b is not None and x is not None:
                new_bases[b] = _write_view(new_bases[b], v, x)
    return results, new_bases


def _auto_functionalized_v2(op, _only_clone_these_bases=None, **kwargs):
    kwargs = dict(kwargs)
    bases = list(kwargs.pop("_all_bases", []))
    views = {}
    for a in _mutable_args(op._schema):
        if str(a.type).endswith("[]"):
            n = kwargs.pop(f"_{a.name}_length", None)
            views[a.name] = (None, None) if n is None else \
                [_read_view(kwargs, f"{a.name}_{i}") for i in range(n)]
        else:
            views[a.name] = _read_view(kwargs, a.name)
    results, new_bases = _run_functionalized(op, kwargs, bases, views)
    if not results:
        return (None, *new_bases)
    return (*results, *new_bases)


def _auto_functionalized(op, **kwargs):
    """v1: the written arguments are passed themselves; returns (results..., their new
    values)."""
    kwargs = dict(kwargs)
    mut = _mutable_args(op._schema)
    bases = [kwargs.pop(a.name) for a in mut]
    views = {a.name: (i, None) for i, a in enumerate(mut)}
    results, new_bases = _run_functionalized(op, kwargs, bases, views)
    if not results:
        return (None, *new_bases)
    return (*results, *new_bases)


def _register_functionalized():
    from torch._higher_order_ops import auto_functionalize as _af

    HOPS[_af.auto_functionalized_v2] = _auto_functionalized_v2
    HOPS[_af.auto_functionalized] = _auto_functionalized
