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


def get(hop):
    """The lowering of a higher-order op, or None."""
    if not HOPS:
        from . import flex_attention  # noqa: F401  (fills HOPS)
    return HOPS.get(hop)


def _plain(x):
    if type(x) is tuple or isinstance(x, list):
        return type(x)(_plain(e) for e in x) if type(x) is tuple else [_plain(e) for e in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def torch_to_np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's value as a numpy array (bfloat16 through ml_dtypes)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def constant(v):
    """A graph constant (``get_attr``) as a jax value: tpu tensors by their array."""
    if isinstance(v, torch.Tensor):
        if v.device.type == "tpu":
            from ..eager.copy import value_of

            return value_of(v)
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
    if low is None or low.random or dyn or low.reads_layout or low.mutates:
        why = "has no lowering" if low is None else "is random, data-dependent or writes its input"
        raise NotImplementedError(
            f"Could not run '{_name(target)}' inside a score_mod/mask_mod subgraph compiled for "
            f"the 'tpu' backend: it {why} (subgraphs run on the device only)")
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
