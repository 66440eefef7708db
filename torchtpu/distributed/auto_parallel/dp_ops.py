"""Autograd functions over the data-parallel group that keep the applied module's calling
convention (every rank gets the global batch's outputs): each rank's gradient is dp times its
share of the one-process gradient, which FSDP's (or the replicated parameters' hooks') average
over dp turns into exactly the one-process gradient."""
from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n, rank):
        ctx.n, ctx.rank = n, rank
        out = x.new_empty((x.shape[0] * n,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.n)[ctx.rank] * ctx.n, None, None, None


class _MeanScalar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out / n

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _SumScalar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n):
        ctx.n = n
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g * ctx.n, None, None
