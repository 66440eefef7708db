"""vLLM's Platform for device "tpu" (any PJRT device torchtpu runs on)."""
from __future__ import annotations

import os

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from ..ops._kv_storage import pjrt_platform

logger = init_logger(__name__)

ATTENTION_BACKEND = "torchtpu.vllm.attention.TpuPagedAttentionBackend"
# KV cache size on the CPU platform (XLA:CPU shares host memory with everything else, so a
# fraction of "device memory" means nothing there): kv_cache_memory_bytes, else this many GiB
# (vLLM's own CPU variable), else 1 GiB.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class TpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "TPU"
    dist_backend: str = "tpu_dist"
    device_control_env_var: str = "TORCHTPU_VISIBLE_DEVICES"
    # vLLM's small torch.compile'd helpers (the sampler's logprob ranks on host tensors, the
    # vocab-parallel embedding's mask) run eagerly: on the host they are CPU ops, and in the
    # model they are traced into the bucket's program anyway (model_runner.py compiles it)
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        """The first is what vLLM's ``dtype="auto"`` turns a float32 checkpoint into. XLA:CPU
        has no 16-bit float arithmetic: it converts every bf16/f16 operand to float32 around
        each op, the whole KV cache at every step (a step of a tiny Llama: 780 ms in bf16, 6 ms
        in f32), so there float32 checkpoints stay float32; TPUs and GPUs compute bf16."""
        if pjrt_platform() == "cpu":
            return [torch.float32, torch.bfloat16, torch.float16]
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def import_kernels(cls) -> None:
        # never vllm._C: a TPU host's vllm wheel has no usable one; every op here is torch's
        # or torch.tpu.ops'
        import torchtpu.ops  # noqa: F401

    @classmethod
    def import_ir_kernels(cls) -> None:
        return None

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config,
                             num_heads: int | None = None) -> str:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        c = attn_selector_config
        if c.use_mla or c.use_sparse or c.has_sink:
            raise NotImplementedError(
                "MLA, sparse attention and attention sinks are not supported on 'tpu' yet")
        if selected_backend not in (None, AttentionBackendEnum.CUSTOM):
            logger.info("Attention backend %s is not available on tpu; using torchtpu's "
                        "paged attention", selected_backend)
        register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND)
        return ATTENTION_BACKEND

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(0)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(torch.tpu.mem_get_info()[1])

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(torch.tpu.memory_allocated())

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "torchtpu.vllm.communicator.TpuCommunicator"

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # attention is called directly, so Dynamo traces the backend and the compiled program
        # holds the KV write and the paged attention op (lowered inline)
        return False

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("LoRA is not supported on 'tpu' yet")

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        parallel_config = vllm_config.parallel_config
        scheduler_config = vllm_config.scheduler_config
        comp = vllm_config.compilation_config

        if vllm_config.speculative_config is not None:
            raise NotImplementedError("speculative decoding is not supported on 'tpu' yet")
        if vllm_config.lora_config is not None:
            raise NotImplementedError("LoRA is not supported on 'tpu' yet")
        if model_config is not None:
            model_config.disable_cascade_attn = True
        from .kv_connector import replace_connector

        replace_connector(vllm_config.kv_transfer_config)
        if not cache_config.user_specified_block_size:
            cache_config.block_size = 16
        if pjrt_platform() == "cpu" and cache_config.kv_cache_memory_bytes is None:
            env = os.environ.get(CPU_KV_CACHE_ENV, "")
            cache_config.kv_cache_memory_bytes = (
                int(float(env) * (1 << 30)) if env else DEFAULT_CPU_KV_CACHE_BYTES)

        # The model runner compiles the model itself: torch.compile(backend="tpu") per token
        # bucket (model_runner.py). vLLM's own compilation (Inductor, CUDA graphs) is off; its
        # custom ops take their PyTorch-native forms.
        enforce_eager = bool(model_config is not None and model_config.enforce_eager) \
            or comp.mode == CompilationMode.NONE
        vllm_config.additional_config = dict(vllm_config.additional_config or {})
        vllm_config.additional_config.setdefault("torchtpu_compile", not enforce_eager)
        comp.mode = CompilationMode.NONE
        comp.cudagraph_mode = CUDAGraphMode.NONE
        comp.cudagraph_capture_sizes = []
        comp.custom_ops = ["none"]

        # vLLM's async scheduling (model_runner.py: the next step scheduled and launched while
        # the device runs the current one, its input ids taken from the previous program's on
        # the device) only where asked for (additional_config {"torchtpu_async_scheduling":
        # true}): on 2-core XLA:CPU it gave the same offline throughput as synchronous steps
        # (2026-12-06: 2,510 vs 2,520 tok/s; served ITL 4.6 vs 5.0 ms, one run); not with tensor
        # parallelism yet
        async_ok = bool(vllm_config.additional_config.get("torchtpu_async_scheduling")) \
            and parallel_config.world_size == 1
        if not async_ok:
            scheduler_config.async_scheduling = False
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = "torchtpu.vllm.worker.TpuWorker"
        if parallel_config.world_size > 1 and \
                parallel_config.distributed_executor_backend in (None, "uni"):
            parallel_config.distributed_executor_backend = "mp"
        if parallel_config.enable_dbo:
            parallel_config.enable_dbo = False
        # worker processes are spawned (a forked JAX runtime is not usable)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
