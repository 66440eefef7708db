"""Loss parallelism for a model that computes its own cross-entropy (HF's ``labels=``).

The head is colwise with its logits left a DTensor sharded on the vocabulary
(``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``): whatever the model does
with them runs through DTensor's sharding propagation (HF's ``.float()`` and ``.view(-1, V)``
keep the vocabulary sharded), and while the applied module's forward runs, a torch function
mode hands ``F.cross_entropy`` on such a DTensor to PyTorch's own
``torch.distributed.tensor.parallel.loss_parallel``: a log-softmax and NLL over the local
vocabulary slice with all-reduces of the max, the sum of exponentials and the target's logit.
PyTorch requires the backward to run under that context too; here it does without the user's
loop knowing: the loss is computed on a detached alias of the logits inside an
``autograd.Function`` whose backward re-enters ``loss_parallel()`` for the inner graph (the
pattern activation checkpointing uses). At the module's output every DTensor is made a plain
tensor again: replicated ones (the loss) are their local value, sharded ones (the logits) are
gathered, so the outputs equal one process's.

For a loss the user computes outside the model (``auto_parallelize(..., loss_fn=...)``,
TorchTitan's ``loss_fn(pred, labels)``) the logits leave the module as that DTensor (on a
``dp x tp`` mesh ``(Shard(0), Shard(-1))``: the batch stays split over dp, the calling
convention's gather skips them) and ``Plan.loss(loss_fn)`` runs the user's loss under the same
kind of mode: per dp rank PyTorch's ``loss_parallel`` on its batch slice over the tp mesh, then
the scalar averaged (``mean``) or summed (``sum``) over dp. With ``dp == 1`` the logits are a
DTensor on the one-dimensional tp mesh, which PyTorch's own
``torch.distributed.tensor.parallel.loss_parallel()`` context also takes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree


def _vocab_sharded(x) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor) and x.dim() >= 1 and any(
        p.is_shard(1 if x.dim() > 1 else 0) for p in x.placements)


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad():
            x = logits.detach().requires_grad_(logits.requires_grad)
            with loss_parallel():
                loss = F.cross_entropy(x, target, **kwargs)
        ctx.x, ctx.loss = x, loss
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor.parallel import loss_parallel

        if not ctx.x.requires_grad:
            return None, None, None
        with loss_parallel():
            (gx,) = torch.autograd.grad(ctx.loss, ctx.x, grad)
        ctx.x = ctx.loss = None
        return gx, None, None


class _Mode(torch.overrides.TorchFunctionMode):
    """``F.cross_entropy`` on vocabulary-sharded DTensor logits -> loss parallel."""

    def _parallel(self, x, target, kwargs):
        return _ParallelCrossEntropy.apply(x, target, kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.cross_entropy:
            x = args[0] if args else kwargs.pop("input")
            target = args[1] if len(args) > 1 else kwargs.pop("target")
            for i, name in enumerate(("weight", "size_average", "ignore_index", "reduce",
                                      "reduction", "label_smoothing")):
                if len(args) > 2 + i:
                    kwargs[name] = args[2 + i]
            if _vocab_sharded(x):
                return self._parallel(x, target, kwargs)
            return func(x, target, **kwargs)
        return func(*args, **kwargs)


def _plain(t):
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if all(p.is_replicate() for p in t.placements):
        return t.to_local()
    return t.full_tensor()


def install(model: nn.Module, outside: bool = False) -> None:
    """The loss-parallel mode around ``model``'s forward and plain outputs after it (a hook
    that always runs, so a failing forward leaves no mode behind); ``outside``: the loss is
    the user's, vocabulary-sharded outputs (the logits) stay DTensors."""
    state = {}

    def enter(mod, args, kwargs):
        state.setdefault("modes", []).append(_Mode())
        state["modes"][-1].__enter__()

    def leave(mod, args, kwargs, out):
        modes = state.get("modes")
        if modes:
            modes.pop().__exit__(None, None, None)
        return pytree.tree_map(lambda t: t if outside and _vocab_sharded_out(t) else _plain(t),
                               out)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def _vocab_sharded_out(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and t.dim() >= 1 and any(
        p.is_shard(t.dim() - 1) for p in t.placements)


class _OutsideMode(_Mode):
    """``_Mode`` for the user's loss on the applied module's logits: on a ``dp x tp`` mesh
    each dp rank computes the loss of its batch slice over the tp mesh, then the ranks' scalars
    are combined over dp the way the calling convention's gradients expect (each rank's
    gradient is dp times its share; FSDP's average over dp makes it the one-process one)."""

    def _parallel(self, x, target, kwargs):
        from torch.distributed.tensor import DTensor, Shard

        from .dp_ops import _GatherBatch, _MeanScalar, _SumScalar

        mesh = x.device_mesh
        if mesh.ndim == 1:
            return _plain(_ParallelCrossEntropy.apply(x, target, kwargs))
        names = mesh.mesh_dim_names
        dp_dim = next(i for i, p in enumerate(x.placements) if p.is_shard(0))
        tp_dim = 1 - dp_dim
        if mesh.ndim != 2 or not x.placements[tp_dim].is_shard(1):
            raise NotImplementedError(f"Plan.loss: cross_entropy on logits placed "
                                      f"{x.placements} on a {mesh.ndim}-D mesh is not supported")
        dp, rank = mesh.size(dp_dim), mesh.get_local_rank(dp_dim)
        group = mesh.get_group(dp_dim)
        local = DTensor.from_local(x.to_local(), mesh[names[tp_dim]], [Shard(1)],
                                   run_check=False)
        if isinstance(target, DTensor):
            target = target.full_tensor()
        if target.shape[0] != x.shape[0]:
            raise ValueError(f"Plan.loss: cross_entropy's target has {target.shape[0]} rows, "
                             f"its input {x.shape[0]}")
        red = kwargs.get("reduction", "mean")
        mine = target.chunk(dp)[rank]
        if red == "mean" and not mine.is_floating_point():
            # one process's mean divides by the whole batch's count of counted targets
            # (ignore_index ones excluded, each weighted by its class weight): the slices'
            # sums over that total, not the mean of the slices' means (those differ when
            # the slices count different numbers of targets)
            loss = _plain(_ParallelCrossEntropy.apply(local, mine,
                                                      dict(kwargs, reduction="sum")))
            total = _counted(mine, kwargs).to(loss.dtype)
            dist.all_reduce(total, group=group)
            return _SumScalar.apply(loss, group, dp) / total
        loss = _plain(_ParallelCrossEntropy.apply(local, mine, kwargs))
        if red == "mean":  # probability targets: every row counts, the slices are equal
            return _MeanScalar.apply(loss, group, dp)
        if red == "sum":
            return _SumScalar.apply(loss, group, dp)
        return _GatherBatch.apply(loss, group, dp, rank)


def _counted(target, kwargs):
    """What ``F.cross_entropy``'s mean divides by for class-index ``target``: the number of
    targets other than ``ignore_index``, or with a class ``weight`` the sum of their weights."""
    valid = target != kwargs.get("ignore_index", -100)
    weight = kwargs.get("weight")
    if weight is None:
        return valid.sum()
    w = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    return (w[torch.where(valid, target, 0)] * valid).sum()


def outside_loss(loss_fn):
    """``loss_fn`` run under ``_OutsideMode`` (``Plan.loss``)."""

    def run(*args, **kwargs):
        with _OutsideMode():
            return loss_fn(*args, **kwargs)

    return run
