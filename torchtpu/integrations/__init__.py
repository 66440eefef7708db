"""Make libraries that pick a device by name see "tpu" (Hugging Face accelerate, transformers).

These libraries choose their device from a fixed list (CUDA, MPS, XPU, NPU...). Where a library
has no extension point, a narrow patch of the one function that picks the device is applied
right after that library's module is imported (a post-import hook: nothing is imported early,
and nothing changes unless "tpu" is the current accelerator when the function is called).
A patch runs once its module has finished executing, whatever the import order (``when_imported``),
and never breaks the library: a target that is missing, moved or has another signature is
skipped (``patch``, ``skipped``; ``TORCHTPU_DEBUG_INTEGRATIONS=1`` says so, ``STATUS`` lists every
target). ``TORCHTPU_INTEGRATIONS=0`` turns all of them off. What each patch does: ``accelerate.py``,
``transformers.py``, ``flex_attention.py``, ``torchtitan.py``, ``litert_torch.py``; DTensor's op strategies get
the attention ops "tpu" reaches (``distributed/attention.py``). ``TORCHTPU_TORCH_TPU_COMPAT=1``
(opt-in) makes ``import torch_tpu`` work for tools that look for Google's module name (Ray
Train): see ``torch_tpu/__init__.py``.
"""

import importlib.abc as _abc
import os as _os
import sys as _sys

from .hooks import STATUS, _flag, bind, patch, skipped, tpu_is_accelerator, when_imported

__all__ = ["STATUS", "bind", "install", "patch", "skipped", "tpu_is_accelerator", "when_imported"]


class _TorchTpuCompatFinder(_abc.MetaPathFinder):
    """Serves ``torch_tpu`` from ``torchtpu/integrations/torch_tpu`` (opt-in). It sits last on
    ``sys.meta_path``, so it is asked only when no other finder has a ``torch_tpu``."""

    def find_spec(self, name, path, target=None):
        if name != "torch_tpu":
            return None
        import importlib.util

        here = _os.path.join(_os.path.dirname(__file__), "torch_tpu")
        return importlib.util.spec_from_file_location(
            "torch_tpu", _os.path.join(here, "__init__.py"), submodule_search_locations=[here])


def install() -> None:
    if _flag("TORCHTPU_TORCH_TPU_COMPAT", "0") and not any(
            isinstance(f, _TorchTpuCompatFinder) for f in _sys.meta_path):
        _sys.meta_path.append(_TorchTpuCompatFinder())
    if not _flag("TORCHTPU_INTEGRATIONS", "1"):
        return
    from . import accelerate, flex_attention, litert_torch, torchtitan, transformers

    accelerate.install()
    litert_torch.install()
    transformers.install()
    flex_attention.install()
    torchtitan.install()
    from ..distributed import attention as dist_attention  # DTensor strategies, CP: SDPA

    when_imported("torch.distributed.tensor._ops._matrix_ops", dist_attention.install)
    when_imported("torch.distributed.tensor.experimental._context_parallel._attention",
                  dist_attention.install_cp)
