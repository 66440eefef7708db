"""Dynamo-friendly twins of the ``msgspec.Struct`` records SGLang builds inside every layer.

SGLang 0.5.23's layer-boundary code (``sglang.srt.layers.layer_boundary``) creates small
records on each layer call: the residual stream's ``Contribution`` (mutable), its
``OwedOutput`` handle, ``DeclaredSum`` (tensor parallel) and the FFN exit's ``ExitDecision``.
They are ``msgspec.Struct`` classes, whose C-level ``__new__`` Dynamo cannot replay
("object.__new__(Contribution) is not safe") nor whose ``__setattr__`` it can trace: each one
is a graph break, and one inside the model's loop over its layers makes Dynamo skip the
whole frame, so a compiled decode program ran most of the model as eager ops.

``install()`` (the platform's ``plugin()``, before any model is built) replaces each of those
classes, in the module that defines it and wherever SGLang's modules imported it, by a plain
Python class with the same fields (in order, with the same defaults), the same methods, and
``__struct_fields__`` for code that reads field names: Dynamo traces a plain class's
construction and attribute writes into the graph. Nothing else changes: the records never
leave a forward, and none of them is passed to ``msgspec`` functions on the paths a
platform without speculative capture runs. A target is replaced only if it is where and what
this module expects (the module, the class, a ``msgspec.Struct`` with the expected fields);
otherwise it is left alone with a warning naming it (the compiled programs then keep that
graph break, and ``graph_runner`` reports it).
"""
from __future__ import annotations

import importlib
import logging
import sys
import types

logger = logging.getLogger(__name__)

_LB = "sglang.srt.layers.layer_boundary"
# (module, class, its fields in order): what SGLang 0.5.23 defines
TARGETS = (
    (f"{_LB}.residual.stream", "Contribution", ("value", "update", "owed")),
    (f"{_LB}.residual.stream", "OwedOutput", ("contribution",)),
    (f"{_LB}.residual.stream", "DeclaredSum", ("group", "complete_sum")),
    (f"{_LB}.exit", "ExitDecision", ("defer_moe_finalize", "sum_in_reduce_scatter",
                                     "complete")),
    # tensor parallel: an FFN output whose sum the next boundary completes
    (f"{_LB}.output", "UnreducedOutput", ("partial", "group", "reduce_to_dp_local",
                                          "complete_sum")),
)

_installed: dict = {}  # "module.Class" -> (original, twin)
_skipped: dict = {}    # "module.Class" -> why


def _twin(cls) -> type:
    """A plain class with ``cls``'s fields, defaults and methods."""
    fields = tuple(cls.__struct_fields__)
    defaults = tuple(cls.__struct_defaults__)
    first_default = len(fields) - len(defaults)
    params = ", ".join(f + (f"=_d{i - first_default}" if i >= first_default else "")
                       for i, f in enumerate(fields))
    body = "".join(f"    self.{f} = {f}\n" for f in fields) or "    pass\n"
    if hasattr(cls, "__post_init__"):
        body += "    self.__post_init__()\n"
    ns = {f"_d{i}": d for i, d in enumerate(defaults)}
    exec(f"def __init__(self, {params}):\n{body}", ns)  # noqa: S102 (generated from fields)
    attrs = {"__init__": ns["__init__"], "__struct_fields__": fields,
             "__struct_defaults__": defaults, "__module__": cls.__module__,
             "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
             "__torchtpu_twin_of__": cls}
    for name, value in cls.__dict__.items():
        if name.startswith("__struct") or name in attrs or name in (
                "__slots__", "__annotations__", "__weakref__", "__dict__",
                "__match_args__", "__rich_repr__", "__copy__", "__replace__"):
            continue
        if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
            continue  # msgspec's field slots
        attrs[name] = value

    def __eq__(self, other):  # msgspec's: field by field (a tensor field: the same tensor)
        if type(other) is not type(self):
            return NotImplemented
        for f in fields:
            a, b = getattr(self, f), getattr(other, f)
            if a is not b and (type(a).__module__.startswith("torch") or not a == b):
                return False
        return True

    def __repr__(self):
        return f"{cls.__name__}(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in fields) + ")"

    attrs.setdefault("__eq__", __eq__)
    attrs["__hash__"] = None if not cls.__struct_config__.frozen else (
        lambda self: hash(tuple(getattr(self, f) for f in fields)))
    attrs.setdefault("__repr__", __repr__)
    return type(cls.__name__, (object,), attrs)


def install() -> dict:
    """Replace the targets (idempotent); ``{"installed": [...], "skipped": {...}}``."""
    try:
        import msgspec
    except ImportError:  # SGLang always has it; without it, nothing to replace
        return report()
    for modname, clsname, fields in TARGETS:
        key = f"{modname}.{clsname}"
        if key in _installed or key in _skipped:
            continue
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:
            _skipped[key] = f"module not importable ({e})"
            continue
        cls = getattr(mod, clsname, None)
        if cls is None:
            _skipped[key] = "class not found"
        elif not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            _skipped[key] = f"not a msgspec.Struct ({cls!r})"
        elif tuple(cls.__struct_fields__) != fields:
            _skipped[key] = f"fields {cls.__struct_fields__} are not the expected {fields}"
        else:
            _installed[key] = (cls, _twin(cls))
    _quiet_deprecated_getters()
    for key, why in _skipped.items():
        logger.warning("torchtpu: SGLang's %s left as is (%s): compiled programs keep a "
                       "graph break there", key, why)
    rebind()
    return report()


def _quiet_deprecated_getters() -> None:
    """SGLang's deprecated parallel-size getters (``get_tensor_model_parallel_world_size``
    ...) look at their caller's frame (``sys._getframe``, which Dynamo cannot trace) on every
    call until they have warned once; the models call them inside the forward. They are
    marked as having warned (the deprecation warning is not printed on "tpu")."""
    ps = sys.modules.get("sglang.srt.distributed.parallel_state")
    if ps is None:
        try:
            ps = importlib.import_module("sglang.srt.distributed.parallel_state")
        except ImportError:
            return
    warned, names = getattr(ps, "_ALREADY_WARNED", None), getattr(ps, "_CONTEXT_NAME_OF", None)
    if isinstance(warned, set) and isinstance(names, dict):
        warned.update(names)
    else:
        _skipped["parallel_state._ALREADY_WARNED"] = "not the expected set and dict"


def rebind() -> int:
    """Point every SGLang module's global bound to an original at its twin; how many."""
    swap = {id(orig): twin for orig, twin in _installed.values()}
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("sglang") or mod is None:
            continue
        d = getattr(mod, "__dict__", None)
        if not d:
            continue
        for k, v in list(d.items()):
            twin = swap.get(id(v))
            if twin is not None:
                d[k] = twin
                n += 1
    return n


def report() -> dict:
    return {"installed": sorted(_installed), "skipped": dict(_skipped)}
