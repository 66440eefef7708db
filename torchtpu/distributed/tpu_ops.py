"""Lowerings of ``torch.tpu.ops``' collectives (``ops/collectives.py``) for compiled graphs.

Pure JAX over the group's named mesh axis, bound by the ``shard_map`` that ``compile/spmd.py``
wraps around a graph; each lowering's ``meta["mesh"]`` names the group as the functional
collectives' do (``functional.py``), so a graph may mix these ops with those. Eager runs the
ops' definitions (``ops/collectives.py``), which reach tpu_dist's programs through the
functional collectives' kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..lowering import registry
from ..ops import collectives as _ops_collectives  # noqa: F401  (defines torch.ops.tpu.*)
from ..ops import p2p as _ops_p2p  # noqa: F401
from .functional import _axis, _mesh_fact, _op, _scatter


def _all_gather_dim(x, dim, group_name):
    ax, n = _axis(group_name)
    return x if n == 1 else lax.all_gather(x, ax, axis=dim % x.ndim, tiled=True)


def _reduce_scatter_dim(x, dim, reduce_op, group_name):
    ax, n = _axis(group_name)
    if n == 1:
        return x
    # dim's n slices stacked along dim 0: the dim-0 scatter leaves this rank's slice
    flat = jnp.concatenate(jnp.split(x, n, axis=dim % x.ndim), 0)
    return _scatter(flat, _op(reduce_op), ax, n)


def _ragged_all_to_all(input, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                       group_name):
    ax, n = _axis(group_name)
    if n > 1 and jax.default_backend() in ("tpu", "gpu", "cuda", "rocm"):
        return lax.ragged_all_to_all(input, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=ax)
    # XLA:CPU has no ragged-all-to-all: every peer's chunk padded to the input's rows, one
    # even all_to_all for the data and one for the receivers' offsets, then a masked scatter
    rows = input.shape[0]
    r = jnp.arange(rows)
    src = input_offsets[:, None].astype(jnp.int32) + r[None, :]  # [n, rows]
    keep = r[None, :] < send_sizes[:, None]
    chunks = jnp.take(input, jnp.clip(src, 0, rows - 1).reshape(-1), axis=0)
    chunks = chunks.reshape((n, rows) + input.shape[1:])
    chunks = jnp.where(keep.reshape(keep.shape + (1,) * (input.ndim - 1)), chunks,
                       jnp.zeros((), input.dtype))
    where = output_offsets
    if n > 1:
        chunks = lax.all_to_all(chunks, ax, 0, 0, tiled=True)
        where = lax.all_to_all(output_offsets.reshape(n, 1), ax, 0, 0, tiled=True).reshape(n)
    dst = where[:, None].astype(jnp.int32) + r[None, :]
    valid = r[None, :] < recv_sizes[:, None]
    dst = jnp.where(valid, dst, output.shape[0]).reshape(-1)  # out of range: dropped
    return output.at[dst].set(chunks.reshape((n * rows,) + input.shape[1:]), mode="drop")


def _peer(group_name, peer, what):
    from .functional import group_of

    pg = group_of(group_name)
    me = pg.rank()
    if not 0 <= peer < pg.size() or peer == me:
        raise ValueError(f"tpu {what}: invalid peer rank {peer} for rank {me} of a group of "
                         f"size {pg.size()}")
    return me


def _send(x, dst, group_name):
    ax, _ = _axis(group_name)
    me = _peer(group_name, dst, "send")
    moved = lax.ppermute(x, ax, [(me, dst)])
    # the token is a slice of the transfer's result (zeros here: this rank receives nothing),
    # so XLA keeps the transfer (an optimization barrier's unused operand, or a zero-size
    # token, it drops); the executor returns effectful ops' results from the program even
    # when the graph drops them (lower.py)
    return moved.reshape(-1)[:1]


def _recv(buffer, src, group_name):
    ax, _ = _axis(group_name)
    me = _peer(group_name, src, "recv")
    # the buffer is an operand (its values go nowhere: this rank sends nothing), so the
    # transfer waits for what the buffer waits for (the effect token's order, lower.py)
    return lax.ppermute(buffer, ax, [(src, me)])


_LOWERINGS = [("all_gather_dim", _all_gather_dim), ("reduce_scatter_dim", _reduce_scatter_dim),
              ("ragged_all_to_all", _ragged_all_to_all), ("send", _send), ("recv", _recv)]


def install() -> None:
    import torch

    for name, fn in _LOWERINGS:
        op = getattr(torch.ops.tpu, name).default
        if registry.get(op) is None:
            registry.register(op, graph_only=True)(fn)
            registry.LOWERINGS[op].meta["mesh"] = ("group_name", _mesh_fact)
