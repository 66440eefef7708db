"""JAX (or Pallas) functions as torch custom ops: ``torch.tpu.pallas.jax_op(name, fn)``.

``fn`` is a pure JAX function of arrays returning an array or a tuple of arrays (a Pallas
``pallas_call`` is one). ``jax_op`` registers it as the torch op ``torch.ops.tpu_jax.<name>``
and returns a callable taking tensors::

    def jax_add_sin(x, y):
        return jnp.sin(x) + y

    add_sin = torch.tpu.pallas.jax_op("add_sin", jax_add_sin)
    z = add_sin(a, b)          # a, b on "tpu": runs fn jitted on their device arrays

- tpu tensors: ``fn`` runs under ``jax.jit`` on the tensors' arrays (no copies).
- CPU tensors: the same function runs on JAX's CPU backend (handy for references and tests).
- FakeTensor/meta: output shapes and dtypes come from ``jax.eval_shape`` (torch.compile works).
- autograd: the backward is ``jax.vjp`` of ``fn`` (another op, ``<name>_vjp``), so the op is
  differentiable whenever ``fn`` is; integer inputs get no gradient. A bare ``pallas_call`` is
  not differentiable in JAX: wrap it in ``jax.custom_vjp`` (the backward then says so clearly
  otherwise).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..eager.dynamo_skip import skip
from ..runtime.dtypes import to_jax, to_torch

NAMESPACE = "tpu_jax"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_ops: dict = {}


def _specs(tensors):
    return [jax.ShapeDtypeStruct(tuple(t.shape), to_jax(t.dtype)) for t in tensors]


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _run(jitted, tensors):
    """Run a jitted JAX function on tensors (all tpu, or all CPU); returns tensors."""
    from ..eager import copy as _copy
    from ..runtime import buffer as _buffer

    devs = {t.device.type for t in tensors}
    if devs == {"tpu"} or not tensors:
        idx = {t.device.index or 0 for t in tensors}
        if len(idx) > 1:
            raise RuntimeError("Expected all tensors to be on the same device, but found "
                               f"tpu devices {sorted(idx)}")
        outs = _as_tuple(jitted(*[_copy.value_of(t) for t in tensors]))
        return [_buffer.wrap(o) for o in outs]
    if devs == {"cpu"}:
        cpu = jax.devices("cpu")[0]
        vals = [jax.device_put(np.asarray(_np_of(t)), cpu) for t in tensors]
        outs = _as_tuple(jitted(*vals))
        return [_copy.device_to_host(o) for o in outs]
    raise RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{', '.join(sorted(devs))}!")


def _np_of(t):
    from ..eager import copy as _copy

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _fake(fn_specs, tensors):
    outs = _as_tuple(jax.eval_shape(fn_specs, *_specs(tensors)))
    dev = tensors[0].device if tensors else torch.device("tpu")
    return [torch.empty(o.shape, dtype=to_torch(o.dtype), device=dev) for o in outs]


def jax_op(name: str, fn=None):
    """Register JAX function ``fn`` as torch op ``tpu_jax::<name>``; returns the callable.

    Usable as ``jax_op("name", fn)`` or as a decorator ``@jax_op("name")``.
    """
    if fn is None:
        return lambda f: jax_op(name, f)
    if name in _ops:
        raise RuntimeError(f"jax_op: an op named {name!r} is already registered")
    qual = f"{NAMESPACE}::{name}"
    qual_vjp = f"{NAMESPACE}::{name}_vjp"
    _lib.define(f"{name}(Tensor[] args) -> Tensor[]")
    _lib.define(f"{name}_vjp(Tensor[] args, Tensor[] cotangents) -> Tensor[]")
    fwd = jax.jit(fn)

    def vjp_fn(n_args, *vals):
        primals, cts = vals[:n_args], vals[n_args:]
        out, pullback = jax.vjp(fn, *primals)
        outs = _as_tuple(out)
        cts = tuple(c.astype(o.dtype) for c, o in zip(cts, outs))
        grads = pullback(cts if isinstance(out, (tuple, list)) else cts[0])
        return tuple(jnp.zeros(p.shape, p.dtype) if g is None or g.dtype == jax.dtypes.float0
                     else g for g, p in zip(grads, primals))

    @functools.lru_cache(maxsize=None)
    def bwd_jitted(n_args):
        return jax.jit(functools.partial(vjp_fn, n_args))

    @skip
    def impl(args):
        return _run(fwd, list(args))

    @skip
    def impl_vjp(args, cotangents):
        args = list(args)
        try:
            return _run(bwd_jitted(len(args)), args + list(cotangents))
        except (ValueError, TypeError, NotImplementedError) as e:
            raise RuntimeError(
                f"jax_op {name!r}: JAX cannot differentiate this function ({e}). A "
                "pallas_call needs a jax.custom_vjp around it to be differentiable.") from e

    for key in ("PrivateUse1", "CPU"):
        _lib.impl(name, impl, key)
        _lib.impl(f"{name}_vjp", impl_vjp, key)

    torch.library.register_fake(qual)(lambda args: _fake(fn, list(args)))
    torch.library.register_fake(qual_vjp)(
        lambda args, cts: [torch.empty_like(a) for a in args])

    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    op_vjp = getattr(getattr(torch.ops, NAMESPACE), f"{name}_vjp").default

    def setup_context(ctx, inputs, output):
        (args,) = inputs
        ctx.save_for_backward(*args)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output]

    def backward(ctx, grads):
        args = list(ctx.saved_tensors)
        cts = [g if g is not None else torch.zeros(s, dtype=d, device=v)
               for g, (s, d, v) in zip(grads, ctx.out_meta)]
        res = op_vjp(args, cts)
        return ([r if a.is_floating_point() or a.is_complex() else None
                 for r, a in zip(res, args)],)

    torch.library.register_autograd(qual, backward, setup_context=setup_context)

    single = [None]

    def call(*tensors):
        outs = op(list(tensors))
        if single[0] is None:
            single[0] = not isinstance(jax.eval_shape(fn, *_specs(tensors)), (tuple, list))
        return outs[0] if single[0] else tuple(outs)

    call.__name__ = name
    call.__doc__ = fn.__doc__
    call.op = op
    _ops[name] = call
    return call
