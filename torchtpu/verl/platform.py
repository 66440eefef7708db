"""VeRL's "tpu" platform: what ``verl.plugin.platform.PlatformBase`` asks of a device backend,
answered by ``torch.tpu``.

VeRL reads everything device-specific through its platform singleton (``verl.utils.device``):
the device name ("tpu": tensors, ``trainer.device``, FSDP's ``device_mesh``), the device module
(``torch.tpu``), the collective backend (VeRL builds ``"cpu:gloo,tpu:tpu_dist"``), the Ray
resource used for placement ("TPU", Ray's own accelerator name, whose visible-chips variable is
``TPU_VISIBLE_CHIPS``) and the variables its rollout servers start with.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase

NAME = "tpu"


class PlatformTPU(PlatformBase):
    """Device "tpu" from torchtpu: any PJRT backend (TPU, GPU, or XLA:CPU)."""

    @property
    def device_name(self) -> str:
        return "tpu"

    @property
    def vendor_name(self) -> str:
        return "torchtpu"

    @property
    def device_module(self):
        return torch.tpu

    def is_available(self) -> bool:
        """VeRL asks this when it creates the platform, in every process, before a worker has
        joined its process group: answered without creating the JAX backend until it exists
        (torchtpu always has a PJRT platform, XLA:CPU at least; the devices are counted at
        first use)."""
        from torchtpu.runtime import devices

        return torch.tpu.is_available() if devices.backend_created() else True

    def is_platform_available(self, use_smi_check=False) -> bool:
        """VeRL's auto-detection asks every registered platform, in CPU-only Ray actors too:
        "tpu" is PyTorch's accelerator once torchtpu is installed (its autoload entry point).
        Answered without creating the JAX backend: a process of a multi-process job must join
        its cluster before that (``torchtpu.distributed.bootstrap``)."""
        if not hasattr(torch, "tpu"):
            return False
        if torch.cuda.is_available():  # a CUDA host keeps VeRL's nvidia platform unless asked
            return False
        acc = torch._C._get_accelerator()
        return acc.type == "tpu"

    def current_device(self) -> int:
        return torch.tpu.current_device()

    def device_count(self) -> int:
        return torch.tpu.device_count()

    def set_device(self, device_index: int) -> None:
        torch.tpu.set_device(device_index)

    def synchronize(self, device_index: Optional[int] = None) -> None:
        torch.tpu.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.tpu.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """CUDA's caching-allocator options (``expandable_segments``) have no PJRT
        counterpart: PJRT owns the device memory."""

    def empty_cache(self) -> None:
        torch.tpu.empty_cache()

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None  # no CUDA compute capability (VeRL then skips flash-attn checks)

    def communication_backend_name(self) -> str:
        return "tpu_dist"

    def visible_devices_envvar(self) -> str:
        return "TPU_VISIBLE_CHIPS"

    def ray_resource_name(self) -> str:
        return "TPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        """VeRL asks for ``1 / max_colocate_count`` of a device per worker (worker groups
        colocated in one placement-group bundle). Ray refuses a fraction of a "TPU" (1, 2, 4 or
        8 chips: a TPU chip is not shared between processes), so a worker holds whole chips:
        one worker group per bundle (GRPO's fused actor/rollout/reference group is one)."""
        return {"resources": {"TPU": max(1, math.ceil(num_gpus - 1e-9))}}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"]

    def is_ipc_supported(self) -> bool:
        return False  # no CUDA IPC handles: weights reach the rollout engine by copy

    def rollout_env_vars(self) -> dict[str, str]:
        """The rollout servers' processes: vLLM's and SGLang's "tpu" platforms (torchtpu.vllm,
        torchtpu.sglang) answer only when asked for by name."""
        env = {}
        if importlib.util.find_spec("torchtpu.vllm") is not None:
            env["VLLM_TARGET_DEVICE"] = os.environ.get("VLLM_TARGET_DEVICE", "tpu")
        if importlib.util.find_spec("torchtpu.sglang") is not None:
            env["SGLANG_PLATFORM"] = os.environ.get("SGLANG_PLATFORM", "tpu")
        return env

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        with torch.profiler.record_function(msg):
            yield

    def profiler_start(self) -> None:
        """Device traces come from ``torch.profiler`` (torchtpu's XLA planes), not a CUDA
        profiler API: nothing to start here."""

    def profiler_stop(self) -> None:
        """See ``profiler_start``."""

    def cudart(self) -> Any:
        return None
