"""VeRL's Ray resource check, counting the platform's accelerator resource ("TPU").

VeRL places its workers with the platform's Ray resource (``ray_resource_name``: "TPU" here,
Ray's own name for TPU chips, which Ray detects on TPU hosts; elsewhere ``ray.init(resources=
{"TPU": n})``, i.e. ``+ray_kwargs.ray_init.resources={TPU:n}``). But before it builds its
placement groups, ``ResourcePoolManager._check_resource_available`` counts only "GPU" or "NPU"
per node, so a cluster of TPU chips reads as none. On "tpu" the same check counts "TPU".
"""
from __future__ import annotations

import functools

from ..integrations import patch, when_imported

MODULE = "verl.single_controller.ray.base"


def _wrap(orig):
    @functools.wraps(orig)
    def _check_resource_available(self, *args, **kwargs):
        from verl.plugin.platform import get_platform

        name = get_platform().ray_resource_name()
        if name in ("GPU", "NPU"):
            return orig(self, *args, **kwargs)
        import ray

        per_node = ray._private.state.available_resources_per_node()
        available = sum(info.get(name, 0) for info in per_node.values())
        required = sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
        if available < required:
            raise ValueError(f"Total available {name}s {available} is less than total desired "
                             f"{name}s {required}")

    return _check_resource_available


def install() -> None:
    when_imported(MODULE, lambda m: patch(m, "ResourcePoolManager._check_resource_available",
                                          _wrap))
