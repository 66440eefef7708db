"""Decompositions the compile path adds to PyTorch's own, for ops PyTorch does not decompose.

Used by aot_autograd only for ops the lowering table does not cover (a lowering always wins):
- ``_foreach_<op>``: the per-tensor ``<op>`` over the lists (the optimizer's foreach kernels;
  inside one XLA program this loses nothing, XLA fuses the elementwise work anyway);
- ``full_like`` / ``empty_like``: ``full`` with the input's shape.
"""
from __future__ import annotations

import torch
from torch._ops import OpOverload

aten = torch.ops.aten


def _full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    return aten.full.default(list(self.shape), fill_value, dtype=dtype or self.dtype,
                             layout=layout or self.layout, device=device or self.device,
                             pin_memory=pin_memory)


def _empty_like(self, *, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    return _full_like(self, 0, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


_SPECIAL = {"norm": lambda t, ord=2, dtype=None: aten.linalg_vector_norm.default(t, ord, dtype=dtype)}


def _foreach(op: OpOverload):
    """The per-element decomposition of a functional ``_foreach_*`` overload, or None."""
    schema = op._schema
    base = schema.name.split("::", 1)[1]
    if not base.startswith("_foreach_") or schema.is_mutable:
        return None
    name = base[len("_foreach_"):]
    single = _SPECIAL.get(name)
    if single is None:
        packet = getattr(aten, name, None)
        if packet is None:
            return None
        kw_names = set()
        for ov in packet.overloads():
            for a in getattr(packet, ov)._schema.arguments:
                if a.kwarg_only:
                    kw_names.add(a.name)
        single = packet
    else:
        kw_names = set()
    arg_names = [a.name for a in schema.arguments]
    list_args = {a.name for a in schema.arguments
                 if str(a.type).startswith(("List[", "Tensor[]", "Tensor?[]")) or
                 str(a.type).endswith("[]")}
    scalar_list_kw = "value" if "value" in kw_names else None

    def decomp(*args, **kwargs):
        bound = dict(zip(arg_names, args))
        bound.update(kwargs)
        n = max(len(bound[k]) for k in list_args if k in bound and bound[k] is not None)
        outs = []
        for i in range(n):
            pos = []
            kw = {}
            for k in arg_names:
                if k not in bound:
                    continue
                v = bound[k]
                if k in list_args and v is not None:
                    v = v[i]
                if k in ("scalars", "scalar") and scalar_list_kw:
                    kw[scalar_list_kw] = v
                elif k in kw_names:
                    kw[k] = v
                else:
                    pos.append(v)
            outs.append(single(*pos, **kw))
        return outs

    return decomp


def extra_decompositions(has_lowering) -> dict:
    """{op: decomposition} for the ops above that have no lowering."""
    table = {}
    for op, fn in ((aten.full_like.default, _full_like), (aten.empty_like.default, _empty_like)):
        if not has_lowering(op):
            table[op] = fn
    for name in dir(aten):
        if not name.startswith("_foreach_") or name.endswith("_"):
            continue
        packet = getattr(aten, name)
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if has_lowering(op):
                continue
            d = _foreach(op)
            if d is not None:
                table[op] = d
    return table
