"""Max pooling without indices: ``torch.tpu.ops.max_pool``.

``max_pool(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False)`` pools the
last ``len(kernel_size)`` dims (1, 2 or 3; batch and channel dims in front, as
``F.max_pool1d/2d/3d``), with PyTorch's output sizes, and returns only the values:
``F.max_pool2d`` on "tpu" also computes the argmax indices its backward needs, which a forward
that is not differentiated never uses. The backward (``torch.ops.tpu.max_pool_backward``)
recomputes the window choice from the saved input, the tap PyTorch picks (first maximum, or the
NaN), so gradients equal ``F.max_pool*d``'s. No TorchTPU source was available to read; the
signature follows ``F.max_pool2d`` (the dimensionality comes from ``kernel_size``).

Custom ops ``torch.ops.tpu.max_pool`` / ``max_pool_backward``: fake kernels, autograd, lowerings
in the one table (``lowering/nn.py``: one ``reduce_window``-style max over strided slices), and
CPU kernels (``F.max_pool*d`` and its backward) for CPU tensors.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..eager import kernels as _kernels
from ..lowering import nn as _nn
from ..lowering import registry as _registry

__all__ = ["max_pool"]

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define("max_pool(Tensor x, int[] kernel_size, int[] stride=[], int[] padding=[0], "
            "int[] dilation=[1], bool ceil_mode=False) -> Tensor")
_lib.define("max_pool_backward(Tensor grad_output, Tensor x, int[] kernel_size, int[] stride, "
            "int[] padding, int[] dilation, bool ceil_mode) -> Tensor")
_ops = torch.ops.tpu


def _seq(v, n, name):
    if v is None:
        return []
    t = [int(v)] * n if isinstance(v, int) else [int(a) for a in v]
    if len(t) == 1 and n > 1:
        t = t * n
    if len(t) != n:
        raise RuntimeError(f"max_pool: {name} must be an int or {n} ints, got {v}")
    return t


def max_pool(x: torch.Tensor, kernel_size: int | Sequence[int], stride=None, padding=0,
             dilation=1, ceil_mode: bool = False) -> torch.Tensor:
    """Max pooling values (no indices) over the last ``len(kernel_size)`` dims; an int
    ``kernel_size`` pools 2 dims (``F.max_pool2d``). See the module docstring."""
    nd = 2 if isinstance(kernel_size, int) else len(kernel_size)
    k = _seq(kernel_size, nd, "kernel_size")
    return _ops.max_pool(x, k, _seq(stride, nd, "stride") if stride is not None else [],
                         _seq(padding, nd, "padding"), _seq(dilation, nd, "dilation"),
                         bool(ceil_mode))


def _full(shape, kernel_size, stride, padding, dilation):
    nd = len(kernel_size)
    if nd not in (1, 2, 3):
        raise RuntimeError(f"max_pool: expected 1, 2 or 3 pooled dims, got kernel_size "
                           f"{list(kernel_size)}")
    if len(shape) not in (nd + 1, nd + 2):
        raise RuntimeError(f"max_pool: a {nd}-d pooling expects a {nd + 1}-d or {nd + 2}-d "
                           f"input, got {len(shape)}-d (shape {list(shape)})")
    for name, v in (("stride", stride), ("padding", padding), ("dilation", dilation)):
        if len(v) not in ((0, 1, nd) if name == "stride" else (1, nd)):
            raise RuntimeError(f"max_pool: {name} must be an int or {nd} ints, got {list(v)}")
    return (list(kernel_size), list(stride) or list(kernel_size),
            _seq(padding, nd, "padding"), _seq(dilation, nd, "dilation"))


def _out_size(n, k, s, p, d, ceil_mode):
    return _nn._pool_out_size(n, k, s, p, d, ceil_mode)


def _out_shape(shape, kernel_size, stride, padding, dilation, ceil_mode):
    """The output shape, or PyTorch's error for the arguments (fake kernel, CPU kernel and
    lowering all check: eager on "tpu" traces the lowering without the fake kernel)."""
    k, s, p, d = _full(shape, kernel_size, stride, padding, dilation)
    nd = len(k)
    if any(pp > kk // 2 for kk, pp in zip(k, p)):
        raise RuntimeError("max_pool: pad should be at most half of the effective kernel "
                           f"size, got padding {p} and kernel_size {k}")
    sizes = [_out_size(shape[len(shape) - nd + j], k[j], s[j], p[j], d[j], ceil_mode)
             for j in range(nd)]
    if not all(o > 0 for o in sizes):
        raise RuntimeError(f"max_pool: the output size {sizes} is too small (input "
                           f"{list(shape)}, kernel_size {k})")
    return tuple(shape[:len(shape) - nd]) + tuple(sizes)


@torch.library.register_fake("tpu::max_pool")
def _fake(x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return x.new_empty(_out_shape(x.shape, kernel_size, stride, padding, dilation, ceil_mode))


@torch.library.register_fake("tpu::max_pool_backward")
def _fake_backward(grad_output, x, kernel_size, stride, padding, dilation, ceil_mode):
    return torch.empty_like(x)


# ---------------------------------------------------------------- CPU tensors: F.max_pool*d

_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _cpu(x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    _out_shape(x.shape, kernel_size, stride, padding, dilation, ceil_mode)
    k, s, p, d = _full(x.shape, kernel_size, stride, padding, dilation)
    return _POOL[len(k)](x, k, s, p, d, ceil_mode)


def _cpu_backward(grad_output, x, kernel_size, stride, padding, dilation, ceil_mode):
    k, s, p, d = _full(x.shape, kernel_size, stride, padding, dilation)
    with torch.enable_grad():
        xr = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(_POOL[len(k)](xr, k, s, p, d, ceil_mode), xr, grad_output)
    return g


_lib.impl("max_pool", _cpu, "CPU")
_lib.impl("max_pool_backward", _cpu_backward, "CPU")

# ---------------------------------------------------------------- tpu tensors: the table


def _low(x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    _out_shape(x.shape, kernel_size, stride, padding, dilation, ceil_mode)
    return _nn.max_pool_values(x, kernel_size, stride, padding, dilation, ceil_mode)


def _low_backward(grad_output, x, kernel_size, stride, padding, dilation, ceil_mode):
    return _nn.max_pool_grad(grad_output, x, kernel_size, stride, padding, dilation, ceil_mode)


for _op, _fn in ((_ops.max_pool.default, _low), (_ops.max_pool_backward.default, _low_backward)):
    _registry.register(_op)(_fn)
    _kernels.bind_lowering(_registry.get(_op))


# ---------------------------------------------------------------- autograd

def _setup(ctx, inputs, output):
    x, kernel_size, stride, padding, dilation, ceil_mode = inputs
    ctx.save_for_backward(x)
    ctx.args = (kernel_size, stride, padding, dilation, ceil_mode)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return (_ops.max_pool_backward(grad, x, *ctx.args),) + (None,) * 5


torch.library.register_autograd("tpu::max_pool", _backward, setup_context=_setup)
