"""``torch_tpu._loader``: ``load()`` as Google's TorchTPU names it; here the device and the
"tpu_dist" process group are registered when torch is imported, so it only checks that."""
from __future__ import annotations


def load() -> None:
    """Make device "tpu" and the "tpu_dist" process group available (already done at import)."""
    import torch

    import torchtpu  # noqa: F401

    if not hasattr(torch, "tpu"):
        raise RuntimeError("torchtpu did not register device 'tpu'")


def _init_device(name: str = "tpu") -> None:
    if name != "tpu":
        raise ValueError(f"Expected device 'tpu', but got: {name!r}")
    load()
