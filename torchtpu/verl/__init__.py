"""VeRL on device "tpu": the platform plugin (``verl.plugins`` entry point ``tpu``).

``import verl`` loads (imports, calls nothing) every ``verl.plugins`` entry point; ours is this
module, whose import registers (``register``) the "tpu" platform to VeRL's ``PlatformRegistry`` (``platform.py``), which VeRL's auto-detection then
picks on a host whose PyTorch accelerator is "tpu" (no environment variable: ``VERL_PLATFORM``
still overrides). VeRL's training engines are registered per device; the FSDP/FSDP2 engines
(``verl.workers.engine.fsdp.transformer_impl``: language model and value model) are registered
for "tpu" too, when that module has been imported (``engines.py``); the model config defaults
to transformers' "sdpa" attention instead of the flash-attn package (``model_config.py``); the
Ray resource check counts "TPU" (``resources.py``); vLLM's CPU wheel answers to the
distribution name "vllm" VeRL looks for (``vllm_dist.py``). Nothing here imports VeRL's
heavy modules early.
"""
from __future__ import annotations

_registered = [False]


def register() -> None:
    """Register the platform and the engines (once; run when this module is imported)."""
    if _registered[0]:
        return
    from verl.plugin.platform import PlatformRegistry

    from . import engines, model_config, resources, vllm_dist
    from .platform import NAME, PlatformTPU

    PlatformRegistry.register(platform=NAME)(PlatformTPU)
    engines.install()
    model_config.install()
    resources.install()
    vllm_dist.install()
    _registered[0] = True


register()
