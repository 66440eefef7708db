"""Collectives as cached, jitted SPMD XLA programs over a mesh of a group's devices.

Every collective is ``jax.shard_map`` over a 1-D ``Mesh`` (axis ``"r"``) of the group's
devices, one device per rank, in group-rank order. This process's block enters the program
zero-copy (``jax.make_array_from_single_device_arrays``) and its result block leaves as the
output's one addressable shard, so only the transport (gloo in XLA:CPU, NCCL on GPU, ICI on
TPU) moves data. Blocks have at least one dimension; the callers reshape 0-dim values.

Programs are cached per (kind, mesh, static parameters); ``jax.jit`` specialises on shapes and
dtypes. Each trace is counted as ``dist_compiles`` (per kind).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..runtime import devices as _devices
from ..runtime import launches as _launches
from ..runtime import sync as _sync
from ..runtime.metrics import count

AX = "r"


class GroupMesh:
    """A group's devices (group-rank order) as a 1-D mesh; ``me``: this process's position."""

    def __init__(self, devices, me: int):
        self.devices = tuple(devices)
        self.n = len(self.devices)
        self.me = me
        self.mesh = Mesh(np.array(self.devices, dtype=object), (AX,))
        self.sharding = NamedSharding(self.mesh, P(AX))
        self.local = self.devices[me]
        self._local_list = jax.sharding.SingleDeviceSharding(self.local)._internal_device_list

    def enter(self, block):
        """The global array whose block on this process is ``block`` (no copy)."""
        shape = (block.shape[0] * self.n,) + tuple(block.shape[1:])
        # (reading the device list here first also avoids a rare jaxlib failure seen when
        # make_array_from_single_device_arrays read it first: "input arrays must have one
        # shard each" for a single-device array, on a process's first collectives)
        if block.sharding._internal_device_list != self._local_list:
            raise RuntimeError(f"tpu_dist: a collective's operand is not on this process's "
                               f"device ({block.sharding})")
        if _ArrayImpl is None:
            return jax.make_array_from_single_device_arrays(shape, self.sharding, [block])
        # what make_array_from_single_device_arrays builds, without its Python-side checks
        # (done above: one array, on this process's device; shape and dtype are ours)
        aval = _avals.get((shape, block.dtype))
        if aval is None:
            aval = _avals[(shape, block.dtype)] = _core.update_aval_with_sharding(
                _core.ShapedArray(shape, block.dtype), self.sharding)
        return _ArrayImpl(aval, self.sharding, [block], committed=True, _skip_checks=True)

    def run(self, kind: str, static: tuple, blocks) -> tuple:
        """Run program ``kind`` on this process's ``blocks``; this process's result blocks.

        Every program also takes and returns this process's order token, so programs run in
        the order they were issued: XLA:CPU runs independent programs concurrently, and two
        collectives reaching the transport in different orders on two ranks mismatch."""
        fn = _program(kind, self, static)
        last = _token.get(self.local)
        if last is None:
            gtok = self.enter(jax.device_put(np.zeros((1,), np.uint32), self.local))
        elif last[0] is self:
            gtok = last[1]  # the previous program ran on this mesh: its token as is
        else:
            gtok = self.enter(last[1].addressable_shards[0].data)
        ins = [self.enter(b) for b in blocks]
        key = (kind, static, tuple((b.shape, b.dtype) for b in blocks))
        _launches.launch(self.devices, key, lambda: (
            f"tpu_dist {kind}({', '.join(str(v) for v in static if v is not None)})",
            _launches.collectives_of(fn.lower(gtok, *ins))))
        outs = fn(gtok, *ins)
        _token[self.local] = (self, outs[0])
        return tuple(o.addressable_shards[0].data for o in outs[1:])


# this process's order token per device: (mesh, the last program's global token output),
# shared with the other programs that talk to other processes (runtime/sync.py)
_token = _sync.order_tokens
_avals: dict = {}
try:
    from jax._src import core as _core
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # another jax: the public constructor
    _ArrayImpl = None


def _platform() -> str:
    return _devices.platform()


def _unsigned(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def _bitwise(g, op):
    f = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]
    return functools.reduce(f, [g[i] for i in range(g.shape[0])])


def _reduce_stack(g, op, n):
    """Reduce a stack (n, *S) of every rank's block along axis 0, in rank order."""
    if g.dtype == jnp.bool_:
        if op in ("sum", "max", "bor"):
            return jnp.any(g, axis=0)
        if op in ("min", "product", "band"):
            return jnp.all(g, axis=0)
        return (jnp.sum(g.astype(jnp.int32), axis=0) % 2).astype(jnp.bool_)  # bxor
    if op == "sum":
        return functools.reduce(jnp.add, [g[i] for i in range(n)])
    if op == "avg":
        return (functools.reduce(jnp.add, [g[i] for i in range(n)]) / n).astype(g.dtype)
    if op == "min":
        return jnp.min(g, axis=0)
    if op == "max":
        return jnp.max(g, axis=0)
    if op == "product":
        return functools.reduce(jnp.multiply, [g[i] for i in range(n)])
    return _bitwise(g, op)


def allreduce_block(x, op, n, factor=None, ax=AX):
    """All-reduce one block over mesh axis ``ax`` of ``n`` devices (every kind of program
    uses it: these collectives and the graph lowerings of distributed/functional.py)."""
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint8)
        if op in ("sum", "max", "bor"):
            return lax.pmax(u, ax).astype(jnp.bool_)
        if op in ("min", "product", "band"):
            return lax.pmin(u, ax).astype(jnp.bool_)
        return (lax.psum(u.astype(jnp.int32), ax) % 2).astype(jnp.bool_)
    if op == "sum":
        return lax.psum(x, ax)
    if op == "avg":
        return (lax.psum(x, ax) / n).astype(x.dtype)
    if op == "premul_sum":
        return lax.psum(x * jnp.asarray(factor, x.dtype), ax)
    if op == "min":
        return lax.pmin(x, ax)
    if op == "max":
        return lax.pmax(x, ax)
    return _reduce_stack(lax.all_gather(x, ax, axis=0), op, n)  # product, bitwise


def _body(kind, n, static):
    """The per-device function of program ``kind`` (blocks in, tuple of blocks out)."""
    if kind == "allreduce":  # static: (op, factor); any number of operands (coalesced)
        op, factor = static
        return lambda *xs: tuple(allreduce_block(x, op, n, factor) for x in xs)
    if kind == "allgather":  # each operand -> the concatenation of every rank's block
        return lambda *xs: tuple(lax.all_gather(x, AX, axis=0, tiled=True) for x in xs)
    if kind == "reduce_scatter":  # static: (op, factor); operand (n*C, ...) -> (C, ...)
        op, factor = static

        def rs(x):
            if op in ("sum", "avg", "premul_sum") and x.dtype != jnp.bool_:
                if op == "premul_sum":
                    x = x * jnp.asarray(factor, x.dtype)
                if _platform() == "cpu":
                    # XLA:CPU's gloo reduce-scatter copies the input and builds gloo's
                    # halving-doubling algorithm per call: 2-3x slower than its ring
                    # all-reduce of the whole input here, so all-reduce and keep our chunk
                    c = x.shape[0] // n
                    s = lax.dynamic_slice_in_dim(lax.psum(x, AX), lax.axis_index(AX) * c, c)
                else:
                    s = lax.psum_scatter(x, AX, scatter_dimension=0, tiled=True)
                return (s / n).astype(x.dtype) if op == "avg" else s
            got = lax.all_to_all(x, AX, 0, 0, tiled=True)  # (n*C, ...): rank i's chunk i-th
            return _reduce_stack(got.reshape((n, -1) + got.shape[1:]), op, n)

        return lambda *xs: tuple(rs(x) for x in xs)
    if kind == "broadcast":  # static: (src,); exact for every value (bit patterns summed)
        (src,) = static

        def bc(x):
            u = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else \
                lax.bitcast_convert_type(x, _unsigned(x.dtype))
            u = jnp.where(lax.axis_index(AX) == src, u, jnp.zeros_like(u))
            s = lax.psum(u, AX)
            return s.astype(jnp.bool_) if x.dtype == jnp.bool_ else \
                lax.bitcast_convert_type(s, x.dtype)

        return lambda *xs: tuple(bc(x) for x in xs)
    if kind == "alltoall":  # operand (n*C, ...): chunk j goes to rank j; received in rank order
        return lambda *xs: tuple(lax.all_to_all(x, AX, 0, 0, tiled=True) for x in xs)
    raise ValueError(f"unknown collective program {kind!r}")


@functools.lru_cache(maxsize=None)
def _program(kind: str, gm: GroupMesh, static: tuple):
    inner = _body(kind, gm.n, static)

    def ordered(tok, *xs):  # the token's successor is ready only when the program finished
        return (tok + 1,) + tuple(inner(*xs))

    body = jax.shard_map(ordered, mesh=gm.mesh, in_specs=P(AX), out_specs=P(AX),
                         check_vma=False)

    def traced(*xs):
        count("dist_compiles", op=kind)  # runs once per program JAX builds
        return body(*xs)

    return jax.jit(traced)


# ---- local (this process only) helpers: packing for uneven all_to_all ----

@functools.lru_cache(maxsize=None)
def pack(splits: tuple, m: int):
    """(sum(splits), ...) -> (n*m, ...): chunk j padded to m rows."""
    def f(x):
        parts, o = [], 0
        for s in splits:
            c = x[o:o + s]
            o += s
            parts.append(jnp.pad(c, [(0, m - s)] + [(0, 0)] * (x.ndim - 1)))
        return jnp.concatenate(parts, axis=0)

    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def unpack(splits: tuple, m: int):
    """(n*m, ...) -> (sum(splits), ...): the first splits[j] rows of chunk j."""
    def f(x):
        return jnp.concatenate([x[j * m:j * m + s] for j, s in enumerate(splits)], axis=0)

    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def split_rows(sizes: tuple):
    """(sum(sizes), ...) -> the row blocks, one per size."""
    def f(x):
        out, o = [], 0
        for s in sizes:
            out.append(x[o:o + s])
            o += s
        return tuple(out)

    return jax.jit(f)


@functools.lru_cache(maxsize=None)
def concat_rows(n: int):
    return jax.jit(lambda *xs: jnp.concatenate(xs, axis=0))
