"""``torch.tpu.compiler``: the compile backend's user-facing knobs (TorchTPU's names)."""
from .options import custom_compiler_options, get_custom_compiler_options  # noqa: F401
from .options import set_dynamic_buckets  # noqa: F401


def backend(gm, example_inputs, **kwargs):
    """The Dynamo backend itself (``torch.compile(model, backend=torch.tpu.compiler.backend)``)."""
    from .backend import tpu_backend

    return tpu_backend(gm, example_inputs, **kwargs)


def cache_dir():
    """The persistent compile-cache directory (None when disabled)."""
    from .cache import cache_dir as _d

    return _d()


__all__ = ["custom_compiler_options", "get_custom_compiler_options", "backend", "cache_dir",
           "set_dynamic_buckets"]
