"""Hugging Face accelerate on "tpu" (and through it ``transformers.Trainer``).

accelerate has no extension point for a new device type: ``PartialState.default_device`` walks a
fixed list (MPS, MLU, ..., CUDA, XPU) and falls back to CPU, so batches stayed on CPU while
``TrainingArguments`` put the model on "tpu:0". Its ``ACCELERATE_TORCH_DEVICE`` variable would
also override ``use_cpu=True``, so instead three narrow patches apply when "tpu" is the current
accelerator and accelerate found no device of its own:

- ``PartialState.default_device`` returns ``tpu:<current device>`` where it would return CPU
  (single-process runs; ``cpu=True`` still means CPU);
- under a launcher (``LOCAL_RANK`` set: torchrun, accelerate launch), ``_prepare_backend``
  returns the "tpu_dist" process group in accelerate's one-process-per-device mode
  (``MULTI_GPU``, the DDP mode; each rank trained alone before) and ``set_device`` picks
  ``tpu:<local rank>``;
- ``DynamoBackend`` gains the member ``TPU`` (``torch_compile_backend="tpu"``);
- ``get_max_memory()`` (``device_map="auto"``) lists the tpu devices by index with their free
  memory from ``torch.tpu.mem_get_info``; on the CPU platform, whose device memory is the host's,
  it leaves out the separate "cpu" budget, as accelerate does for MPS and integrated GPUs.
"""
from __future__ import annotations

import functools
import os

from . import tpu_is_accelerator, when_imported


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _patch_state(mod) -> None:
    cls = mod.PartialState
    orig = cls.default_device
    if getattr(orig, "_torchtpu", False):
        return

    def default_device(self):
        dev = orig.fget(self)
        if dev.type == "cpu" and tpu_is_accelerator():
            import torch

            return torch.device("tpu", torch.tpu.current_device())
        return dev

    default_device.__doc__ = orig.__doc__
    prop = property(default_device)
    prop.fget._torchtpu = True
    cls.default_device = prop

    # One process per device (torchrun, accelerate launch): accelerate finds no backend for
    # "tpu" and each rank would train alone; join them in a "tpu_dist" process group instead.
    orig_prepare = cls._prepare_backend
    orig_set_device = cls.set_device
    multi = mod.DistributedType.MULTI_GPU  # accelerate's "one process per accelerator" DDP mode

    @functools.wraps(orig_prepare)
    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found, kind = orig_prepare(self, cpu, sagemaker_dp, backend)
        if (kind == mod.DistributedType.NO and not cpu and not sagemaker_dp
                and int(os.environ.get("LOCAL_RANK", -1)) != -1 and tpu_is_accelerator()):
            return backend or "tpu_dist", multi
        return found, kind

    @functools.wraps(orig_set_device)
    def set_device(self):
        if self.device is None and self.distributed_type == multi and tpu_is_accelerator() \
                and not torch_cuda_available():
            import torch

            self.device = torch.device("tpu", self.local_process_index)
            torch.tpu.set_device(self.device)
            return
        return orig_set_device(self)

    cls._prepare_backend = _prepare_backend
    cls.set_device = set_device


def _add_enum_member(enum_cls, name: str, value: str) -> None:
    """Add a member to a ``(str, Enum)`` class as the Enum machinery would have made it."""
    if name in enum_cls.__members__:
        return
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    if hasattr(member, "_sort_order_"):
        member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    type.__setattr__(enum_cls, name, member)


def _patch_dataclasses(mod) -> None:
    _add_enum_member(mod.DynamoBackend, "TPU", "TPU")


def tpu_max_memory() -> dict:
    """{tpu index: free bytes} (plus "cpu" off the CPU platform), what ``get_max_memory`` gives."""
    import torch

    from ..runtime import devices, memory

    out = {i: torch.tpu.mem_get_info(i)[0] for i in range(torch.tpu.device_count())}
    if devices.platform() != "cpu":
        out["cpu"] = memory.host_memory()[0]
    return out


def _patch_modeling(mod) -> None:
    orig = mod.get_max_memory
    if getattr(orig, "_torchtpu", False):
        return

    @functools.wraps(orig)
    def get_max_memory(max_memory=None):
        if max_memory is None and tpu_is_accelerator():
            found = orig(None)
            if not any(isinstance(k, int) for k in found):  # accelerate saw no device of its own
                return tpu_max_memory()
            return found
        return orig(max_memory)

    get_max_memory._torchtpu = True
    mod.get_max_memory = get_max_memory
    # modules that bound the original before this ran (accelerate imported before torchtpu)
    import sys

    for name, attr in (("accelerate.utils", "get_max_memory"),
                       ("transformers.integrations.accelerate", "accelerate_max_memory")):
        other = sys.modules.get(name)
        if other is not None and getattr(other, attr, None) is orig:
            setattr(other, attr, get_max_memory)


def install() -> None:
    when_imported("accelerate.state", _patch_state)
    when_imported("accelerate.utils.dataclasses", _patch_dataclasses)
    when_imported("accelerate.utils.modeling", _patch_modeling)
