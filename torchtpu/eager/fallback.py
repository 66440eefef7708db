"""CPU fallback for ops without a lowering: correct, counted, warned once per op.

View ops (schema returns a non-writing alias) are not computed here: they get PyTorch's own
metadata kernel, so they stay real views.
"""
from __future__ import annotations

import os
import warnings

import torch

from ..runtime.metrics import count
from . import copy as _copy
from . import rng as _rng
from .dynamo_skip import skip

_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_state = {"enabled": os.environ.get("TORCHTPU_CPU_FALLBACK", "1") not in ("0", "false", "False")}
_warned: set = set()
_CPU = torch.device("cpu")


def enabled() -> bool:
    return _state["enabled"]


def set_enabled(flag: bool) -> None:
    _state["enabled"] = bool(flag)


def _is_view(schema) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _to_cpu(x, dev_box):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        if dev_box[0] is None:
            dev_box[0] = x.device
        c = _copy.device_to_host(_copy.value_of(x))
        if c.dtype != x.dtype:
            c = c.view(x.dtype) if c.element_size() == x.element_size() else c.to(x.dtype)
        return c.reshape(x.shape).clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(e, dev_box) for e in x)
    if isinstance(x, torch._C.Generator):  # a tpu generator's draws follow its seed
        return _rng.cpu_generator_for(x)
    if isinstance(x, torch.device) and x.type == "tpu":
        if dev_box[0] is None:
            dev_box[0] = x
        return _CPU
    return x


def _to_tpu(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_tpu(e, device) for e in x)
    return x


def no_lowering_error(op) -> NotImplementedError:
    return NotImplementedError(
        f"Could not run '{op._schema.name}.{op._overloadname}' on the 'tpu' backend: it has no "
        "lowering and the CPU fallback is disabled (torch.tpu.enable_cpu_fallback = False).")


_active_decomps: set = set()


def _decomposition(op):
    """PyTorch's registered decomposition of ``op`` (runs as tpu ops), or None."""
    if op in _active_decomps:
        return None  # a decomposition that re-enters its own op: fall back instead
    return _decompositions().get(op)


_table = []


def _decompositions():
    if not _table:
        from torch._decomp import decomposition_table

        _table.append(decomposition_table)
    return _table[0]


@skip
def fallback(op, *args, **kwargs):
    """Boxed PrivateUse1 fallback: metadata view, else decomposition, else CPU."""
    schema = op._schema
    if _is_view(schema):
        return op._handle.redispatch_boxed(_CPU_KEYS, *args, **kwargs)
    decomp = _decomposition(op)
    if decomp is not None:
        count("decompositions", op=f"{schema.name}.{op._overloadname}")
        _active_decomps.add(op)
        try:
            return decomp(*args, **kwargs)
        finally:
            _active_decomps.discard(op)
    if not _state["enabled"]:
        raise no_lowering_error(op)
    name = f"{schema.name}.{op._overloadname}"
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"torchtpu: {name} has no lowering; running it on CPU (slow). "
                      "This is counted in torch.tpu.metrics()['per_op']['cpu_fallbacks'].",
                      stacklevel=2)
    count("cpu_fallbacks", op=name)
    dev_box = [None]
    cargs = _to_cpu(args, dev_box)
    ckwargs = {k: _to_cpu(v, dev_box) for k, v in kwargs.items()}
    device = dev_box[0] or torch.device("tpu", 0)
    out = op(*cargs, **ckwargs)
    # write mutated arguments back
    results_alias = {}
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        orig = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name, args[i] if i < len(args) else None)
        new = cargs[i] if i < len(cargs) and not a.kwarg_only else ckwargs.get(a.name)
        if isinstance(orig, torch.Tensor) and orig.device.type == "tpu":
            if tuple(new.shape) != tuple(orig.shape):
                _copy.resize(orig, list(new.shape))
            _copy.copy_(orig, new)
            results_alias[id(new)] = orig
        elif isinstance(orig, (list, tuple)):
            for o, n in zip(orig, new):
                if isinstance(o, torch.Tensor) and o.device.type == "tpu":
                    _copy.copy_(o, n)
                    results_alias[id(n)] = o

    def back(x):
        if isinstance(x, torch.Tensor):
            o = results_alias.get(id(x))
            return x.to(device) if o is None else o
        if isinstance(x, (list, tuple)):
            return type(x)(back(e) for e in x)
        return x

    return back(out)
