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
"""
from __future__ import annotations

import torch
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
                return _ParallelCrossEntropy.apply(x, target, kwargs)
            return func(x, target, **kwargs)
        return func(*args, **kwargs)


def _plain(t):
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if all(p.is_replicate() for p in t.placements):
        return t.to_local()
    return t.full_tensor()


def install(model: nn.Module) -> None:
    """The loss-parallel mode around ``model``'s forward and plain outputs after it (a hook
    that always runs, so a failing forward leaves no mode behind)."""
    state = {}

    def enter(mod, args, kwargs):
        state.setdefault("modes", []).append(_Mode())
        state["modes"][-1].__enter__()

    def leave(mod, args, kwargs, out):
        modes = state.get("modes")
        if modes:
            modes.pop().__exit__(None, None, None)
        return pytree.tree_map(_plain, out)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)
