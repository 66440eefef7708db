"""Point-to-point ops usable inside compiled graphs: ``torch.tpu.ops.send`` / ``recv``.

``send(x, dst, group=None) -> token`` sends ``x`` to group rank ``dst``; ``recv(buffer, src,
group=None) -> Tensor`` returns what group rank ``src`` sent, shaped and typed as ``buffer``
(whose values are not read). They are ``dist.send`` / ``dist.recv`` as functional ops: no
TorchTPU source was available to read, so the signatures follow ``torch.distributed`` (the
peer is a rank of ``group``). ``send`` returns a token: a tensor of at most one element
(``x``'s dtype, zero), which nothing needs to use.

Custom ops ``torch.ops.tpu.send`` / ``recv`` with fake kernels, registered as effectful
(ordered, never dropped by graph passes: Dynamo and AOTAutograd thread them on an effect
token). Eager (Strict, Fused, CPU tensors over gloo): ``dist.send`` / ``dist.recv`` on the
group. In a compiled graph: the lowering ``distributed/tpu_ops.py`` registers, a
``lax.ppermute`` from the sender to the receiver in each rank's program (the two ranks run
different programs, MPMD; their transfers must come in the same order on both, as with NCCL's
blocking send/recv).

Differentiable, with the pairing of pipeline stages: ``recv``'s backward sends the gradient of
its result back to ``src``; ``send``'s backward receives the gradient of ``x`` from ``dst``.
The sender runs it by back-propagating through the token (``token.backward()``, or a loss
that includes ``token.sum()``, which is zero). The buffer of ``recv`` gets no gradient; its
result requires grad when the buffer does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import group_name as _group_name

__all__ = ["send", "recv"]

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define("send(Tensor x, int dst, str group_name) -> Tensor")
_lib.define("recv(Tensor buffer, int src, str group_name) -> Tensor")
_ops = torch.ops.tpu


def send(x: torch.Tensor, dst: int, group=None) -> torch.Tensor:
    """Send ``x`` to group rank ``dst``; returns a token (at most one element, zero)."""
    return _ops.send(x, dst, _group_name(group))


def recv(buffer: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """The tensor group rank ``src`` sent (``buffer``'s shape and dtype)."""
    return _ops.recv(buffer, src, _group_name(group))


@torch.library.register_fake("tpu::send")
def _send_fake(x, dst, group_name):
    return x.new_empty((min(x.numel(), 1),))


@torch.library.register_fake("tpu::recv")
def _recv_fake(buffer, src, group_name):
    return torch.empty_like(buffer)


def _pg(group_name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _send_eager(x, dst, group_name):
    dist.send(x.contiguous(), group=_pg(group_name), group_dst=dst)
    return x.new_zeros((min(x.numel(), 1),))


def _recv_eager(buffer, src, group_name):
    out = torch.empty_like(buffer, memory_format=torch.contiguous_format)
    dist.recv(out, group=_pg(group_name), group_src=src)
    return out


def _send_setup(ctx, inputs, output):
    x, dst, group_name = inputs
    ctx.peer, ctx.group_name = dst, group_name
    ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device


def _send_backward(ctx, grad_token):
    # the gradient of what was sent comes back from the receiver (its recv's backward)
    buf = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
    return _ops.recv(buf, ctx.peer, ctx.group_name), None, None


def _recv_setup(ctx, inputs, output):
    ctx.peer, ctx.group_name = inputs[1], inputs[2]


def _recv_backward(ctx, grad):
    # the received value's gradient goes back to its sender (its send's backward); the
    # buffer's values were never read: no gradient
    _ops.send(grad.contiguous(), ctx.peer, ctx.group_name)
    return None, None, None


_lib.impl("send", _send_eager, "CompositeExplicitAutograd")
_lib.impl("recv", _recv_eager, "CompositeExplicitAutograd")
for _name in ("send", "recv"):
    torch.library._register_effectful_op(f"tpu::{_name}",
                                         torch._library.effects.EffectType.ORDERED, lib=_lib)
torch.library.register_autograd("tpu::send", _send_backward, setup_context=_send_setup,
                                lib=_lib)
torch.library.register_autograd("tpu::recv", _recv_backward, setup_context=_recv_setup,
                                lib=_lib)
