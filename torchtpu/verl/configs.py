"""VeRL's config defaults that name CUDA features, on "tpu".

Model (``HFModelConfig``): the attention implementation it defaults to.

``HFModelConfig`` builds the Hugging Face config with
``override_config.get("attn_implementation", "flash_attention_2")``: the CUDA flash-attn
package, which transformers refuses to use where it is not installed. On "tpu" the default
becomes "sdpa" (transformers' SDPA path, lowered by torchtpu; packed no-padding batches get
their block-diagonal causal mask from the position ids). A value the user sets
(``+model.override_config.attn_implementation=...``) is kept.

Rollout (``RolloutConfig``): ``enable_sleep_mode`` defaults to True, which asks vLLM to place
weights and KV cache in CUDA's virtual-memory pool so they can be released between rollouts;
vLLM refuses it on a platform without one ("Sleep mode is not supported on current platform"),
as on "tpu". There it is off, and with it ``free_cache_engine`` (sleeping between steps): the
rollout engine keeps its KV cache, and weights are still synchronised every step. For SGLang
(``name=sglang``) the same holds for its memory saver (``enable_memory_saver``, which VeRL turns on
for every SGLang server: CUDA's virtual-memory pool through ``torch_memory_saver``), and VeRL's
SGLang attention default (flashinfer, a CUDA package) becomes torchtpu's SGLang attention backend,
and the server's device is named ("tpu"); values given in ``engine_kwargs.sglang`` are kept.
"""
from __future__ import annotations

import functools

from ..integrations import patch, when_imported

MODEL = "verl.workers.config.model"
ROLLOUT = "verl.workers.config.rollout"
DEFAULT = "sdpa"
# VeRL's SGLang server arguments on "tpu" (torchtpu/sglang/names.py: ATTENTION_BACKEND)
# and the device named: without one SGLang 0.5.23 resolves it from the platform, whose answer is a
# torch.device where its server arguments need a string ("tpu")
SGLANG_DEFAULTS = {"attention_backend": "torchtpu", "enable_memory_saver": False, "device": "tpu"}


def _on_tpu() -> bool:
    from verl.plugin.platform import get_platform

    return get_platform().device_name == "tpu"


def _wrap(orig):
    @functools.wraps(orig)
    def __post_init__(self, *args, **kwargs):
        oc = getattr(self, "override_config", None)
        if oc is not None and "attn_implementation" not in oc and _on_tpu():
            oc = dict(oc)
            oc["attn_implementation"] = DEFAULT
            object.__setattr__(self, "override_config", oc)  # a frozen field of its dataclass
        return orig(self, *args, **kwargs)

    return __post_init__


def _wrap_rollout(orig):
    @functools.wraps(orig)
    def __post_init__(self, *args, **kwargs):
        if getattr(self, "enable_sleep_mode", False) and _on_tpu():
            object.__setattr__(self, "enable_sleep_mode", False)
            object.__setattr__(self, "free_cache_engine", False)
        if getattr(self, "name", None) == "sglang" and _on_tpu():
            kwargs_ = dict(getattr(self, "engine_kwargs", None) or {})
            kwargs_["sglang"] = {**SGLANG_DEFAULTS, **(kwargs_.get("sglang") or {})}
            object.__setattr__(self, "engine_kwargs", kwargs_)
        return orig(self, *args, **kwargs)

    return __post_init__


def install() -> None:
    when_imported(MODEL, lambda m: patch(m, "HFModelConfig.__post_init__", _wrap))
    when_imported(ROLLOUT, lambda m: patch(m, "RolloutConfig.__post_init__", _wrap_rollout))
