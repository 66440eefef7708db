"""Make PyTorch believe in device "tpu": rename PrivateUse1, hooks, guard, module, kernels."""
from __future__ import annotations

import torch
import torch.utils.backend_registration as _br

_done = [False]


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, device_index) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


def _keep_dynamo_out() -> None:
    """C++ calls the hooks and the guard from inside compiled frames too (after a graph
    break): Dynamo must not try to trace them."""
    from ..eager.dynamo_skip import skip

    for cls in (_Hooks, _Guard):
        for fn in vars(cls).values():
            if callable(fn):
                skip(fn)


def _count_devices_in_the_guard(fastpath) -> None:
    """Once the backend exists, the C++ guard answers torch.tpu's device count (the autograd
    engine sizes its per-device queues by it)."""
    from ..runtime import devices as _devices

    def tell(devs=None):
        fastpath.set_device_count(_devices.visible_device_count())

    if _devices.backend_created():
        tell()
    else:
        _devices.after_backend.append(tell)


def register() -> None:
    """Idempotent: set up the device, bind the lowering table and runtime kernels."""
    if _done[0]:
        return
    _done[0] = True
    from . import tpu_module

    _keep_dynamo_out()
    _br._setup_privateuseone_for_python_backend("tpu", tpu_module, _Hooks(), _Guard())

    from .. import lowering  # noqa: F401  (fills the table)
    from ..eager import fallback, kernels

    kernels.bind_runtime()
    kernels.bind_table()
    from ..eager import fastpath

    fastpath.native_guard()  # the guard's type/device in C++ (the Python _Guard behind it)
    _count_devices_in_the_guard(fastpath)
    from ..eager import fused

    fused.install()
    global _fallback_lib
    _fallback_lib = torch.library.Library("_", "IMPL")
    _fallback_lib.fallback(fallback.fallback, "PrivateUse1")
    # autocast: let ops fall through (DESIGN fact 7); rules come from the autocast module
    _fallback_lib.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")

    from . import extras

    extras.install(tpu_module)
    from . import module_apply

    module_apply.install()  # module.to("tpu") keeps Parameter objects (weight tying)
    from . import set_data

    set_data.install()
    from . import meta_overrides

    meta_overrides.install()  # fake kernels that state CUDA's limits for every device  # param.data = t between "cpu" and "tpu"
