"""FlexAttention on "tpu": admit the device in FlexAttention's device allowlist.

``torch.nn.attention.flex_attention._validate_device`` raises ``ValueError`` for any device
outside a fixed set (CUDA, CPU, XPU, HPU, MPS) although nothing after it is device-specific:
eager FlexAttention runs PyTorch's math reference (``sdpa_dense``, aten ops, forward and
backward), and ``torch.compile`` hands the backend the ``flex_attention`` higher-order ops,
which the tpu compiler lowers (``lowering/flex_attention.py``). The patch wraps that one
function: for "tpu" inputs it accepts them; every other device gets PyTorch's own checks.
"""
from __future__ import annotations

import functools

from . import when_imported


def _patch(mod) -> None:
    orig = mod._validate_device
    if getattr(orig, "_torchtpu", False):
        return

    @functools.wraps(orig)
    def _validate_device(query, key, value):
        if query.device.type == "tpu":
            return None
        return orig(query, key, value)

    _validate_device._torchtpu = True
    mod._validate_device = _validate_device


def install() -> None:
    when_imported("torch.nn.attention.flex_attention", _patch)
