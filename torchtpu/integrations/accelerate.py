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

from .hooks import bind, patch, skipped, tpu_is_accelerator, when_imported


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_device(orig):
    def default_device(self):
        dev = orig.fget(self)
        if dev.type == "cpu" and tpu_is_accelerator():
            import torch

            return torch.device("tpu", torch.tpu.current_device())
        return dev

    default_device.__doc__ = orig.__doc__
    return property(default_device)


def _patch_state(mod) -> None:
    patch(mod, "PartialState.default_device", _default_device)

    # One process per device (torchrun, accelerate launch): accelerate finds no backend for
    # "tpu" and each rank would train alone; join them in a "tpu_dist" process group instead.
    kinds = getattr(mod, "DistributedType", None)
    if kinds is None or not hasattr(kinds, "MULTI_GPU") or not hasattr(kinds, "NO"):
        skipped(f"{mod.__name__}.PartialState._prepare_backend", "no DistributedType.MULTI_GPU")
        return
    multi = kinds.MULTI_GPU  # accelerate's "one process per accelerator" DDP mode

    def prepare_backend(orig):
        @functools.wraps(orig)
        def _prepare_backend(self, *args, **kwargs):
            found, kind = orig(self, *args, **kwargs)
            ba = bind(orig, (self,) + args, kwargs)
            if ba is None:
                return found, kind
            ba.apply_defaults()
            cpu, sagemaker_dp = ba.arguments["cpu"], ba.arguments["sagemaker_dp"]
            if (kind == kinds.NO and not cpu and not sagemaker_dp
                    and int(os.environ.get("LOCAL_RANK", -1)) != -1 and tpu_is_accelerator()):
                return ba.arguments["backend"] or "tpu_dist", multi
            return found, kind

        return _prepare_backend

    def set_device(orig):
        @functools.wraps(orig)
        def set_device(self):
            if self.device is None and self.distributed_type == multi and tpu_is_accelerator() \
                    and not torch_cuda_available():
                import torch

                self.device = torch.device("tpu", self.local_process_index)
                torch.tpu.set_device(self.device)
                return
            return orig(self)

        return set_device

    if patch(mod, "PartialState._prepare_backend", prepare_backend,
             params=("cpu", "sagemaker_dp", "backend")):
        patch(mod, "PartialState.set_device", set_device)


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
    if not hasattr(mod, "DynamoBackend"):
        skipped(f"{mod.__name__}.DynamoBackend", "not found")
        return
    _add_enum_member(mod.DynamoBackend, "TPU", "TPU")


def tpu_max_memory() -> dict:
    """{tpu index: free bytes} (plus "cpu" off the CPU platform), what ``get_max_memory`` gives."""
    import torch

    from ..runtime import devices, memory

    out = {i: torch.tpu.mem_get_info(i)[0] for i in range(torch.tpu.device_count())}
    if devices.platform() != "cpu":
        out["cpu"] = memory.host_memory()[0]
    return out


def _max_memory(orig):
    @functools.wraps(orig)
    def get_max_memory(max_memory=None):
        if max_memory is None and tpu_is_accelerator():
            found = orig(None)
            if not any(isinstance(k, int) for k in found):  # accelerate saw no device of its own
                return tpu_max_memory()
            return found
        return orig(max_memory)

    return get_max_memory


def _patch_modeling(mod) -> None:
    # rebind: modules that bound the original before this ran (accelerate imported before
    # torchtpu), transformers' ``accelerate_max_memory`` among them
    patch(mod, "get_max_memory", _max_memory, params=("max_memory",),
          rebind=("accelerate", "transformers"))


def install() -> None:
    when_imported("accelerate.state", _patch_state)
    when_imported("accelerate.utils.dataclasses", _patch_dataclasses)
    when_imported("accelerate.utils.modeling", _patch_modeling)
