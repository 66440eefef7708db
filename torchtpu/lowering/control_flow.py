"""``torch.cond``, ``torch.while_loop``, ``scan`` and ``map`` in graphs compiled with
``torch.compile(backend="tpu")``.

Dynamo turns them into the higher-order ops ``cond(pred, true_fn, false_fn, operands)``,
``while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)``, ``scan(combine_fn, init,
xs, additional_inputs)`` (``torch._higher_order_ops.scan``: the carry and the per-step outputs,
over dim 0 of every ``xs``; its backward is a scan too) and ``map_impl(f, xs, pos_args)``
(``torch._higher_order_ops.map``), and ``invoke_subgraph(subgraph, identifier, *operands)``
(``torch.compiler.nested_compile_region``), whose functions are subgraphs. They lower to XLA's own
control flow, ``lax.cond``, ``lax.while_loop``, ``lax.scan`` and ``lax.map``, with each
subgraph evaluated through the op table (``hops.run_subgraph``): the branch not taken costs
nothing at run time, as on CUDA, where only the taken branch's kernels launch, and a scan's body
is traced once whatever its length. (Eager ``torch.cond`` needs no lowering: PyTorch reads the
predicate and calls one function; eager scan and map run PyTorch's own loop over tpu ops.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from .hops import register_hop, run_subgraph

_hop = torch.ops.higher_order


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _branch(gm):
    return lambda ops: _tuple(run_subgraph(gm, *ops))


@register_hop(_hop.cond)
def cond(pred, true_fn, false_fn, operands):
    operands = tuple(operands)
    if isinstance(pred, (bool, int)):  # a predicate known when tracing: one branch
        return _tuple(run_subgraph(true_fn if pred else false_fn, *operands))
    pred = jnp.asarray(pred).reshape(()).astype(bool)
    return jax.lax.cond(pred, _branch(true_fn), _branch(false_fn), operands)


@register_hop(_hop.while_loop)
def while_loop(cond_fn, body_fn, carried_inputs, additional_inputs):
    carried, extra = tuple(carried_inputs), tuple(additional_inputs)

    def keep_going(c):
        p = run_subgraph(cond_fn, *c, *extra)
        p = p[0] if isinstance(p, (tuple, list)) else p
        return jnp.asarray(p).reshape(()).astype(bool)

    def body(c):
        # the body's results take the carried values' dtypes (Python scalars come back weak)
        out = _tuple(run_subgraph(body_fn, *c, *extra))
        return tuple(jnp.asarray(o, dtype=jnp.asarray(v).dtype) for o, v in zip(out, c))

    carried = tuple(jnp.asarray(v) for v in carried)
    return jax.lax.while_loop(keep_going, body, carried)


@register_hop(_hop.scan)
def scan(combine_fn, init, xs, additional_inputs):
    init, xs, extra = tuple(jnp.asarray(v) for v in init), tuple(xs), tuple(additional_inputs)
    n = len(init)
    if not xs:  # nothing to scan over: PyTorch returns the carry as it came
        return init

    def step(carry, x):
        out = _tuple(run_subgraph(combine_fn, *carry, *x, *extra))
        # the next carry keeps the carry's dtypes (Python scalars come back weak)
        nxt = tuple(jnp.asarray(o, dtype=c.dtype) for o, c in zip(out[:n], carry))
        return nxt, tuple(jnp.asarray(o) for o in out[n:])

    carry, ys = jax.lax.scan(step, init, xs)
    return (*carry, *ys)


@register_hop(_hop.map_impl)
def map_impl(f, xs, pos_args):
    extra = tuple(pos_args)
    return _tuple(jax.lax.map(
        lambda x: tuple(jnp.asarray(o) for o in _tuple(run_subgraph(f, *x, *extra))), tuple(xs)))


@register_hop(_hop.invoke_subgraph)
def invoke_subgraph(subgraph, identifier, *operands):
    # ``torch.compiler.nested_compile_region``: a region Dynamo traced once and calls from each
    # use (forward, and its backward's region); XLA inlines each call of the subgraph
    gm = getattr(subgraph, "subgraph", subgraph)  # a FunctionalizeCtxWrapper holds the module
    return _tuple(run_subgraph(gm, *operands))
