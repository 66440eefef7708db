"""An opt-in stand-in for Google's ``torch_tpu`` module name, for tools that import it.

Ray Train's TPU device manager (``ScalingConfig(use_tpu=True)``) checks ``import torch_tpu`` and
calls ``torch_tpu._loader.load()`` before using device "tpu" and the "tpu_dist" process group.
torchtpu provides both, so this module only has to exist. It is served under the name
``torch_tpu`` only when ``TORCHTPU_TORCH_TPU_COMPAT=1`` is set (never by default), and only when
no other ``torch_tpu`` is importable: Google's own module always wins, and this one refuses to
load beside it.
"""
from __future__ import annotations

import importlib.machinery

if __name__ == "torch_tpu" and importlib.machinery.PathFinder.find_spec("torch_tpu") is not None:
    raise ImportError(
        "torchtpu's torch_tpu compatibility module refuses to load: another torch_tpu "
        "(Google's TorchTPU) is installed. Unset TORCHTPU_TORCH_TPU_COMPAT.")

import torch  # noqa: E402  (registers device "tpu" through torchtpu's autoload)

import torchtpu  # noqa: E402,F401

__all__ = ["_loader"]
IS_TORCHTPU_COMPAT = True
