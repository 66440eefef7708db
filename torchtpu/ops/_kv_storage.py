"""The dtype a paged KV cache is stored in, for the serving engines (vLLM's platform and
SGLang's KV pool, both over ``torch.tpu.ops``' paged attention).

XLA:CPU has no 16-bit float arithmetic: it converts a bf16/f16 operand of a gather or scatter,
the whole cache, to float32 and back in every step's program (the KV write of one decode step:
~500 ms on a 256 MiB cache; in place in float32). There a 16-bit float cache is stored as
float32 (bf16/f16 values widen exactly) and the engine halves the cache's byte budget to hold
its size in bytes. TPUs and GPUs store the model's dtype.
"""
from __future__ import annotations

import importlib.util
import os

import torch


def pjrt_platform() -> str:
    """The PJRT platform "tpu" runs on, without creating the JAX backend when it does not
    exist yet: the engines configure themselves in processes (their TP workers) that must join
    the "tpu_dist" job before their first device use."""
    from torchtpu.runtime import devices

    if devices.backend_created():
        return devices.platform()
    want = (os.environ.get("TORCHTPU_PLATFORM") or os.environ.get("JAX_PLATFORMS", "")
            ).split(",")[0].strip().lower()
    if want:
        return {"cuda": "gpu", "rocm": "gpu"}.get(want, want)
    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin"):
        if importlib.util.find_spec(plugin) is not None:
            return "gpu"
    return "cpu"


def kv_storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is stored in for a model whose KV dtype is ``dtype``: float32
    for bf16/f16 on XLA:CPU (see the module's docstring), else ``dtype``."""
    if dtype in (torch.bfloat16, torch.float16) and pjrt_platform() == "cpu":
        return torch.float32
    return dtype
