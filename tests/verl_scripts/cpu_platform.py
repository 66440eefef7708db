"""A "cpu" VeRL platform, for reference runs of the same trainer on PyTorch's CPU.

VeRL 0.9.1 ships platforms for CUDA, NPU and ROCm only; its SFT trainer otherwise runs
unchanged on any platform. This one (loaded with ``VERL_USE_EXTERNAL_MODULES=cpu_platform`` and
chosen with ``VERL_PLATFORM=cpu``, this folder on ``PYTHONPATH``) answers with PyTorch's CPU
device and gloo, and registers VeRL's FSDP engines for "cpu", so the tpu run's losses have a
reference computed by PyTorch's own CPU kernels. Test-only: it is not part of torchtpu.
"""
from __future__ import annotations

import contextlib
import types

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _noop(*args, **kwargs):
    return None


# what VeRL calls on its device module (``get_torch_device()``) that torch.cpu lacks
_cpu = types.SimpleNamespace(**{name: getattr(torch.cpu, name) for name in dir(torch.cpu)
                                if not name.startswith("__")})
_cpu.empty_cache = _noop
_cpu.manual_seed = torch.manual_seed
_cpu.manual_seed_all = torch.manual_seed
_cpu.get_rng_state = torch.get_rng_state
_cpu.set_rng_state = torch.set_rng_state
_cpu.memory_allocated = _cpu.memory_reserved = lambda *a, **k: 0
_cpu.max_memory_allocated = _cpu.max_memory_reserved = lambda *a, **k: 0
_cpu.mem_get_info = lambda *a, **k: (0, 0)
_cpu.get_device_name = lambda *a, **k: "cpu"
_cpu.current_device = lambda: 0


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "pytorch"

    @property
    def device_module(self):
        return _cpu

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return False  # never auto-detected: chosen with VERL_PLATFORM=cpu

    def current_device(self):
        return "cpu"  # as torch.cpu.current_device(): VeRL moves modules with .to(device=this)

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CPU_VISIBLE_DEVICES_UNUSED"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


# VeRL's engine package reads the platform at import: registered first
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl as _fsdp  # noqa: E402

for _cls, _model_type in ((_fsdp.FSDPEngineWithLMHead, "language_model"),
                          (_fsdp.FSDPEngineWithValueHead, "value_model")):
    EngineRegistry.register(model_type=_model_type, backend=["fsdp", "fsdp2"], device="cpu")(_cls)

# VeRL spells its process group "cpu:gloo,<device>:<backend>": for device "cpu" that names cpu
# twice, which c10d refuses; the reference run's group is plain gloo.
_init_process_group = torch.distributed.init_process_group


def _init_gloo(*args, backend=None, **kwargs):
    if backend == "cpu:gloo,cpu:gloo":
        backend = "gloo"
    return _init_process_group(*args, backend=backend, **kwargs)


torch.distributed.init_process_group = _init_gloo
