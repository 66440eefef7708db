"""VeRL's FSDP/FSDP2 training engines, registered for device "tpu".

VeRL picks a training engine by (model type, backend, device) in ``EngineRegistry``; its FSDP
engines are registered for "cuda" and "npu" only. They are written against
``verl.utils.device`` (the platform), FSDP2's ``fully_shard`` and ``torch.distributed``, all of
which run on "tpu", so the same classes serve "tpu": registered once their module has been
imported (a post-import hook: importing it here would pull VeRL's model stack into
``import verl``).
"""
from __future__ import annotations

from ..integrations import skipped, when_imported

MODULE = "verl.workers.engine.fsdp.transformer_impl"
# (class in MODULE, model type); both serve the "fsdp" and "fsdp2" backends
ENGINES = (("FSDPEngineWithLMHead", "language_model"), ("FSDPEngineWithValueHead", "value_model"))
BACKENDS = ("fsdp", "fsdp2")


def _register(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    for cls_name, model_type in ENGINES:
        cls = getattr(module, cls_name, None)
        if cls is None:
            skipped(f"{MODULE}.{cls_name}", "not found: VeRL's FSDP engine moved")
            continue
        have = EngineRegistry._engines.get(model_type, {})
        backends = [b for b in BACKENDS if "tpu" not in have.get(b, {})]
        if backends:
            EngineRegistry.register(model_type=model_type, backend=backends, device="tpu")(cls)


def install() -> None:
    when_imported(MODULE, _register)
