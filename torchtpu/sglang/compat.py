"""What SGLang 0.5.21 needs on a host without torchvision (a CPU-only torch).

transformers 5.12.1 (SGLang 0.5.21's pin) marks ``AutoImageProcessor`` as needing torchvision
(its lazy-import table reads the module's text), and SGLang registers its multimodal image
processors with it while ``sglang.srt.configs`` is imported, so ``import sglang.srt...``
raises ImportError where torchvision is absent. PyPI's torchvision wheels for torch 2.13 on
x86_64 are CUDA builds that do not load beside the CPU torch (``torchvision::nms does not
exist``). Text models need no image processor: where ``AutoImageProcessor`` is transformers'
placeholder for a missing backend, SGLang's registration is skipped (once, logged) and every
other call goes through unchanged. Applied by ``activate`` before SGLang imports its configs.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _auto_image_processor_missing() -> bool:
    try:
        import transformers
        from transformers.utils.import_utils import DummyObject
    except Exception:  # transformers itself is broken: nothing of ours to fix
        return False
    return isinstance(getattr(transformers, "AutoImageProcessor", None), DummyObject)


def apply() -> None:
    """Arrange for the skip once ``sglang.srt.configs.utils`` has executed (its package's
    ``__init__`` calls it, so it cannot be imported first)."""
    from ..integrations import when_imported

    when_imported("sglang.srt.configs.utils", _patch)


def _patch(utils) -> None:
    original = getattr(utils, "register_image_processor", None)
    if original is None or getattr(original, "_torchtpu_skips", False):
        return  # a layout we do not know, or done: leave SGLang as it is
    if not _auto_image_processor_missing():
        return

    def register_image_processor(config, image_processor):
        if _auto_image_processor_missing():
            logger.info("torchtpu.sglang: no torchvision: image processor %s for %s not "
                        "registered (multimodal models need torchvision)",
                        getattr(image_processor, "__name__", image_processor),
                        getattr(config, "__name__", config))
            return None
        return original(config, image_processor)

    register_image_processor._torchtpu_skips = True
    register_image_processor.__wrapped__ = original
    utils.register_image_processor = register_image_processor
