"""VeRL's model config on "tpu": the attention implementation it defaults to.

``HFModelConfig`` builds the Hugging Face config with
``override_config.get("attn_implementation", "flash_attention_2")``: the CUDA flash-attn
package, which transformers refuses to use where it is not installed. On "tpu" the default
becomes "sdpa" (transformers' SDPA path, lowered by torchtpu; packed no-padding batches get
their block-diagonal causal mask from the position ids). A value the user sets
(``+model.override_config.attn_implementation=...``) is kept.
"""
from __future__ import annotations

import functools

from ..integrations import patch, when_imported

MODULE = "verl.workers.config.model"
DEFAULT = "sdpa"


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


def install() -> None:
    when_imported(MODULE, lambda m: patch(m, "HFModelConfig.__post_init__", _wrap))
