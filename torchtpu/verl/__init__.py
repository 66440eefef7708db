"""VeRL on device "tpu": the platform plugin (``verl.plugins`` entry point ``tpu``).

``import verl`` loads (imports, calls nothing) every ``verl.plugins`` entry point; ours is this
module, whose import registers the "tpu" platform with VeRL's ``PlatformRegistry``
(``platform.py``), which VeRL's auto-detection then picks on a host whose PyTorch accelerator is
"tpu" (no environment variable; ``VERL_PLATFORM`` still overrides). Where VeRL is written for
named devices, narrow post-import patches (nothing of VeRL's is imported early):
- ``engines.py``: the FSDP/FSDP2 engines (language and value model) registered for "tpu";
- ``configs.py``: the model config defaults to transformers' "sdpa" attention instead of the
  flash-attn package, and the rollout config turns off vLLM's sleep mode (CUDA's memory pool);
- ``resources.py``: VeRL's Ray resource check counts "TPU" (it counts GPU or NPU only);
- ``vllm_dist.py``: vLLM's CPU wheel answers to the distribution name "vllm" VeRL looks for;
- ``sglang_rollout.py``: VeRL's SGLang loader imports SGLang for the "tpu" platform (VeRL forces
  SGLang's CPU engine for that import);
- ``sglang_server.py``, ``sglang_weights.py``: VeRL 0.9.1's SGLang server and weight sync over
  SGLang 0.5.23 (``ServerArgs`` fields, the launcher's result, the weight-update session) with
  weights handed over through host shared memory (no CUDA IPC).
The rollout servers' processes get ``VLLM_TARGET_DEVICE=tpu`` from the platform
(``rollout_env_vars``), so vLLM runs on "tpu" through torchtpu.vllm.
"""
from __future__ import annotations

_registered = [False]


def register() -> None:
    """Register the platform and the engines (once; run when this module is imported)."""
    if _registered[0]:
        return
    from verl.plugin.platform import PlatformRegistry

    from . import (configs, engines, resources, sglang_rollout, sglang_server, sglang_weights,
                   vllm_dist)
    from .platform import NAME, PlatformTPU

    PlatformRegistry.register(platform=NAME)(PlatformTPU)
    engines.install()
    configs.install()
    resources.install()
    sglang_rollout.install()
    sglang_server.install()
    sglang_weights.install()
    vllm_dist.install()
    _registered[0] = True


register()
