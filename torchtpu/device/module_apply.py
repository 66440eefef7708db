"""``module.to("tpu")`` converts Parameters in place (same objects), as it does for CUDA.

``torch._has_compatible_shallow_copy_type(cpu_tensor, tpu_tensor)`` is False (PyTorch's C++
lists only CPU/CUDA/MPS/HIP/XPU/HPU/MTIA as dense backends), so ``nn.Module._apply`` would take
its "new Parameter per module" branch: tied weights (a GPT's embedding and output head) come
apart and an optimizer built before the move keeps the old CPU parameters. When a module tree
is converted onto or off "tpu", we run PyTorch's own ``_apply`` with its ``swap_tensors`` path
(``torch.__future__.set_swap_module_params_on_conversion``), which converts each Parameter
object in place. Every other conversion keeps PyTorch's behaviour untouched.
"""
from __future__ import annotations

import torch

_state = {"active": False, "orig": None}


def _crosses_tpu(module, fn) -> bool:
    """Does ``fn`` move this module's parameters onto or off "tpu"? (probes the first one)"""
    for p in module.parameters():
        with torch.no_grad():
            q = fn(p)
        return (p.device.type == "tpu") != (q.device.type == "tpu")
    return False


def _apply(self, fn, recurse=True):
    orig = _state["orig"]
    if _state["active"] or torch.__future__.get_swap_module_params_on_conversion() \
            or not _crosses_tpu(self, fn):
        return orig(self, fn, recurse)
    _state["active"] = True
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return orig(self, fn, recurse)
    except RuntimeError as e:
        if "Couldn't swap" not in str(e):
            raise
        # swap_tensors refuses a Parameter that a live autograd graph saved: convert like
        # PyTorch does without swapping (new Parameter objects, as stock PyTorch would give)
        torch.__future__.set_swap_module_params_on_conversion(False)
        return orig(self, fn, recurse)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
        _state["active"] = False


def install() -> None:
    if _state["orig"] is None:
        _state["orig"] = torch.nn.Module._apply
        torch.nn.Module._apply = _apply
