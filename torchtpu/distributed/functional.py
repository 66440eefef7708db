"""Functional collectives (``torch.ops._c10d_functional``) on "tpu": eager kernels and lowerings.

Eager: PrivateUse1 kernels resolve the group name to its ``ProcessGroupTPU`` and run the
group's cached SPMD program (``collectives.py``) on the operands' arrays; the result is a new
tpu tensor holding the program's (asynchronous) output, so ``wait_tensor`` has nothing to wait
for: later ops are ordered by the data dependency, as on one CUDA stream.

Compiled graphs: lowerings for the same ops, pure JAX functions using ``lax.psum`` /
``all_gather`` / ``all_to_all`` over a named mesh axis. They bind that axis only inside the
``shard_map`` the compile executor wraps around a graph; each lowering's ``meta["mesh"]`` tells
the executor which axis over which devices (the group's, in group-rank order) and this
process's position in it (see ``compile/spmd.py``). Groups of one process need no mesh: their
collectives are identities.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.distributed as dist
from jax import lax

from ..lowering import registry
from .collectives import _reduce_stack, allreduce_block

_c10d = torch.ops._c10d_functional
_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


# ---- groups ----

def group_of(group_name):
    """The ``ProcessGroupTPU`` named ``group_name`` (a name or a ProcessGroup)."""
    from .process_group import ProcessGroupTPU

    pg = group_name
    if not isinstance(pg, dist.ProcessGroup):
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(group_name)
    if not isinstance(pg, ProcessGroupTPU):
        try:
            pg = pg._get_backend(torch.device("tpu"))
        except Exception:  # noqa: BLE001
            pass
    if not isinstance(pg, ProcessGroupTPU):
        raise RuntimeError(f"tpu functional collectives: group {group_name!r} is not a "
                           f"'tpu_dist' process group ({type(pg).__name__})")
    return pg


def axis_of(pg) -> str:
    """The mesh axis name of a group: one name per set of global ranks."""
    return "tpu_dist:" + ",".join(str(r) for r in pg._global_ranks)


def _op(reduce_op: str) -> str:
    op = str(reduce_op).lower()
    if op not in _OPS:
        raise ValueError(f"tpu functional collectives: unsupported reduce op {reduce_op!r}")
    return op


# ---- eager kernels ----

def _new(shape, dtype, like):
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _run(pg, coll, kind, static, inputs, outputs, sig=()):
    """Run program ``kind`` on ``inputs``' blocks; write ``outputs`` (same order)."""
    def run():
        outs = pg._gm.run(kind, static, pg._blocks(inputs))
        return list(zip(outputs, outs))

    pg._collective(coll, inputs, outputs, run, sig)


def _check_dtype(pg, op, tensors, coll):
    from .process_group import _check_op_dtype

    for t in tensors:
        _check_op_dtype(op, t.dtype, coll)


def _all_reduce_into(inputs, outputs, reduce_op, group_name, coll):
    pg = group_of(group_name)
    op = _op(reduce_op)
    _check_dtype(pg, op, inputs, coll)
    _run(pg, coll, "allreduce", (op, None), inputs, outputs, (op,))
    return outputs


def all_reduce(input, reduce_op, group_name):
    return _all_reduce_into([input], [_new(input.shape, input.dtype, input)], reduce_op,
                            group_name, "all_reduce")[0]


def all_reduce_(input, reduce_op, group_name):
    return _all_reduce_into([input], [input], reduce_op, group_name, "all_reduce")[0]


def all_reduce_coalesced(inputs, reduce_op, group_name):
    outs = [_new(t.shape, t.dtype, t) for t in inputs]
    return _all_reduce_into(list(inputs), outs, reduce_op, group_name, "all_reduce_coalesced")


def all_reduce_coalesced_(inputs, reduce_op, group_name):
    return _all_reduce_into(list(inputs), list(inputs), reduce_op, group_name,
                            "all_reduce_coalesced")


def _gathered_shape(t, n):
    return (n * t.shape[0],) + tuple(t.shape[1:]) if t.dim() else (n,)


def _check_size(pg, group_size, coll):
    if group_size != pg.size():
        raise RuntimeError(f"tpu_dist {coll}: group_size {group_size} does not match the "
                           f"group's size {pg.size()}")


def _gather_into(inputs, outputs, group_size, group_name, coll):
    pg = group_of(group_name)
    _check_size(pg, group_size, coll)
    pg._gather_into(outputs, list(inputs), coll)
    return outputs


def all_gather_into_tensor(input, group_size, group_name):
    out = _new(_gathered_shape(input, group_size), input.dtype, input)
    return _gather_into([input], [out], group_size, group_name, "all_gather_into_tensor")[0]


def all_gather_into_tensor_out(input, group_size, group_name, *, out):
    return _gather_into([input], [out], group_size, group_name, "all_gather_into_tensor")[0]


def all_gather_into_tensor_coalesced(inputs, group_size, group_name):
    outs = [_new(_gathered_shape(t, group_size), t.dtype, t) for t in inputs]
    return _gather_into(inputs, outs, group_size, group_name,
                        "all_gather_into_tensor_coalesced")


def _scattered_shape(t, n, coll):
    if t.dim() == 0 or t.shape[0] % n:
        raise RuntimeError(f"tpu_dist {coll}: input's first dimension must be divisible by the "
                           f"group size {n}, got shape {tuple(t.shape)}")
    return (t.shape[0] // n,) + tuple(t.shape[1:])


def _scatter_from(inputs, reduce_op, group_size, group_name, coll):
    pg = group_of(group_name)
    _check_size(pg, group_size, coll)
    op = _op(reduce_op)
    _check_dtype(pg, op, inputs, coll)
    outs = [_new(_scattered_shape(t, group_size, coll), t.dtype, t) for t in inputs]
    _run(pg, coll, "reduce_scatter", (op, None), list(inputs), outs, (op,))
    return outs


def reduce_scatter_tensor(input, reduce_op, group_size, group_name):
    return _scatter_from([input], reduce_op, group_size, group_name, "reduce_scatter_tensor")[0]


def reduce_scatter_tensor_coalesced(inputs, reduce_op, group_size, group_name):
    return _scatter_from(inputs, reduce_op, group_size, group_name,
                         "reduce_scatter_tensor_coalesced")


def all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):
    pg = group_of(group_name)
    outs = [int(s) for s in output_split_sizes]
    shape = ((sum(outs),) + tuple(input.shape[1:])) if outs else tuple(input.shape)
    out = _new(shape, input.dtype, input)
    pg.alltoall_base(out, input, outs, [int(s) for s in input_split_sizes])
    return out


def _broadcast_into(input, out, src, group_name):
    pg = group_of(group_name)
    _run(pg, "broadcast", "broadcast", (int(src),), [input], [out], (int(src),))
    return out


def broadcast(input, src, group_name):
    return _broadcast_into(input, _new(input.shape, input.dtype, input), src, group_name)


def broadcast_(input, src, group_name):
    return _broadcast_into(input, input, src, group_name)


def wait_tensor(tensor):
    """The collective's result is already the tensor's (asynchronous) value."""
    return tensor


_EAGER = {"all_reduce": all_reduce, "all_reduce_": all_reduce_,
          "all_reduce_coalesced": all_reduce_coalesced,
          "all_reduce_coalesced_": all_reduce_coalesced_,
          "all_gather_into_tensor": all_gather_into_tensor,
          "all_gather_into_tensor_out": all_gather_into_tensor_out,
          "all_gather_into_tensor_coalesced": all_gather_into_tensor_coalesced,
          "reduce_scatter_tensor": reduce_scatter_tensor,
          "reduce_scatter_tensor_coalesced": reduce_scatter_tensor_coalesced,
          "all_to_all_single": all_to_all_single, "broadcast": broadcast,
          "broadcast_": broadcast_, "wait_tensor": wait_tensor}
_libs: list = []


def _install_kernels() -> None:
    from ..eager.dynamo_skip import skip

    lib = torch.library.Library("_c10d_functional", "IMPL")
    for name, fn in _EAGER.items():
        if hasattr(_c10d, name):
            lib.impl(name, skip(fn), "PrivateUse1")
    _libs.append(lib)


# ---- lowerings (pure JAX; the mesh axis is bound by the executor's shard_map) ----

def _mesh_fact(group_name):
    """``meta["mesh"]``: (axis name, devices in group-rank order, this process's position),
    or None for a group of one process (its collectives are identities)."""
    pg = group_of(group_name)
    if pg.size() == 1:
        return None
    return axis_of(pg), pg._gm.devices, pg.rank()


def _axis(group_name):
    pg = group_of(group_name)
    return (axis_of(pg) if pg.size() > 1 else None), pg.size()


def _psum_like(x, op, ax, n):
    return x if n == 1 else allreduce_block(x, op, n, ax=ax)


def _low_all_reduce(x, reduce_op, group_name):
    ax, n = _axis(group_name)
    return _psum_like(x, _op(reduce_op), ax, n)


def _low_all_reduce_coalesced(xs, reduce_op, group_name):
    ax, n = _axis(group_name)
    return [_psum_like(x, _op(reduce_op), ax, n) for x in xs]


def _gather(x, ax, n):
    x = x.reshape((1,)) if x.ndim == 0 else x
    return x if n == 1 else lax.all_gather(x, ax, axis=0, tiled=True)


def _low_all_gather(x, group_size, group_name):
    ax, n = _axis(group_name)
    return _gather(x, ax, n)


def _low_all_gather_coalesced(xs, group_size, group_name):
    ax, n = _axis(group_name)
    return [_gather(x, ax, n) for x in xs]


def _scatter(x, op, ax, n):
    if n == 1:
        return x
    if op in ("sum", "avg") and x.dtype != jnp.bool_:
        c = x.shape[0] // n
        s = lax.dynamic_slice_in_dim(lax.psum(x, ax), lax.axis_index(ax) * c, c) \
            if jax.default_backend() == "cpu" else \
            lax.psum_scatter(x, ax, scatter_dimension=0, tiled=True)
        return (s / n).astype(x.dtype) if op == "avg" else s
    got = lax.all_to_all(x, ax, 0, 0, tiled=True)
    return _reduce_stack(got.reshape((n, -1) + got.shape[1:]), op, n)


def _low_reduce_scatter(x, reduce_op, group_size, group_name):
    ax, n = _axis(group_name)
    return _scatter(x, _op(reduce_op), ax, n)


def _low_reduce_scatter_coalesced(xs, reduce_op, group_size, group_name):
    ax, n = _axis(group_name)
    return [_scatter(x, _op(reduce_op), ax, n) for x in xs]


def _low_all_to_all(x, output_split_sizes, input_split_sizes, group_name):
    ax, n = _axis(group_name)
    outs = [int(s) for s in output_split_sizes]
    ins = [int(s) for s in input_split_sizes]
    rows = x.shape[0]
    if not ins:
        ins = [rows // n] * n
    if not outs:
        outs = [rows // n] * n
    if n == 1:
        return x
    if len(set(ins)) == 1 and len(set(outs)) == 1 and ins[0] == outs[0]:
        return lax.all_to_all(x, ax, 0, 0, tiled=True)
    if sorted(ins)[-2:] == [0, rows] and sorted(outs)[-2:] == [0, rows]:
        # a permutation (permute_tensor): this rank sends all of x to one rank and receives
        # one rank's x; the peers' sizes are not known here, so gather and keep the source's
        return lax.all_gather(x, ax, axis=0, tiled=False)[outs.index(rows)]
    raise NotImplementedError(
        "tpu compiled all_to_all_single: uneven split sizes are not supported inside a "
        "compiled graph (the program cannot know the other ranks' sizes); run it in eager")


def _low_broadcast(x, src, group_name):
    ax, n = _axis(group_name)
    if n == 1:
        return x
    u = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else \
        lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                     8: jnp.uint64}[jnp.dtype(x.dtype).itemsize])
    u = jnp.where(lax.axis_index(ax) == int(src), u, jnp.zeros_like(u))
    s = lax.psum(u, ax)
    return s.astype(jnp.bool_) if x.dtype == jnp.bool_ else lax.bitcast_convert_type(s, x.dtype)


def _low_wait(x):
    return x


_LOWERINGS = [
    (_c10d.all_reduce.default, _low_all_reduce),
    (_c10d.all_reduce_coalesced.default, _low_all_reduce_coalesced),
    (_c10d.all_gather_into_tensor.default, _low_all_gather),
    (_c10d.all_gather_into_tensor_coalesced.default, _low_all_gather_coalesced),
    (_c10d.reduce_scatter_tensor.default, _low_reduce_scatter),
    (_c10d.reduce_scatter_tensor_coalesced.default, _low_reduce_scatter_coalesced),
    (_c10d.all_to_all_single.default, _low_all_to_all),
    (_c10d.broadcast.default, _low_broadcast),
]


def _install_lowerings() -> None:
    for op, fn in _LOWERINGS:
        registry.register(op, graph_only=True)(fn)
        registry.LOWERINGS[op].meta["mesh"] = ("group_name", _mesh_fact)
    registry.register(_c10d.wait_tensor.default, graph_only=True)(_low_wait)


def install() -> None:
    """Eager kernels and graph lowerings of the ``_c10d_functional`` ops (once)."""
    if _libs:
        return
    _install_kernels()
    _install_lowerings()


