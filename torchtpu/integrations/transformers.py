"""Hugging Face transformers on "tpu": continuous batching's memory sizing.

transformers 5.x already knows the device ("tpu:0" in ``TrainingArguments``, compiling
``generate``'s decode step), but continuous batching (``generate_batch``, ``transformers serve
--continuous-batching``) sizes its KV cache from a memory breakdown that knows only CUDA, XPU and
MPS: for "tpu" it took the host's total RAM less this process's RSS, and 90% of that. Two patches,
applied when "tpu" is the current accelerator:

- ``get_device_and_memory_breakdown`` reports the tpu device's memory
  (``torch.tpu.mem_get_info``: PJRT's figures, or the host's available memory on the CPU
  platform), so the cache takes a fraction of what is free rather than of all RAM;
- on the CPU platform, whose device memory is host memory, the default fraction
  (``max_memory_percent`` when the user set none) is 0.1 rather than transformers' 0.6 for host
  memory ("cpu", "mps"): eager in-place writes into the cache and attention-mask buffers build
  the new array before the old one is released, and the server's peak RSS measured ~3x the
  budget (17 GB for a 5.6 GB budget at 0.3 on a 24 GB host, which it nearly exhausted; 6.4 GB
  at 0.1). Users size the cache with ``--cb-*`` flags / ``ContinuousBatchingConfig`` as usual.
"""
from __future__ import annotations

import functools

from . import tpu_is_accelerator, when_imported

CPU_PLATFORM_MEMORY_PERCENT = 0.1


def _on_cpu_platform() -> bool:
    from ..runtime import devices

    return devices.platform() == "cpu"


def memory_breakdown():
    """(device, total, reserved, allocated) of the current tpu device, as transformers uses them
    (``allocated`` is everything not free, as transformers derives it from CUDA's mem_get_info)."""
    import torch

    dev = torch.device("tpu", torch.tpu.current_device())
    free, total = torch.tpu.mem_get_info(dev)
    return dev, total, torch.tpu.memory_reserved(dev), total - free


def _patch_cb_utils(mod) -> None:
    orig = mod.get_device_and_memory_breakdown
    if getattr(orig, "_torchtpu", False):
        return

    @functools.wraps(orig)
    def get_device_and_memory_breakdown(*args, **kwargs):
        import torch

        if not args and not kwargs and not torch.cuda.is_available() and tpu_is_accelerator():
            return memory_breakdown()
        return orig(*args, **kwargs)

    get_device_and_memory_breakdown._torchtpu = True
    mod.get_device_and_memory_breakdown = get_device_and_memory_breakdown


def _patch_cb_init(mod) -> None:
    orig = mod.resolve_max_memory_percent
    if getattr(orig, "_torchtpu", False):
        return

    @functools.wraps(orig)
    def resolve_max_memory_percent(cb_config, has_logit_processors, device=None):
        if (cb_config.max_memory_percent is None and device is not None
                and getattr(device, "type", None) == "tpu" and _on_cpu_platform()):
            cb_config.max_memory_percent = CPU_PLATFORM_MEMORY_PERCENT
        return orig(cb_config, has_logit_processors, device)

    resolve_max_memory_percent._torchtpu = True
    mod.resolve_max_memory_percent = resolve_max_memory_percent


def install() -> None:
    when_imported("transformers.generation.continuous_batching.utils", _patch_cb_utils)
    when_imported("transformers.generation.continuous_batching.initialization", _patch_cb_init)
