"""Graphs that hold collectives: one SPMD program over the collectives' mesh.

A lowering whose registry entry carries ``meta["mesh"] = (argument name, fact)`` needs a mesh
axis: ``fact(argument value)`` returns (axis name, devices, this process's position) or None
(a group of one process). ``GraphLowering`` collects these facts; a graph with one is compiled
as ``shard_map`` over a 1-D ``Mesh`` of those devices with that axis name, so the collective
lowerings (``lax.psum`` ... over the axis) sit in the same XLA program as the compute. Every
process runs the same program on its own data: each input enters as this process's block of a
global array (its first dimension concatenated across processes; a 0-dim value as one row), and
each output leaves as this process's block. The program also takes and returns this device's
order token (``runtime/sync.py``), so it reaches the transport in issue order with every other
collective program.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..runtime import launches as _launches
from ..runtime import sync as _sync


class SPMD:
    """The mesh of one graph and the wrappers that enter and leave it."""

    def __init__(self, axis, devices, me: int):
        self.axis = axis
        self.devices = tuple(devices)
        self.n = len(self.devices)
        self.me = me
        self.local = self.devices[me]
        self.mesh = Mesh(np.array(self.devices, dtype=object), (axis,))
        self.sharding = NamedSharding(self.mesh, P(axis))
        self.out_shapes = None  # local output shapes (a flat list), set by the trace

    def _global_shape(self, shape):
        shape = tuple(shape)
        return (self.n * shape[0],) + shape[1:] if shape else (self.n,)

    def shapes(self, locals_):
        """Global ShapeDtypeStructs for local (shape, dtype) pairs, plus the token's."""
        return [jax.ShapeDtypeStruct((self.n,), np.uint32, sharding=self.sharding)] + [
            jax.ShapeDtypeStruct(self._global_shape(s), d, sharding=self.sharding)
            for s, d in locals_]

    def wrap(self, fn, local_shapes):
        """``fn`` (local arrays -> pytree of local arrays) as a function of global arrays."""
        scalar_in = [len(s) == 0 for s in local_shapes]

        def body(tok, *blocks):
            xs = [b.reshape(()) if z else b for b, z in zip(blocks, scalar_in)]
            out = fn(*xs)
            leaves, tree = jax.tree_util.tree_flatten(out)
            leaves = [jnp.asarray(v) for v in leaves]
            self.out_shapes = [v.shape for v in leaves]
            leaves = [v.reshape((1,)) if v.ndim == 0 else v for v in leaves]
            return tok + 1, jax.tree_util.tree_unflatten(tree, leaves)

        return jax.shard_map(body, mesh=self.mesh, in_specs=P(self.axis),
                             out_specs=P(self.axis), check_vma=False)

    def enter(self, a):
        if isinstance(a, np.ndarray) or not isinstance(a, jax.Array):
            a = jax.device_put(a, self.local)
        elif a.sharding.device_set != {self.local}:
            raise RuntimeError(f"torchtpu.compile: an input of a graph with collectives is not "
                               f"on this process's device ({a.sharding})")
        if a.ndim == 0:
            a = a.reshape((1,))
        return jax.make_array_from_single_device_arrays(
            self._global_shape(a.shape), self.sharding, [a])

    def program(self, compiled, lowered=None, name="compiled_spmd"):
        """The compiled program as a function of this process's local arrays. Its first
        launch lists its collectives (from ``lowered``) for the MPMD check
        (``runtime/launches.py``)."""
        spmd = self
        first = [lowered]
        ident = object()  # this program, for the launch record

        def describe():
            return name, _launches.collectives_of(first[0])

        def call(*flat):
            _launches.launch(spmd.devices, ident, describe)
            first[0] = None  # checked: the lowered module is no longer needed
            last = _sync.order_tokens.get(spmd.local)
            if last is None:
                tok = spmd.enter(np.zeros((1,), np.uint32))
            elif last[0] is spmd.mesh:
                tok = last[1]
            else:
                tok = spmd.enter(last[1].addressable_shards[0].data)
            try:
                tok, out = compiled(tok, *[spmd.enter(a) for a in flat])
            except Exception as e:  # noqa: BLE001
                if _launches.aborted is not None:  # the MPMD check ended the transport
                    raise _launches.Aborted(f"{name} was aborted: {_launches.aborted}") from e
                raise
            _sync.order_tokens[spmd.local] = (spmd.mesh, tok)
            leaves, tree = jax.tree_util.tree_flatten(out)
            res = []
            for v, shape in zip(leaves, spmd.out_shapes):
                v = v.addressable_shards[0].data
                res.append(v.reshape(()) if len(shape) == 0 else v)
            return jax.tree_util.tree_unflatten(tree, res)

        return call
