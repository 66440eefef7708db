"""Activation layouts in the verification's train step: sequence parallelism, loss parallelism
and ``sp_regather`` lowered as the applied plan runs them.

``verify.py`` compiles each candidate as one global SPMD program; the parameter, optimizer-state
and batch shardings alone let XLA's partitioner choose every activation's layout, which for a TP
plan is TP's (activations replicated over tp). What ``apply`` adds on top -- the residual stream
sharded on the sequence between the TP blocks, the head's logits left sharded on the vocabulary
for the loss, each block's gathered input saved as its sequence slice and gathered again in
backward -- is put into the traced step by one custom op, ``tpu_autopar::layout(x, fwd, bwd)``,
called from module hooks while ``trace_step`` traces the model (``markers``):

- ``fwd``: ``;``-separated steps applied to ``x`` in order: a sharding spec
  ``"DPxTP:a,b,..."`` (the candidate's mesh shape, then per dimension ``dp``, ``tp`` or ``_``)
  lowers to ``jax.lax.with_sharding_constraint`` on an abstract ("dp", "tp") mesh of that shape
  (the exported program carries it; the worker's concrete mesh of the same shape takes it);
  a second op, ``tied(x, tie, fwd)``, makes ``x`` depend on ``tie`` first (``sp_regather``'s
  gather in backward, tied to the gradient reaching the block).
- ``bwd``: the steps applied to its gradient (the gradient of "sharded on the sequence, then
  gathered" is "sharded on the sequence": XLA reduce-scatters it, as the applied plan's
  ``PrepareModuleInput`` backward does).

The ops exist only in these traces (``graph_only`` lowerings; a CPU kernel that copies, for
completeness).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ...lowering import registry as _registry

_lib = torch.library.Library("tpu_autopar", "FRAGMENT")
_lib.define("layout(Tensor x, str fwd, str bwd) -> Tensor")
_lib.define("tied(Tensor x, Tensor tie, str fwd) -> Tensor")


def _cpu(x, fwd, bwd):
    return x.clone()


def _cpu_tied(x, tie, fwd):
    return x.clone()


_lib.impl("layout", _cpu, "CPU")
_lib.impl("tied", _cpu_tied, "CPU")


@torch.library.register_fake("tpu_autopar::layout")
def _fake(x, fwd, bwd):
    return torch.empty_like(x)


@torch.library.register_fake("tpu_autopar::tied")
def _fake_tied(x, tie, fwd):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.bwd = inputs[2]


def _backward(ctx, grad):
    if not ctx.bwd:
        return grad, None, None
    return torch.ops.tpu_autopar.layout(grad, ctx.bwd, ""), None, None


torch.library.register_autograd("tpu_autopar::layout", _backward, setup_context=_setup)


def _lower(x, fwd, bwd):
    import jax
    from jax.sharding import AbstractMesh, AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    for step in filter(None, fwd.split(";")):
        shape, dims = step.split(":")
        dp, tp = (int(v) for v in shape.split("x"))
        mesh = AbstractMesh((dp, tp), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
        spec = P(*[None if a == "_" else a for a in dims.split(",")])
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return x


def _lower_tied(x, tie, fwd):
    """``x`` made to depend on ``tie`` (``x + 0 * tie``, elementwise where the shapes agree
    -- no communication --, else with its first element: XLA folds no float product with
    zero, NaN semantics), then the ``fwd`` steps. XLA:CPU expands
    ``optimization_barrier`` before it schedules, so a barrier cannot keep a gather in
    backward; this data dependency on the gradient does."""
    if tie.shape == x.shape:  # the block's stream in and out: same shape and sharding
        z = (tie * 0).astype(x.dtype)
    else:
        z = (tie.reshape(-1)[0] * 0).astype(x.dtype)
    return _lower(x + z, fwd, "")


_registry.register(torch.ops.tpu_autopar.layout.default, graph_only=True)(_lower)
_registry.register(torch.ops.tpu_autopar.tied.default, graph_only=True)(_lower_tied)


def _spec(plan, t: torch.Tensor, kind: str) -> str:
    """The step for ``t``: ``seq`` (batch over dp, sequence over tp), ``rep`` (batch over dp,
    the rest whole), ``vocab`` (batch over dp, the last dimension over tp); a dimension that
    does not divide stays whole."""
    dims = ["_"] * t.dim()
    if t.dim() and plan.dp > 1 and t.shape[0] % plan.dp == 0:
        dims[0] = "dp"
    if kind == "seq" and t.dim() >= 2 and t.shape[1] % plan.tp == 0:
        dims[1] = "tp"
    if kind == "vocab" and t.dim() >= 2 and t.shape[-1] % plan.tp == 0:
        dims[-1] = "tp"
    return f"{plan.dp}x{plan.tp}:" + ",".join(dims)


def _layout(plan, t, fwd: list, bwd: list):
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 2:
        return t
    f = ";".join(_spec(plan, t, s) for s in fwd)
    b = ";".join(_spec(plan, t, s) for s in bwd)
    return torch.ops.tpu_autopar.layout(t, f, b)


def lowered(plan) -> list:
    """What of the plan's activation layouts its verification program carries."""
    if not needs_layouts(plan):
        return []
    return [n for n, on in (("sequence parallel", plan.sequence_parallel),
                            ("loss parallel", plan.loss_parallel),
                            ("block inputs regathered",
                             plan.sequence_parallel and plan.sp_regather)) if on]


def needs_layouts(plan) -> bool:
    """Whether the plan's activations are laid out other than its parameters imply (SP, loss
    parallelism): such a candidate is traced and exported with its own markers."""
    return plan.tp > 1 and (plan.sequence_parallel or plan.loss_parallel)


class _Regather:
    """While a block's forward runs: every tensor autograd saves that lives in the block's
    gathered input (the colwise layers' views of it) is saved as the sequence-sharded input,
    and in backward gathered again and viewed the same way. The gather is made in the
    backward of the block's output mark (``_OutMark``), tied to the gradient arriving there,
    so that XLA cannot schedule it in forward next to the first gather (it does, untied)."""

    def __init__(self, plan, shard, full):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.plan, self.shard, self.full = plan, shard, full
        self.ref = StorageWeakRef(full.untyped_storage())
        self.gathered = None

    def pack(self, t):
        from torch.multiprocessing.reductions import StorageWeakRef

        if t.dtype != self.full.dtype or StorageWeakRef(t.untyped_storage()) != self.ref:
            return t
        return ("regather", self, (tuple(t.shape), t.stride(), t.storage_offset()))

    def unpack(self, p):
        if not (isinstance(p, tuple) and len(p) == 3 and p[0] == "regather"):
            return p
        if self.gathered is None:  # one gather per block call, shared by its saved views
            self.gathered = _layout(self.plan, self.shard, ["rep"], [])
        size, stride, offset = p[2]
        g = self.gathered
        if tuple(g.shape) == size and g.stride() == stride and offset == 0:
            return g
        if offset == 0 and g.is_contiguous() and stride == torch.empty(size).stride():
            return g.view(size)
        return g.as_strided(size, stride, offset)


class _OutMark(torch.autograd.Function):
    """A regathering block's output sharded on the sequence (gradient too); in backward the
    block's input is gathered again, after the gradient reaches the block."""

    @staticmethod
    def forward(ctx, out, fwd, bwd, st):
        ctx.bwd, ctx.st = bwd, st
        return torch.ops.tpu_autopar.layout(out, fwd, "")

    @staticmethod
    def backward(ctx, grad):
        st = ctx.st
        if st.gathered is None:
            st.gathered = torch.ops.tpu_autopar.tied(st.shard, grad,
                                                     _spec(st.plan, st.shard, "rep"))
        return torch.ops.tpu_autopar.layout(grad, ctx.bwd, ""), None, None, None


@contextlib.contextmanager
def markers(model: nn.Module, plan):
    """Module hooks that put the plan's activation layouts into a trace of ``model`` (see the
    module docstring); removed on exit. With sequence parallelism: the embedding's output (or
    the entry layer's stream argument) sharded on the sequence; each TP block's stream
    argument sharded on the sequence, then gathered (gradient: sharded), its output sharded;
    the head's input sharded, then gathered. With loss parallelism: the head's output sharded
    on the vocabulary (gradient too). With ``sp_regather``: ``_Regather`` around each block."""
    from .analysis import namer

    if plan is None or not needs_layouts(plan):
        yield
        return
    gn = namer(model)
    sp = plan.sequence_parallel
    entry = plan.sp_modules.get("entry") if sp else None
    blocks = plan.sp_modules.get("blocks", {}) if sp else {}
    handles = []

    def arg_hook(act, fwd, bwd, regather=False):
        def pre(mod, args, kwargs):
            args = list(args)
            if isinstance(act, int):
                if act >= len(args):
                    return None
                x = args[act]
            else:
                x = kwargs.get(act)
            if not isinstance(x, torch.Tensor):
                return None
            if regather:
                shard = _layout(plan, x, ["seq"], ["seq"])
                y = _layout(plan, shard, ["rep"], [])
                if y is not shard:
                    st = _Regather(plan, shard, y)
                    ctx = torch.autograd.graph.saved_tensors_hooks(st.pack, st.unpack)
                    ctx.__enter__()
                    mod._autopar_regather = (ctx, st)
            else:
                y = _layout(plan, x, fwd, bwd)
            if isinstance(act, int):
                args[act] = y
            else:
                kwargs = dict(kwargs, **{act: y})
            return tuple(args), kwargs
        return pre

    def out_hook(fwd, bwd):
        def post(mod, args, kwargs, out):
            held = mod.__dict__.pop("_autopar_regather", None)
            if held is not None:
                held[0].__exit__(None, None, None)
                if isinstance(out, torch.Tensor) and out.is_floating_point() \
                        and out.dim() >= 2:
                    return _OutMark.apply(out, _spec(plan, out, "seq"),
                                          _spec(plan, out, "seq"), held[1])
            if isinstance(out, torch.Tensor):
                return _layout(plan, out, fwd, bwd)
            return None
        return post

    mods = dict(model.named_modules())
    try:
        for fqn, mod in mods.items():
            g = gn(fqn)
            u = plan.units.get(g)
            if entry and fqn == entry[0]:
                handles.append(mod.register_forward_pre_hook(
                    arg_hook(entry[1], ["seq"], ["seq"]), with_kwargs=True))
            if u is None or u["choice"] == "none":
                continue
            if sp and u["kind"] == "block" and g in blocks:
                handles.append(mod.register_forward_pre_hook(
                    arg_hook(blocks[g][0], ["seq", "rep"], ["seq"], plan.sp_regather),
                    with_kwargs=True))
                handles.append(mod.register_forward_hook(out_hook(["seq"], ["seq"]),
                                                         with_kwargs=True, always_call=True))
            elif u["kind"] == "linear":
                lp = plan.loss_parallel and g == plan.loss_head
                if sp:
                    handles.append(mod.register_forward_pre_hook(
                        arg_hook(0, ["seq", "rep"], ["seq"]), with_kwargs=True))
                if lp:
                    handles.append(mod.register_forward_hook(
                        out_hook(["vocab"], ["vocab"]), with_kwargs=True))
            elif sp and not entry and u["kind"] == "embedding":
                handles.append(mod.register_forward_hook(out_hook(["seq"], ["seq"]),
                                                         with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
        for mod in mods.values():
            held = mod.__dict__.pop("_autopar_regather", None)
            if held is not None:
                held[0].__exit__(None, None, None)
