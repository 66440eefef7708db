"""SGLang on "tpu": an out-of-tree SGLang platform (``sglang.srt.platforms`` entry point).

SGLang (0.5.21+) resolves its platform once per process, when its modules are first imported,
from the plugins registered under the entry-point group ``sglang.srt.platforms``. ``activate``
is that entry point: it answers with the platform class only where the user asked for "tpu"
(``SGLANG_PLATFORM=tpu``, SGLang's own selector), or where SGLang has no device of its own
(no CUDA/ROCm, XPU or NPU torch, and not ``SGLANG_USE_CPU_ENGINE=1``), so installing torchtpu
never takes a GPU host's SGLang away from it. ``TORCHTPU_SGLANG=0`` turns it off.
"""
from __future__ import annotations

import os

PLATFORM = "torchtpu.sglang.platform.TpuSRTPlatform"


def _sglang_has_own_device() -> bool:
    import torch

    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        return True
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def activate() -> str | None:
    """The ``sglang.srt.platforms`` entry point: the platform's qualified name, or None."""
    if os.environ.get("TORCHTPU_SGLANG", "1") == "0":
        return None
    if os.environ.get("SGLANG_PLATFORM") != "tpu" and _sglang_has_own_device():
        return None
    import torchtpu  # noqa: F401  (registers the device if torch's autoload did not)

    # no device query here: it would create the JAX backend, which a tensor-parallel rank
    # must not do before it joins its job (init_process_group)
    return PLATFORM
