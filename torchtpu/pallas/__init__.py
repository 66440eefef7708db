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
- compiled graphs (``torch.compile(backend="tpu")``): the op is an entry of the lowering table,
  so ``fn`` is traced inline into the graph's XLA program (no CPU fallback, no graph break:
  the returned callable holds no JAX code Dynamo would have to trace).

Keyword options (TorchTPU's):

- ``donate_argnums``: positions of the arguments ``fn`` overwrites: an in-place kernel. ``fn``
  returns exactly their new values (in ``donate_argnums`` order); the op writes them into
  those tensors in place and returns None. Their device buffers are donated to XLA (eagerly,
  and in compiled graphs where the tensor is a graph input), so updating a large buffer (a KV
  cache) costs what ``fn`` writes, not a copy. Not differentiable. (A mutable custom op's
  outputs cannot be a list that PyTorch's functionalization accepts, so such a kernel returns
  nothing else; compute other results with a second op.)
- ``mesh``, ``in_specs``, ``out_specs``: run ``fn`` under ``jax.shard_map`` over ``mesh`` with
  these partition specs (a kernel written per shard).
- ``fake``: ``fake(*tensors)`` gives the outputs' shapes and dtypes (FakeTensors / meta) instead
  of ``jax.eval_shape(fn)`` (for ``fn`` whose tracing is expensive or needs concrete values).
"""
import functools as _functools

import jax as _jax
import jax.numpy as _jnp
import numpy as _np
import torch as _torch

from ..eager.dynamo_skip import skip as _skip
from ..runtime.dtypes import to_jax as _to_jax
from ..runtime.dtypes import to_torch as _to_torch

__all__ = ["NAMESPACE", "jax_op"]

NAMESPACE = "tpu_jax"
_lib = _torch.library.Library(NAMESPACE, "FRAGMENT")
_ops: dict = {}


def _specs(tensors):
    return [_jax.ShapeDtypeStruct(tuple(t.shape), _to_jax(t.dtype)) for t in tensors]


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
        cpu = _jax.devices("cpu")[0]
        vals = [_jax.device_put(_np.asarray(_np_of(t)), cpu) for t in tensors]
        outs = _as_tuple(jitted(*vals))
        return [_copy.device_to_host(o) for o in outs]
    raise RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{', '.join(sorted(devs))}!")


def _np_of(t):
    from ..eager import copy as _copy

    t = t.detach().contiguous()
    if t.dtype == _torch.bfloat16:
        import ml_dtypes

        return t.view(_torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _fake(fn_specs, tensors):
    outs = _as_tuple(_jax.eval_shape(fn_specs, *_specs(tensors)))
    dev = tensors[0].device if tensors else _torch.device("tpu")
    return [_torch.empty(o.shape, dtype=_to_torch(o.dtype), device=dev) for o in outs]


def _split(n, donate):
    """(positions of donated arguments, of the others) among ``n``."""
    donate = tuple(d % n if n else d for d in donate)
    return donate, tuple(i for i in range(n) if i not in donate)


def _merge(donated, rest, donate):
    """The arguments in ``fn``'s order from the donated ones and the rest."""
    out = [None] * (len(donated) + len(rest))
    for i, t in zip(donate, donated):
        out[i] = t
    it = iter(rest)
    for i in range(len(out)):
        if out[i] is None:
            out[i] = next(it)
    return out


def jax_op(name: str, fn=None, *, donate_argnums=(), mesh=None, in_specs=None,
           out_specs=None, fake=None):
    """Register JAX function ``fn`` as torch op ``tpu_jax::<name>``; returns the callable.

    Usable as ``jax_op("name", fn, ...)`` or as a decorator ``@jax_op("name", ...)``. See the
    module docstring for the keyword options.
    """
    if fn is None:
        return lambda f: jax_op(name, f, donate_argnums=donate_argnums, mesh=mesh,
                                in_specs=in_specs, out_specs=out_specs, fake=fake)
    if name in _ops:
        raise RuntimeError(f"jax_op: an op named {name!r} is already registered")
    if mesh is not None:
        from jax import shard_map

        fn = shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    donate_argnums = tuple(donate_argnums)
    if donate_argnums:
        return _jax_op_donating(name, fn, donate_argnums, fake)
    qual = f"{NAMESPACE}::{name}"
    qual_vjp = f"{NAMESPACE}::{name}_vjp"
    _lib.define(f"{name}(Tensor[] args) -> Tensor[]")
    _lib.define(f"{name}_vjp(Tensor[] args, Tensor[] cotangents) -> Tensor[]")
    fwd = _jax.jit(fn)
    single = [None]  # does fn return one array? (set by the kernels, which see the result)

    def note(outs):
        if single[0] is None:
            single[0] = not isinstance(outs, (tuple, list))
        return outs

    def vjp_fn(n_args, *vals):
        primals, cts = vals[:n_args], vals[n_args:]
        out, pullback = _jax.vjp(fn, *primals)
        outs = _as_tuple(out)
        cts = tuple(c.astype(o.dtype) for c, o in zip(cts, outs))
        grads = pullback(cts if isinstance(out, (tuple, list)) else cts[0])
        return tuple(_jnp.zeros(p.shape, p.dtype) if g is None or g.dtype == _jax.dtypes.float0
                     else g for g, p in zip(grads, primals))

    @_functools.lru_cache(maxsize=None)
    def bwd_jitted(n_args):
        return _jax.jit(_functools.partial(vjp_fn, n_args))

    @_skip
    def impl(args):
        return _run(lambda *a: note(fwd(*a)), list(args))

    @_skip
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

    def fake_kernel(args):
        args = list(args)
        if fake is not None:
            outs = fake(*args)
            note(outs)
            return list(_as_tuple(outs))
        note(_jax.eval_shape(fn, *_specs(args)))
        return _fake(fn, args)

    _torch.library.register_fake(qual)(fake_kernel)
    _torch.library.register_fake(qual_vjp)(
        lambda args, cts: [_torch.empty_like(a) for a in args])

    op = getattr(getattr(_torch.ops, NAMESPACE), name).default
    op_vjp = getattr(getattr(_torch.ops, NAMESPACE), f"{name}_vjp").default
    # the lowering table: graphs compiled for "tpu" trace fn inline
    _register_lowering(op, lambda args: list(_as_tuple(fn(*args))))
    _register_lowering(op_vjp, lambda args, cts: list(
        vjp_fn(len(args), *args, *cts)))

    def setup_context(ctx, inputs, output):
        (args,) = inputs
        ctx.save_for_backward(*args)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output]

    def backward(ctx, grads):
        args = list(ctx.saved_tensors)
        cts = [g if g is not None else _torch.zeros(s, dtype=d, device=v)
               for g, (s, d, v) in zip(grads, ctx.out_meta)]
        res = op_vjp(args, cts)
        return ([r if a.is_floating_point() or a.is_complex() else None
                 for r, a in zip(res, args)],)

    _torch.library.register_autograd(qual, backward, setup_context=setup_context)

    def call(*tensors):
        outs = op(list(tensors))
        return outs[0] if single[0] else tuple(outs)

    call.__name__ = name
    call.__doc__ = fn.__doc__
    call.op = op
    _ops[name] = call
    return call


_BASE_REFS: list = []


def _sole_holder(buf) -> bool:
    """Whether ``buf`` is the only holder of its array (two storages may share one immutable
    array; donating it would delete the other's data)."""
    import sys

    from ..runtime import buffer as _buffer

    if not _BASE_REFS:
        b = _buffer.Buffer(_jnp.zeros(()))
        _BASE_REFS.append(sys.getrefcount(b.array))
    return sys.getrefcount(buf.array) <= _BASE_REFS[0]


def _register_lowering(op, fn, mutates=()):
    from ..lowering import registry

    registry.register(op, mutates=mutates)(fn)


def _jax_op_donating(name, fn, donate, fake):
    """``jax_op`` with ``donate_argnums``: ``tpu_jax::<name>(Tensor(a!) d0, Tensor(b!) d1, ...,
    Tensor[] args) -> ()`` writes ``fn``'s outputs into the donated tensors (one schema argument
    each: PyTorch's functionalization refuses a mutable ``Tensor[]``'s op returning a list).
    ``fake`` is unused: the op returns nothing."""
    qual = f"{NAMESPACE}::{name}"
    nd = len(donate)
    if nd > 26:
        raise ValueError("jax_op: at most 26 donated arguments")
    names = [f"d{i}" for i in range(nd)]
    decl = ", ".join(f"Tensor({chr(97 + i)}!) {n}" for i, n in enumerate(names))
    _lib.define(f"{name}({decl}, Tensor[] args) -> ()")
    cache: dict = {}

    def jitted(n):
        if n not in cache:
            pos, _ = _split(n, donate)
            cache[n] = _jax.jit(lambda *a: _checked(fn(*a)), donate_argnums=pos)
        return cache[n]

    def _checked(out):
        outs = _as_tuple(out)
        if len(outs) != nd:
            raise RuntimeError(
                f"jax_op {name!r} with donate_argnums={donate}: fn must return exactly the new "
                f"values of the {nd} donated argument(s), got {len(outs)} outputs")
        return outs

    @_skip
    def impl(*a):
        from ..eager import copy as _copy
        from ..runtime import buffer as _buffer

        donated, args = list(a[:nd]), list(a[nd])
        every = _merge(donated, args, donate)
        n = len(every)
        pos, _ = _split(n, donate)
        if any(t.device.type != "tpu" for t in every):
            # CPU tensors: JAX's CPU backend, written back with copy_
            outs = list(_run(_jax.jit(lambda *a: _checked(fn(*a))), every))
            for t, new in zip(donated, outs):
                t.copy_(new)
        else:
            vals = []
            for i, t in enumerate(every):
                if i not in pos:
                    vals.append(_copy.value_of(t))
                    continue
                buf = _buffer.buffer_of(t)
                if _sole_holder(buf) and isinstance(buf.array, _jax.Array) \
                        and t.is_contiguous() and t.storage_offset() == 0 \
                        and tuple(buf.array.shape) == tuple(t.shape) \
                        and buf.array.dtype == _to_jax(t.dtype):
                    vals.append(buf.array)  # nobody else's array: XLA may reuse it in place
                else:  # a view, or an array another storage shares: donate a copy
                    vals.append(_jnp.array(_copy.value_of(t), copy=True))
            outs = jitted(n)(*vals)
            del vals
            for t, new in zip(donated, outs):
                _copy.assign(t, new)
        return None

    for key in ("PrivateUse1", "CPU"):
        _lib.impl(name, impl, key)

    def fake_kernel(*a):
        return None

    _torch.library.register_fake(qual)(fake_kernel)
    op = getattr(getattr(_torch.ops, NAMESPACE), name).default

    def lowering(*a):
        outs = _checked(fn(*_merge(list(a[:nd]), list(a[nd]), donate)))
        return outs[0] if nd == 1 else tuple(outs)

    # registered on the mutable op: it returns the new values of the arguments it writes
    # (lowering/hops.py writes them back; a compiled graph donates the inputs' buffers)
    _register_lowering(op, lowering)

    def call(*tensors):
        pos, rest = _split(len(tensors), donate)
        op(*[tensors[i] for i in pos], [tensors[i] for i in rest])

    call.__name__ = name
    call.__doc__ = fn.__doc__
    call.op = op
    _ops[name] = call
    return call
