"""vLLM on device "tpu": the platform plugin (``vllm.platform_plugins`` entry point ``tpu``).

vLLM's engine core, scheduler, KV-cache manager, sampler and OpenAI server are host-side and
run unchanged; this room gives them a Platform (``platform.py``: device "tpu", dispatch key
PrivateUse1, distributed backend "tpu_dist"), a Worker (``worker.py``), a model runner
subclassing vLLM's GPU runner that prepares inputs on the host and runs the model on "tpu",
compiled per token bucket with ``torch.compile(backend="tpu")`` (``model_runner.py``,
``buckets.py``), a paged-attention backend over ``torch.tpu.ops.ragged_paged_attention`` /
``kv_cache_update_`` (``attention.py``) and a device communicator for tensor parallelism over
"tpu_dist" (``communicator.py``). Nothing here imports ``vllm._C``.

Activation is deliberate: an out-of-tree platform that answers beats vLLM's built-in ones, so
``register()`` answers only when the user asks for "tpu": ``VLLM_TARGET_DEVICE=tpu``, or
``VLLM_PLUGINS`` naming this plugin (``VLLM_PLUGINS=tpu``).
"""
from __future__ import annotations

import os

PLATFORM = "torchtpu.vllm.platform.TpuPlatform"


def requested() -> bool:
    """Whether the user asked vLLM for the "tpu" device (see the module docstring)."""
    if os.environ.get("VLLM_TARGET_DEVICE", "").strip().lower() == "tpu":
        return True
    plugins = os.environ.get("VLLM_PLUGINS")
    return plugins is not None and "tpu" in [p.strip() for p in plugins.split(",")]


def register() -> str | None:
    """The ``vllm.platform_plugins`` entry point: the Platform's qualified name, or None."""
    return PLATFORM if requested() else None
