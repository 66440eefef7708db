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

from . import patch, when_imported


def _validate(orig):
    @functools.wraps(orig)
    def _validate_device(query, key, value):
        if query.device.type == "tpu":
            return None
        return orig(query, key, value)

    return _validate_device


def _patch(mod) -> None:
    patch(mod, "_validate_device", _validate, params=("query", "key", "value"))


def install() -> None:
    when_imported("torch.nn.attention.flex_attention", _patch)
