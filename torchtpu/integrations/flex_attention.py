"""FlexAttention on "tpu": the device allowlist, and the HOPs' eager implementation.

``torch.nn.attention.flex_attention._validate_device`` raises ``ValueError`` for any device
outside a fixed set (CUDA, CPU, XPU, HPU, MPS) although nothing after it is device-specific.
The patch wraps that one function: for "tpu" inputs it accepts them; every other device gets
PyTorch's own checks.

Eager FlexAttention runs the ``flex_attention`` higher-order op on real tensors, whose default
below autograd is PyTorch's dense math reference (the L x S scores as aten ops). The HOP and
its backward get PrivateUse1 implementations (``HigherOrderOperator.py_impl``: only tensors
on "tpu" reach them) that call the ``tpu::flex_attention`` ops of ``ops/flex_attention.py``,
whose lowering is the compiled graphs' (``lowering/flex_attention.py``: blockwise and
block-sparse). ``torch.compile`` graphs carry the HOPs and lower them directly.
"""
from __future__ import annotations

import functools

from .hooks import patch, when_imported


def _validate(orig):
    @functools.wraps(orig)
    def _validate_device(query, key, value):
        if query.device.type == "tpu":
            return None
        return orig(query, key, value)

    return _validate_device


def _patch(mod) -> None:
    patch(mod, "_validate_device", _validate, params=("query", "key", "value"))


def _hop_impls(mod) -> None:
    from torch._C import DispatchKey

    if DispatchKey.PrivateUse1 in mod.flex_attention.py_kernels:
        return
    from ..ops import flex_attention as ops

    mod.flex_attention.py_impl(DispatchKey.PrivateUse1)(ops.hop_forward)
    mod.flex_attention_backward.py_impl(DispatchKey.PrivateUse1)(ops.hop_backward)


def install() -> None:
    when_imported("torch.nn.attention.flex_attention", _patch)
    when_imported("torch._higher_order_ops.flex_attention", _hop_impls)
