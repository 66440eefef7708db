"""Running JAX's Pallas TPU kernels in JAX's TPU interpret mode where that interpreter falls
short of Mosaic.

JAX 0.10's TPU interpreter (``pltpu.InterpretParams``) turns every kernel read and write into a
host callback over an index range of a buffer. Two things Mosaic compiles on TPU fail there,
both used by JAX's ragged paged attention kernel:

- a read through a reshaped or bitcast ref (``ref.reshape(n, d)[start::step]`` after each KV
  DMA; ``ref.bitcast(jnp.uint32)`` for packed bf16): the interpreter knows only index
  transforms (``'ReshapeTransform' object has no attribute 'indices'``);
- a masked store (``pltpu.store(ref, val, mask=...)``): its bounds check applies every
  dimension's bound to the first dimension, so an in-bounds store into a buffer whose first
  dimension is longer than a later one is reported out of bounds.

:func:`call` traces a kernel's wrapper, rewrites those equations inside the ``pallas_call``
kernel jaxprs (at any depth: loops, conditionals, scoped scratch) into equivalents the
interpreter runs -- a read of the index-only part of the ref finished by JAX's own array forms
of the reshape/bitcast; a read, a select and an unmasked store of the same range -- and
evaluates the result. It is used for interpret mode only; a TPU runs the kernel as JAX ships
it. The rewrite changes no arithmetic of the kernel (the same values reach the same
operations), so the kernel's numerics are what the interpreter tests; where nothing needs
rewriting (a later JAX, another kernel) the kernel runs untouched.
"""

from __future__ import annotations

import contextlib
import functools

import jax
from jax import lax
from jax._src import api_util
from jax._src import core
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe
from jax._src.pallas import primitives as pallas_primitives
from jax._src.state import indexing as state_indexing
from jax._src.state import primitives as state_primitives
from jax._src.state import discharge as state_discharge

__all__ = ["call", "rewrite_for_interpreter"]


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the kernel jaxprs of its ``pallas_call``\\ s rewritten (see
    the module docstring); ``fn`` must be traced under the interpret-mode setting already."""
    closed, shapes = jax.make_jaxpr(functools.partial(fn, **kwargs), return_shape=True)(*args)
    out = core.eval_jaxpr(rewrite_for_interpreter(closed.jaxpr), closed.consts,
                          *jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shapes), out)


def _sub_jaxprs(params):
    for name, value in params.items():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for i, item in enumerate(items):
            if isinstance(item, (core.Jaxpr, core.ClosedJaxpr)):
                yield name, i, isinstance(value, (tuple, list)), item


def _indexes(transform) -> bool:
    return isinstance(transform, state_indexing.NDIndexer)


def _beyond_indexing(transforms) -> bool:
    """Whether a transform other than indexing (a reshape or a bitcast) is in ``transforms``:
    the interpreter turns transforms into index ranges and knows no other kind."""
    return not all(_indexes(t) for t in transforms)


def _rule(eqn):
    """How ``eqn`` must be rewritten for the interpreter (None: it runs as it is)."""
    if eqn.primitive is state_primitives.get_p:
        if _beyond_indexing(jax.tree.unflatten(eqn.params["tree"], eqn.invars[1:])):
            return _transformed_read
    elif eqn.primitive is state_primitives.swap_p:
        if _beyond_indexing(jax.tree.unflatten(eqn.params["tree"], eqn.invars[2:])):
            raise NotImplementedError("a write through a reshaped or bitcast ref in interpret mode")
    elif eqn.primitive is pallas_primitives.swap_p:
        _, transforms, _, mask = jax.tree.unflatten(eqn.params["args_tree"], eqn.invars)
        if _beyond_indexing(transforms):
            raise NotImplementedError("a masked write through a reshaped or bitcast ref in "
                                      "interpret mode")
        if mask is not None:
            return _masked_swap
    return None


def _needs_rewrite(jaxpr: core.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if _rule(eqn) is not None:
            return True
        for _, _, _, sub in _sub_jaxprs(eqn.params):
            if _needs_rewrite(sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub):
                return True
    return False


def rewrite_for_interpreter(jaxpr: core.Jaxpr) -> core.Jaxpr:
    """``jaxpr`` with the equations the interpreter cannot run rewritten (module docstring);
    ``jaxpr`` itself where there are none."""
    if not _needs_rewrite(jaxpr):
        return jaxpr
    avals = [v.aval for v in jaxpr.constvars] + [v.aval for v in jaxpr.invars]
    n_consts = len(jaxpr.constvars)

    def run(*vals):
        return _eval(jaxpr, vals[:n_consts], vals[n_consts:])

    debug = api_util.debug_info("pallas interpret rewrite", run, tuple(avals), {})
    new, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(run, debug_info=debug), avals)
    if consts:
        raise NotImplementedError("the rewritten kernel captured constants")
    if n_consts:  # give the constants back their place
        new = new.replace(constvars=new.invars[:n_consts], invars=new.invars[n_consts:])
    return new


def _rewrite_sub(sub):
    if isinstance(sub, core.ClosedJaxpr):
        new = rewrite_for_interpreter(sub.jaxpr)
        return sub if new is sub.jaxpr else core.ClosedJaxpr(new, sub.consts)
    return rewrite_for_interpreter(sub)


def _eval(jaxpr: core.Jaxpr, consts, args):
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        rule = _rule(eqn)
        if rule is not None:
            out = rule(eqn.params, invals)
        else:
            params = dict(eqn.params)
            grid = eqn.params.get("grid_mapping")  # a kernel traces in its grid's environment
            for name, i, is_seq, sub in _sub_jaxprs(eqn.params):
                with grid.trace_env() if grid is not None else contextlib.nullcontext():
                    new = _rewrite_sub(sub)
                if new is not sub:
                    if is_seq:
                        seq = list(params[name])
                        seq[i] = new
                        params[name] = type(eqn.params[name])(seq)
                    else:
                        params[name] = new
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, out):
                env[v] = x
        else:
            env[eqn.outvars[0]] = out
    return [read(v) for v in jaxpr.outvars]


def _masked_swap(params, invals):
    """A masked store as a read, a select and an unmasked store of the same range (the
    interpreter's bounds check of masked stores applies every dimension's bound to the
    first); a range out of bounds still raises, in the read."""
    ref, transforms, val, mask = jax.tree.unflatten(params["args_tree"], invals)
    leaves, tree = jax.tree.flatten(tuple(transforms))
    old = state_primitives.get_p.bind(ref, *leaves, tree=tree)
    state_primitives.swap_p.bind(ref, lax.select(mask, val, old), *leaves, tree=tree)
    return lax.select(mask, old, val)


def _transformed_read(params, invals):
    """A read through reshapes or bitcasts as a read of the index-only prefix of the ref,
    finished by the same transforms applied to the array (JAX's own array forms of them)."""
    ref, transforms = invals[0], jax.tree.unflatten(params["tree"], invals[1:])
    first = next(i for i, t in enumerate(transforms) if not _indexes(t))
    leaves, tree = jax.tree.flatten(tuple(transforms[:first]))
    value = state_primitives.get_p.bind(ref, *leaves, tree=tree)
    return state_discharge.transform_array(value, transforms[first:])
