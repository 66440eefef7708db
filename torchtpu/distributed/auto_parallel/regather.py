"""Sequence parallelism's block inputs saved sharded, gathered again in backward (Megatron's).

With TorchTitan's SP each TP block gathers its input over the tp mesh (``PrepareModuleInput``:
``Shard(1)`` -> ``Replicate()``) and its colwise layers save that gathered tensor for their
weight gradients: every tp rank keeps the whole sequence of every block's input until
backward. Megatron's sequence parallelism saves the all-gather's *input* instead and runs the
gather again in backward. Here that is done without touching the model's code: while a block's
forward runs, ``torch.autograd.graph.saved_tensors_hooks`` pack every saved tensor that lives
in the gathered input's storage (the colwise layers' 2-D views of it) as the rank's own
sequence slice plus the view's geometry, and unpack it in backward by gathering the slices
over the tp mesh into a tensor of the gathered one's size and strides (the same values: an
all-gather is exact) and taking the same view. Everything else autograd saves is untouched.
Each gather in backward counts ``auto_parallel_regathers`` in ``torch.tpu.metrics()``. Eager
only (the hooks are entered and left by module hooks); under ``torch.compile`` they step aside
and the gathered inputs are saved as TorchTitan's SP saves them.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...runtime.metrics import count


class _Source:
    """One forward call's block input: the rank's slice, the gathered tensor's geometry, and
    in backward the tensor gathered again (once for every saved view of it)."""
    __slots__ = ("shard", "size", "stride", "gathered")

    def __init__(self, shard, full):
        self.shard = shard  # the rank's sequence slice (what the block received)
        self.size, self.stride = full.shape, full.stride()
        self.gathered = None


class _Packed:
    __slots__ = ("src", "view", "dtensor")

    def __init__(self, src, view, dtensor):
        self.src = src
        self.view = view  # (size, stride, storage offset) of the saved view of it
        self.dtensor = dtensor  # (mesh, placements, shape, stride) of a saved DTensor, or None


class _BlockState:
    def __init__(self, act, mesh):
        self.act = act  # positional index or keyword name of the stream argument
        self.mesh = mesh
        self.shard = None
        self.full = None
        self.src = None
        self.ctx = None

    def _arg(self, args, kwargs):
        if isinstance(self.act, int):
            return args[self.act] if self.act < len(args) else None
        return kwargs.get(self.act)

    def before_prepare(self, mod, args, kwargs):
        from torch.distributed.tensor import DTensor

        x = self._arg(args, kwargs)
        self.shard = x._local_tensor if isinstance(x, DTensor) else x

    def after_prepare(self, mod, args, kwargs):
        from torch.distributed.tensor import DTensor

        if torch.compiler.is_compiling():  # compiled: AOTAutograd saves what it partitions
            self.shard = None
            return

        g = self._arg(args, kwargs)
        full = g._local_tensor if isinstance(g, DTensor) else g
        ok = (isinstance(full, torch.Tensor) and isinstance(self.shard, torch.Tensor)
              and full.dim() >= 2 and full.storage_offset() == 0
              and full.untyped_storage().nbytes() == full.numel() * full.element_size()
              and full.shape[1] == self.shard.shape[1] * self.mesh.size())
        if not ok:  # not the layout this was made for: save as PyTorch does
            self.shard = None
            return
        self.full = full
        self.src = _Source(self.shard, full)
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.ctx.__enter__()

    def after_forward(self, mod, args, kwargs, out):
        if self.ctx is not None:
            ctx, self.ctx = self.ctx, None
            ctx.__exit__(None, None, None)
        self.shard = self.full = self.src = None

    def pack(self, t):
        from torch.distributed.tensor import DTensor

        loc = t._local_tensor if isinstance(t, DTensor) else t
        full = self.full
        if full is None or loc.untyped_storage().data_ptr() != \
                full.untyped_storage().data_ptr() or loc.dtype != full.dtype:
            return t
        dt = (t.device_mesh, t.placements, t.shape, t.stride()) \
            if isinstance(t, DTensor) else None
        return _Packed(self.src, (loc.shape, loc.stride(), loc.storage_offset()), dt)

    def unpack(self, p):
        if not isinstance(p, _Packed):
            return p
        from torch.distributed.tensor import DTensor, Replicate, Shard

        src = p.src
        with torch.no_grad():
            if src.gathered is None:
                count("auto_parallel_regathers")  # one all-gather of a block input in backward
                # SP needs the sequence divisible by tp: even slices, the global shape inferred
                g = DTensor.from_local(src.shard, self.mesh, [Shard(1)],
                                       run_check=False).redistribute(self.mesh, [Replicate()])
                base = torch.empty_strided(src.size, src.stride, dtype=src.shard.dtype,
                                           device=src.shard.device)
                base.copy_(g.to_local())
                # kept while a saved view of it is still to be used (the _Packed hold src)
                src.gathered = base
            loc = src.gathered.as_strided(*p.view)
            if p.dtensor is None:
                return loc
            mesh, placements, shape, st = p.dtensor
            return DTensor.from_local(loc, mesh, placements, run_check=False, shape=shape,
                                      stride=st)


def install(model: nn.Module, blocks: dict, mesh) -> int:
    """Save the inputs of the modules ``blocks`` names ({fqn: stream argument}) sharded on the
    sequence of the tp ``mesh``; call after ``parallelize_module`` (the first hook runs before
    its ``PrepareModuleInput``, the second after it). Returns how many blocks."""
    mods = dict(model.named_modules())
    for fqn, act in blocks.items():
        mod = mods[fqn]
        st = _BlockState(act, mesh)
        mod.register_forward_pre_hook(st.before_prepare, with_kwargs=True, prepend=True)
        mod.register_forward_pre_hook(st.after_prepare, with_kwargs=True)
        mod.register_forward_hook(st.after_forward, with_kwargs=True, always_call=True)
    return len(blocks)
