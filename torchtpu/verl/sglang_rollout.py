"""VeRL's SGLang rollout (``actor_rollout_ref.rollout.name=sglang``) on "tpu".

VeRL imports SGLang lazily, in whichever process first asks for its SGLang replica class (the
trainer's driver actor included), and does it with ``SGLANG_USE_CPU_ENGINE=1`` set for the
import (``verl.workers.rollout.replica._load_sglang``): that selects SGLang's CPU engine, whose
modules import its C++ CPU kernels (``sgl_kernel``), and tells torchtpu's SGLang platform
that SGLang has a device of its own. On "tpu" the loader imports SGLang for the "tpu" platform
instead (``SGLANG_PLATFORM=tpu``, SGLang's own selector, unless the user named another); the
rollout servers' processes get the same variable from ``PlatformTPU.rollout_env_vars``.
"""
from __future__ import annotations

import functools
import os

from ..integrations import patch, when_imported

MODULE = "verl.workers.rollout.replica"


def _wrap(orig):
    @functools.wraps(orig)
    def _load_sglang():
        from verl.plugin.platform import get_platform

        if get_platform().device_name != "tpu":
            return orig()
        os.environ.setdefault("SGLANG_PLATFORM", "tpu")
        from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangReplica

        return SGLangReplica

    return _load_sglang


def _install(module) -> None:
    if patch(module, "_load_sglang", _wrap):
        # the registry holds the loader itself, registered when the module ran
        registry = getattr(module, "RolloutReplicaRegistry", None)
        if registry is not None and "sglang" in getattr(registry, "_registry", {}):
            registry.register("sglang", module._load_sglang)


def install() -> None:
    when_imported(MODULE, _install)
