"""SGLang's collective custom ops inside compiled programs on "tpu".

Under ``torch.compile`` SGLang's ``GroupCoordinator.all_reduce`` emits its own custom op,
``sglang::inplace_all_reduce(tensor, group_name)`` (a mutable op: the sum is written into
``tensor``), and its all-gather (the logits), ``sglang::reg_all_gather_into_tensor(output,
input, group_name)``, where ``group_name`` is SGLang's name of the group (``tp:0``), not a
torch.distributed one. ``install()`` gives those ops lowerings in torchtpu's table: the
all-reduce over the mesh axis of the ``tpu_dist`` process group behind SGLang's group (its
``device_group``), the lowering of ``_c10d_functional.all_reduce`` (distributed/
functional.py; for the gather, ``all_gather_into_tensor``'s), so a tensor-parallel decode or prefill program holds its all-reduces and
every rank runs the same one SPMD program (compile/spmd.py). Eager calls keep SGLang's own
implementation (``torch.distributed.all_reduce`` on that group).
"""
from __future__ import annotations

import logging

import torch

from ..distributed import functional
from ..lowering import registry

logger = logging.getLogger(__name__)


def _c10d_group(sglang_group: str) -> str:
    from sglang.srt.distributed.parallel_state import _groups

    ref = _groups.get(sglang_group)
    group = ref() if ref is not None else None
    if group is None:
        raise RuntimeError(f"sglang::inplace_all_reduce: SGLang group {sglang_group!r} is "
                           f"not alive in this process")
    return group.device_group.group_name


def _low_inplace_all_reduce(tensor, group_name):
    """The new value of ``tensor``: its sum over the group."""
    return functional._low_all_reduce(tensor, "sum", _c10d_group(group_name))


def _low_all_gather_into(output, input, group_name):
    """The new value of ``output``: the group's ``input`` blocks stacked along dim 0."""
    c10d = _c10d_group(group_name)
    return functional._low_all_gather(input, None, c10d).reshape(output.shape)


def _mesh(group_name):
    return functional._mesh_fact(_c10d_group(group_name))


# SGLang's op -> (its argument names, lowering)
_OPS = {"inplace_all_reduce": (["tensor", "group_name"], _low_inplace_all_reduce),
        "reg_all_gather_into_tensor": (["output", "input", "group_name"],
                                       _low_all_gather_into)}


def install() -> bool:
    """Register the lowerings (idempotent); False, with a warning, where SGLang has no such
    op (its name or schema moved)."""
    ok = True
    for name, (args, fn) in _OPS.items():
        op = getattr(getattr(torch.ops, "sglang", None), name, None)
        overload = getattr(op, "default", None) if op is not None else None
        names = [a.name for a in overload._schema.arguments] if overload is not None else None
        if names != args:
            logger.warning("torchtpu: sglang::%s(%s) not found (%s): tensor-parallel programs "
                           "are not compiled", name, ", ".join(args), names)
            ok = False
            continue
        if registry.get(overload) is None:
            registry.register(overload, graph_only=True)(fn)
            registry.LOWERINGS[overload].meta["mesh"] = ("group_name", _mesh)
    return ok
