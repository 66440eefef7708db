"""``torch.tpu.ops``: kernels that PyTorch has no aten op for, as torch custom ops.

TorchTPU's names where it has them (``splash_sdpa``, ``ragged_dot``, a paged attention op...).
Each op is a ``torch.library`` custom op in the ``tpu`` namespace (``torch.ops.tpu.<name>``)
with a fake kernel (so Dynamo, FakeTensor and torch.export see it), autograd where it applies,
and a lowering in the one table (``lowering/``), so it runs in Strict, Fused and compiled mode
without a CPU fallback. On TPU/GPU a lowering may pick the Pallas kernel that JAX ships; the
portable JAX lowering runs everywhere else.

One module per op family; every public name a module lists in ``__all__`` is re-exported here
(modules are found on the package path, so adding a family edits nothing else).
"""
import importlib as _importlib
import pkgutil as _pkgutil

__all__: list = []



def _load_families() -> None:
    for m in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if m.name.startswith("_"):
            continue
        mod = _importlib.import_module(f"{__name__}.{m.name}")
        for name in getattr(mod, "__all__", ()):
            globals()[name] = getattr(mod, name)
            __all__.append(name)


_load_families()
