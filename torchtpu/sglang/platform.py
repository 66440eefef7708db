"""``TpuSRTPlatform``: SGLang's platform interface answered for device "tpu".

What SGLang asks of a platform (``sglang/srt/platforms/interface.py``): the device and its
memory (``torch.tpu.mem_get_info``: PJRT's allocator statistics on TPU/GPU, the host's
available memory on the CPU platform), the torch.distributed backend ("tpu_dist"), the
attention backend, the KV pool and allocator classes, the compile backend (no graph runner:
``capabilities.graph_capture`` is False), and defaults for the server arguments it would
otherwise pick for CUDA.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Optional

import torch
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

import torchtpu  # noqa: F401  (the "tpu" device)

from .names import ATTENTION_BACKEND  # torchtpu/sglang/attention.py registers it

logger = logging.getLogger(__name__)

TRANSFER_BACKEND = "torchtpu"  # torchtpu/sglang/disagg.py


def _register_attention_choice() -> None:
    # SGLang resolves its platform while its own utilities are still importing: only the
    # plain list of choices may be touched here (the backend registers in init_backend)
    from sglang.srt.arg_groups import choices

    if ATTENTION_BACKEND not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([ATTENTION_BACKEND])
    if TRANSFER_BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([TRANSFER_BACKEND])


_register_attention_choice()


DEFAULT_MAX_DECODE_BUCKET = 16


def decode_buckets(top: int) -> list[int]:
    """Powers of two below ``top``, and ``top``."""
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    return out + [top]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TpuSRTPlatform(SRTPlatform):
    """SGLang's SRT platform for torchtpu's "tpu" device (out of tree)."""

    _enum = PlatformEnum.OOT
    device_name = "tpu"
    device_type = "tpu"
    # No Triton on "tpu": SGLang's allocators and req-to-token writers take their torch paths.
    capabilities = PlatformCapabilities(supports_triton=False, supports_pynccl=False,
                                        graph_capture=True)

    # ---- device and memory -------------------------------------------------------------
    def get_device_total_memory(self, device_id: int = 0) -> int:
        return int(torch.tpu.mem_get_info(device_id)[1])

    def get_current_memory_usage(self, device: Optional[torch.device] = None) -> float:
        free, total = torch.tpu.mem_get_info(device)
        return float(total - free)

    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        return tuple(int(x) for x in torch.tpu.mem_get_info(device_id))

    def get_device(self, device_id: Optional[int] = 0) -> str:
        # a string, as SGLang's interface declares: its argument resolution calls
        # ``get_device()`` (device_id None) for a missing ``--device`` and splits it on ":"
        return "tpu" if device_id is None else f"tpu:{device_id}"

    def set_device(self, device) -> None:
        torch.tpu.set_device(device)

    def get_device_name(self, device_id: int = 0) -> str:
        return str(torch.tpu.get_device_name(device_id))

    def get_device_uuid(self, device_id: int = 0) -> str:
        return f"tpu:{device_id}:{torch.tpu.get_device_name(device_id)}"

    def get_device_capability(self, device_id: int = 0):
        return None

    def empty_cache(self) -> None:
        torch.tpu.empty_cache()

    def synchronize(self) -> None:
        torch.tpu.synchronize()

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_torch_distributed_backend_str(self) -> str:
        return "tpu_dist"

    @classmethod
    def seed_everything(cls, seed: int | None = None) -> None:
        if seed is not None:
            super().seed_everything(seed)
            torch.tpu.manual_seed_all(seed)

    # ---- subsystems --------------------------------------------------------------------
    def get_default_attention_backend(self) -> str:
        return ATTENTION_BACKEND

    def get_kv_pool_cls(self, *, kind: str):
        """MHA: ``TpuPagedKVPool`` (kv_pool.py: one paged tensor per layer, the layout of
        torchtpu's paged attention op); the other kinds: SGLang's own pools (SGLang resolves
        every kind while it configures, whatever the model's)."""
        if kind == "mha":
            from .kv_pool import TpuPagedKVPool

            return TpuPagedKVPool
        return None

    def get_paged_allocator_cls(self):
        return None  # in-tree; its torch paths since capabilities.supports_triton is False

    def get_graph_runner_cls(self):
        """Decode through bucketed compiled programs (graph_runner.py)."""
        from .graph_runner import TpuGraphRunner

        return TpuGraphRunner

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "tpu"

    def init_backend(self) -> None:
        """Called in each worker as SGLang's model runner is imported."""
        from .attention import register

        register()

    # ---- server arguments --------------------------------------------------------------
    def apply_server_args_defaults(self, server_args) -> None:
        if getattr(server_args, "device", None) in (None, "tpu"):
            server_args.device = "tpu"
        if getattr(server_args, "attention_backend", None) is None:
            server_args.attention_backend = ATTENTION_BACKEND
        if getattr(server_args, "sampling_backend", None) is None:
            server_args.sampling_backend = "pytorch"
        ranks = ((getattr(server_args, "tp_size", 1) or 1)
                 * (getattr(server_args, "pp_size", 1) or 1))
        if getattr(server_args, "cuda_graph_bs_decode", None) is None:
            # decode buckets (graph_runner.py): powers of two up to the decode graph's largest
            # batch size (--cuda-graph-max-bs-decode), else --torch-compile-max-bs with
            # --enable-torch-compile, else 16: each bucket is a program compiled at start-up
            top = (getattr(server_args, "cuda_graph_max_bs_decode", None)
                   or (server_args.torch_compile_max_bs
                       if getattr(server_args, "enable_torch_compile", False) else None)
                   or DEFAULT_MAX_DECODE_BUCKET)
            server_args.cuda_graph_bs_decode = decode_buckets(int(top))
        if (getattr(server_args, "disaggregation_mode", "null") == "decode"
                and getattr(server_args, "disaggregation_decode_retraction_backup", None) is None):
            # SGLang's default, a HiCache host pool, registers host memory with CUDA; a
            # retracted request is answered 503 (the client retries) instead
            server_args.disaggregation_decode_retraction_backup = "none"
        if ranks > 1 and not os.environ.get("TORCHTPU_COORDINATOR_ADDRESS"):
            # one JAX coordinator for the ranks this process spawns (they inherit it)
            os.environ["TORCHTPU_COORDINATOR_ADDRESS"] = f"127.0.0.1:{_free_port()}"
