"""The lowering table: aten overload -> pure JAX function.

Contract for a lowering ``fn``:
- It is called with the aten op's arguments exactly as the dispatcher passes them to a kernel
  (positional arguments positionally, keyword-only arguments as keywords), except that every
  Tensor is replaced by a ``jax.Array`` already shaped like the tensor (views resolved), and
  every ``Tensor[]`` / ``Tensor?[]`` by a list of arrays (``None`` kept).
- Every other argument (ints, floats, bools, dtypes, int lists, strings, ...) arrives as the
  plain Python value and is static: it is part of the compile-cache key, so the lowering may
  branch on it.
- It returns what the op returns: one array, or a tuple/list of arrays, with PyTorch's dtypes
  (see ``_util.result_type``) and shapes. It never syncs, never sees a torch.Tensor, and never
  branches on array data, so jax.jit can trace it.
- Registered on a functional overload (``add.Tensor``), it also serves the in-place
  (``add_.Tensor``) and ``out=`` (``add.out``) overloads: the executors derive those.
  Registered directly on an in-place overload (``uniform_``), it returns the new value of
  ``self``. Registered on an ``out=`` overload, it returns the values of the out tensors.

Flags (the executors read them; no op is special-cased inside an executor):
- ``random``: fn(key, *args, **kwargs) receives a fresh ``jax.random`` key first; the op's
  ``generator`` argument is removed. It may also be a predicate ``(args, kwargs) -> bool`` over
  the op's own arguments (their static values: a dropout probability), for ops random only for
  some calls: a call for which it is false draws nothing from the generator (its state is left
  as is) and its lowering receives ``None`` as the key (``Lowering.draws``).
- ``dynamic_shape``: output shape depends on data; run un-jitted on concrete arrays, counted as
  a host sync.
  It may also be a predicate ``(args, kwargs) -> bool`` over the op's own (torch) arguments, for
  ops whose shape is data-dependent only for some inputs (indexing with boolean masks).
- View ops (schema returns a non-writing alias: ``view``, ``permute``, ``select``...) may have
  lowerings too (a reshape, a transpose): the graph executors (compile, fused) use them; eager
  never binds them, because an eager view must alias its base (PyTorch's metadata kernels).
- ``scalar_args``: names of float/int arguments passed as traced 0-d values instead of static
  ones, so changing them (a learning rate) does not recompile.
- ``mutates``: names of arguments the op writes although its schema does not say so
  (``native_batch_norm`` updates ``running_mean``/``running_var``). The lowering returns the op's
  results followed by the new value of each named argument (``None``: leave it as is); the
  executors write those values back and return only the op's results.

- ``writes``: for a lowering registered on an in-place overload that writes several arguments
  (the fused optimizers' ``_fused_adamw_``: parameters, states, and the gradients when it
  unscales them): the names of the arguments it writes, or a function ``(args, kwargs) ->
  names`` of the static arguments. The lowering returns the new value of every tensor of those
  arguments, in that order, flattened into one list; the executors write each into its storage
  (donating the old array where nothing else holds it). Default: ``self`` only.
- ``check``: ``(fn, exception type, message)``. ``fn`` takes the lowering's arguments and returns
  a boolean 0-d array, True when the inputs are valid (indices in range): a condition that PyTorch
  checks on the host but that needs the data. Every executor computes it in the op's program
  (Strict: the op's own; Fused and compiled: the graph's) and raises at the next host sync (at
  once in Debug mode), as CUDA reports a device-side assert; see ``eager/checks.py``.
- ``reads_layout``: the op's meaning depends on how its first tensor argument lies in its
  storage (``as_strided`` addresses storage elements), which an array value does not carry. Every
  executor passes ``layout=(strides, storage_offset)`` of that tensor as PyTorch has it (eager:
  the tensor's; compiled: its FakeTensor's), a static argument.
- ``graph_only``: the lowering serves the graph executors (compile, export) only; eager keeps
  PyTorch's own kernel (``_to_copy`` moves between devices there, ``full_like`` may name
  another device, ``_assert_tensor_metadata`` checks on the host).

Non-array results (a ``SymInt`` return such as ``max_q`` of the fused attention ops) are Python
values computed from static information (shapes): the lowering returns them as Python ints.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import torch
from torch._ops import OpOverload, OpOverloadPacket


@dataclass(eq=False)
class Lowering:
    op: OpOverload
    fn: Callable
    random: object = False  # bool, or a predicate (args, kwargs) -> bool; see ``draws``
    dynamic_shape: object = False  # bool, or a predicate (args, kwargs) -> bool
    scalar_args: tuple = ()
    mutates: tuple = ()
    check: tuple | None = None  # (fn, exception type, message), see the module docstring
    reads_precision: bool = False  # traces differently per ``matmul_precision()``: in the keys
    reads_layout: bool = False
    meta: dict = field(default_factory=dict)
    graph_only: bool = False
    writes: object = ()  # names, or (args, kwargs) -> names; () is ("self",)
    # positions of the schema's ``Tensor`` arguments: a Python number there is a wrapped
    # number (``x * lr``), which the executors pass as a traced scalar (set after init)
    wrapped_pos: tuple = ()

    def __post_init__(self):
        try:
            self.wrapped_pos = tuple(i for i, a in enumerate(self.op._schema.arguments)
                                     if not a.kwarg_only and str(a.type) == "Tensor")
        except AttributeError:  # not an OpOverload (tests register stand-ins)
            self.wrapped_pos = ()

    def draws(self, args, kwargs) -> bool:
        """Whether this call takes a key from the generator (registry flag ``random``). A
        lowering with a ``random`` flag always receives a key argument first: ``None`` for a
        call that draws nothing."""
        r = self.random
        if r is False or r is True:
            return r
        return bool(r(args, kwargs))

    @property
    def name(self) -> str:
        return str(self.op)


LOWERINGS: dict[OpOverload, Lowering] = {}

# aten ops named by a lowering module that this torch does not have (see ``aten``)
MISSING_OPS: set[str] = set()
# ops that some supported torch releases lack: torch 2.14 removed aten.cholesky and added
# linalg_matrix_sqrth and linalg_polar. tests/test_ops_across_torch_versions.py keeps
# MISSING_OPS inside this set, so a misspelt op name cannot hide behind the leniency.
VERSION_DEPENDENT_OPS = frozenset({"cholesky", "linalg_matrix_sqrth", "linalg_polar"})


class _MissingOp:
    """An aten op this torch lacks: any attribute (``.default``) is itself, and ``register``
    skips it."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self

    def __repr__(self):
        return f"<aten.{self.name}: not in this torch>"


class _Aten:
    """``torch.ops.aten`` for the lowering modules, except that an op this torch lacks is a
    ``_MissingOp`` instead of an AttributeError. A lowering module runs at import, and an
    import error there fails ``import torch`` itself (the autoload entry point)."""

    def __getattr__(self, name):
        try:
            return getattr(torch.ops.aten, name)
        except AttributeError:
            if name.startswith("__"):
                raise
            MISSING_OPS.add(name)
            return _MissingOp(name)


aten = _Aten()


def _overloads(op) -> list[OpOverload]:
    if isinstance(op, OpOverload):
        return [op]
    if isinstance(op, OpOverloadPacket):
        out = []
        for name in op.overloads():
            ov = getattr(op, name)
            schema = ov._schema
            if schema.is_mutable:
                continue  # in-place / out= overloads are derived by the executors
            out.append(ov)
        return out
    raise TypeError(f"cannot register a lowering for {op!r}")


def register(*ops, random=False, dynamic_shape=False, scalar_args=(), mutates=(),
             check=None, reads_precision=False, reads_layout=False, graph_only=False, writes=()):
    """Decorator: register ``fn`` as the lowering of each op.

    An ``OpOverload`` registers that overload; an ``OpOverloadPacket`` registers all of its
    functional overloads (so ``fn`` must accept each of their signatures).
    """

    def deco(fn):
        for op in ops:
            if isinstance(op, _MissingOp):
                continue
            for ov in _overloads(op):
                LOWERINGS[ov] = Lowering(ov, fn, random, dynamic_shape, tuple(scalar_args),
                                         tuple(mutates), check, reads_precision,
                                         reads_layout, graph_only=graph_only,
                                         writes=writes)
        return fn

    return deco


def matmul_precision() -> str:
    """The float32 matmul precision lowerings use now: "highest", "high" or "default".

    ``torch.set_float32_matmul_precision("high"/"medium")`` asks for "high"/"default" (as
    CUDA allows TF32 for them); else ``torch.tpu.precision(p)`` (JAX's default matmul
    precision) decides; else "highest", true float32 like PyTorch's CPU kernels. Lowerings
    registered with ``reads_precision`` are cached per value, so a change applies to the
    next op, fused graph or compiled call.
    """
    p = torch.get_float32_matmul_precision()
    if p != "highest":
        return "high" if p == "high" else "default"
    j = jax.config.jax_default_matmul_precision
    j = str(j).lower() if j is not None else "highest"
    return j if j in ("highest", "high", "default") else "highest"


def get(op: OpOverload) -> Lowering | None:
    return LOWERINGS.get(op)
