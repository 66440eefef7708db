"""DistributedDataParallel over tpu parameters with ``find_unused_parameters=True`` or
``static_graph=True``.

Both make PyTorch's C++ Reducer stage its used-parameter map through pinned host memory, which
it gets from the PrivateUse1 hooks; torchtpu's Python hooks cannot provide it, so the C++ hooks
of ``device/native.py`` are installed (built once, cached on disk) before the Reducer can need
them. Everything else is PyTorch's own DDP, unchanged.
"""
from __future__ import annotations

import functools

_done = [False]


def _on_tpu(ddp) -> bool:
    return getattr(ddp, "device_type", None) == "tpu"


def install() -> None:
    if _done[0]:
        return
    _done[0] = True
    from torch.nn.parallel import distributed as ddp_mod

    DDP = ddp_mod.DistributedDataParallel
    orig_init_helper = DDP._ddp_init_helper
    orig_set_static_graph = DDP._set_static_graph

    @functools.wraps(orig_init_helper)
    def _ddp_init_helper(self, parameters, expect_sparse_gradient, param_to_name_mapping,
                         static_graph, *args, **kwargs):
        # before the Reducer exists, so that a build error leaves no half-made DDP
        if _on_tpu(self) and (self.find_unused_parameters or static_graph):
            from ..device import native

            native.install_pinned_hooks()
        return orig_init_helper(self, parameters, expect_sparse_gradient,
                                param_to_name_mapping, static_graph, *args, **kwargs)

    @functools.wraps(orig_set_static_graph)
    def _set_static_graph(self):  # also reachable after construction (a private API)
        if _on_tpu(self):
            from ..device import native

            native.install_pinned_hooks()
        return orig_set_static_graph(self)

    DDP._ddp_init_helper = _ddp_init_helper
    DDP._set_static_graph = _set_static_graph
