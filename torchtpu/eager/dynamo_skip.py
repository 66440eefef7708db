"""Keep Dynamo out of our kernels (DESIGN fact 4): C++ calls them inside compiled frames."""
from __future__ import annotations

import torch

try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    _SKIP = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
except ImportError:  # pragma: no cover - older torch
    set_code_exec_strategy = None


def skip(fn):
    """Mark ``fn``'s code object so Dynamo never traces into it; returns fn."""
    code = getattr(fn, "__code__", None)
    if set_code_exec_strategy is not None and code is not None:
        set_code_exec_strategy(code, _SKIP)
    return fn
