"""Kernels of ops that update several tensors (or lists of tensors) in place, which the
table's kernel kinds cannot express: composed of tpu ops, so they run in Strict, record in
Fused, never sync with the host and never fall back to the CPU.

- GradScaler's two ops (the gradients and ``found_inf``; the scale and the growth tracker),
  following CUDA's kernels (``AmpKernels.cu``).
- ``torch.optim.Adam/AdamW/SGD/Adagrad(fused=True)``'s in-place ops: the in-place lowering
  (``lowering/optim.py``, flag ``writes``) computes every new value in one program that writes
  them into the parameters' and states' storages, donating the old arrays (the update costs
  one copy of the parameters less: CUDA's budget). When a written tensor shares its storage
  with another tensor of the op (views of one flat buffer), the functional op computes every
  new value and ``_foreach_copy_`` writes each changed list back (the storage-group machinery
  of eager/executor.py keeps that exact).
"""
from __future__ import annotations

import torch

from ..lowering import registry
from . import executor


def non_finite_check_and_unscale_(grads, found_inf, inv_scale) -> None:
    """``found_inf`` becomes 1 if any gradient has an inf or nan (it is never reset to 0);
    every gradient is multiplied by ``inv_scale``."""
    if not grads:
        return
    # the largest magnitude of each (still scaled) gradient: inf or nan when any element is
    peaks = torch._foreach_norm(grads, float("inf"))
    bad = torch.stack(peaks).isfinite().all().logical_not()
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype)))
    torch._foreach_mul_(grads, inv_scale)


def update_scale_(scale, growth_tracker, found_inf, growth_factor: float, backoff_factor: float,
                  growth_interval: int):
    """After an inf/nan step the scale backs off and the tracker resets; after
    ``growth_interval`` clean steps in a row it grows (if the grown scale is finite)."""
    found = found_inf > 0
    successful = growth_tracker + 1
    grown = scale * growth_factor
    grow = found.logical_not() & (successful == growth_interval)
    new_scale = torch.where(found, scale * backoff_factor,
                            torch.where(grow & grown.isfinite(), grown, scale))
    scale.copy_(new_scale)
    growth_tracker.copy_(torch.where(found | grow, torch.zeros_like(successful), successful))
    return scale


def fused_optimizer_(functional, inplace=None):
    """The in-place kernel of a fused optimizer op: its in-place lowering (one program, old
    arrays donated) unless a written tensor shares a storage, else composed of its functional
    form, whose results are the new values of its leading list arguments (params, grads, then
    the state lists), and ``_foreach_copy_``."""
    # the step counts are incremented by the optimizer before the op; a functional form that
    # returns them (_fused_adagrad's state_steps_out) returns them unchanged
    unchanged = {i for i, r in enumerate(functional._schema.returns)
                 if r.name == "state_steps_out"}
    lowering = registry.get(inplace) if inplace is not None else None

    def kernel(*lists, **kwargs):
        if not lists[0]:
            return
        if lowering is not None and not _written_storage_shared(lowering, lists, kwargs):
            executor.run(lowering, executor.DIRECT_INPLACE, lists, kwargs)
            return
        new = functional(*lists, **kwargs)
        for i, (dst, values) in enumerate(zip(lists, new)):
            if i in unchanged or (i == 1 and kwargs.get("grad_scale") is None):
                continue  # the gradients change only when they are unscaled
            if dst:
                torch._foreach_copy_(dst, values)

    return kernel


def _written_storage_shared(lowering, args, kwargs) -> bool:
    """Whether a tensor the op writes shares its storage with another of its tensors."""
    tensors: list = []
    executor.arg_keys(args, kwargs, tensors)
    return executor.storage_groups(executor.DIRECT_INPLACE, args, kwargs, tensors,
                                   lowering) is not None
