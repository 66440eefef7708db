"""vLLM's worker on "tpu": one process per device, the "tpu_dist" process group, the model
runner of ``model_runner.py``, and the KV cache sized from device memory (TPU/GPU) or from an
explicit size (the CPU platform, see ``platform.py``)."""
from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from ..ops._kv_storage import kv_storage_dtype
from .model_runner import TpuModelRunner

logger = init_logger(__name__)


class TpuWorker(Worker):
    def init_device(self):
        import torchtpu  # noqa: F401  (registers the device where autoload is off)

        self.device = torch.device("tpu:0")  # one device per process (torchtpu's model)
        init_worker_distributed_environment(self.vllm_config, self.rank,
                                            self.distributed_init_method, self.local_rank,
                                            "tpu_dist")
        set_random_seed(self.model_config.seed)
        self.model_runner = TpuModelRunner(self.vllm_config, self.device)

    def sleep(self, level: int = 1) -> None:
        logger.warning("sleep mode is not supported on tpu; ignored")

    def wake_up(self, tags=None) -> None:
        logger.warning("sleep mode is not supported on tpu; ignored")

    def _maybe_get_memory_pool_context(self, tag: str):
        from contextlib import nullcontext

        return nullcontext()

    def _scoped_allocator_max_split(self, max_split_size_mb: int):
        from contextlib import nullcontext

        return nullcontext()

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache as vLLM counts them (pages of the model's KV dtype): the
        explicit size where one is set (always on the CPU platform), else
        ``gpu_memory_utilization`` of the device's memory minus what is allocated now (the
        weights); scaled down where the cache is stored wider (``kv_storage_dtype``)."""
        return int(self._cache_bytes() * self._kv_itemsize(False) / self._kv_itemsize(True))

    def _kv_itemsize(self, stored: bool) -> int:
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        cd = self.cache_config.cache_dtype
        dtype = self.model_config.dtype if cd == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cd]
        return (kv_storage_dtype(dtype) if stored else dtype).itemsize

    def _cache_bytes(self) -> int:
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            logger.info("KV cache: %.2f GiB (explicit size)", explicit / (1 << 30))
            return int(explicit)
        free, total = torch.tpu.mem_get_info()
        used = torch.tpu.memory_allocated()
        budget = int(total * self.cache_config.gpu_memory_utilization) - int(used)
        budget = min(budget, int(free))
        if budget <= 0:
            raise ValueError(
                f"No device memory left for the KV cache: {used / (1 << 30):.2f} GiB in use of "
                f"{total / (1 << 30):.2f} GiB, gpu_memory_utilization="
                f"{self.cache_config.gpu_memory_utilization}")
        logger.info("KV cache: %.2f GiB (%.0f%% of %.2f GiB, %.2f GiB in use)",
                    budget / (1 << 30), 100 * self.cache_config.gpu_memory_utilization,
                    total / (1 << 30), used / (1 << 30))
        return budget

    def compile_or_warm_up_model(self) -> CompilationTimes:
        dt = self.model_runner.warm_up()
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=dt, encoder=0.0)

    def profile(self, is_start: bool = True, profile_prefix=None):
        raise RuntimeError("vLLM's profiler is not supported on tpu; use torch.profiler with "
                           "torch.tpu's profiler support")
