"""Make libraries that pick a device by name see "tpu" (Hugging Face accelerate, transformers).

These libraries choose their device from a fixed list (CUDA, MPS, XPU, NPU...). Where a library
has no extension point, a narrow patch of the one function that picks the device is applied
right after that library's module is imported (a post-import hook: nothing is imported early,
and nothing changes unless "tpu" is the current accelerator when the function is called).
``TORCHTPU_INTEGRATIONS=0`` turns all of them off. What each patch does: ``accelerate.py``,
``transformers.py``, ``flex_attention.py``, ``torchtitan.py``; DTensor's op strategies get
the attention ops "tpu" reaches (``distributed/attention.py``). ``TORCHTPU_TORCH_TPU_COMPAT=1``
(opt-in) makes ``import torch_tpu`` work for tools that look for Google's module name (Ray
Train): see ``torch_tpu/__init__.py``.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
import threading

_hooks: dict = {}
_lock = threading.Lock()


def _run(name: str, module) -> None:
    for fn in _hooks.pop(name, ()):
        fn(module)


class _Loader(importlib.abc.Loader):
    """Wraps a module's loader to run the hooks once the module has executed."""

    def __init__(self, inner, name):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        _run(self._name, module)

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, name)
        return spec


_finder = _Finder()


def when_imported(name: str, fn) -> None:
    """Call ``fn(module)`` once module ``name`` has been imported (now if it already is)."""
    with _lock:
        mod = sys.modules.get(name)
        if mod is None:
            _hooks.setdefault(name, []).append(fn)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    fn(mod)


def tpu_is_accelerator() -> bool:
    """True when "tpu" is PyTorch's current accelerator (it is whenever torchtpu is loaded)."""
    import torch

    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "tpu"


class _TorchTpuCompatFinder(importlib.abc.MetaPathFinder):
    """Serves ``torch_tpu`` from ``torchtpu/integrations/torch_tpu`` (opt-in). It sits last on
    ``sys.meta_path``, so it is asked only when no other finder has a ``torch_tpu``."""

    def find_spec(self, name, path, target=None):
        if name != "torch_tpu":
            return None
        import importlib.util

        here = os.path.join(os.path.dirname(__file__), "torch_tpu")
        return importlib.util.spec_from_file_location(
            "torch_tpu", os.path.join(here, "__init__.py"), submodule_search_locations=[here])


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no")


def install() -> None:
    if _flag("TORCHTPU_TORCH_TPU_COMPAT", "0") and not any(
            isinstance(f, _TorchTpuCompatFinder) for f in sys.meta_path):
        sys.meta_path.append(_TorchTpuCompatFinder())
    if not _flag("TORCHTPU_INTEGRATIONS", "1"):
        return
    from . import accelerate, flex_attention, torchtitan, transformers

    accelerate.install()
    transformers.install()
    flex_attention.install()
    torchtitan.install()
    from ..distributed import attention as dist_attention  # DTensor strategies, CP: SDPA

    when_imported("torch.distributed.tensor._ops._matrix_ops", dist_attention.install)
    when_imported("torch.distributed.tensor.experimental._context_parallel._attention",
                  dist_attention.install_cp)
