"""``torch.export`` -> StableHLO through the lowering table, serialized with ``jax.export``.

``exported_program_to_stablehlo(ep)`` decomposes the ExportedProgram (the ops the lowering table
does not cover, as ``torch.compile`` does), lowers its graph node by node with the same table
as every executor (``compile/lower.py``), and exports the resulting pure function of
``(*state, *user_inputs)`` with ``jax.export``. An op that has no lowering (it would need a host
callback) or a data-dependent output shape makes the export fail, naming the op.

The saved layout (``StableHLOGraphModule.save(d)``), readable with JAX and numpy alone:
- ``d/program.jaxexport``: ``jax.export.Exported.serialize()``; the function takes
  ``(*state in state_names order, *flat user tensor inputs)`` and returns the flat user outputs
  followed by the new values of the buffers (and inputs) the program mutates;
- ``d/state.npz``: the parameters, buffers and constants the program reads, keyed by
  ``state_names`` (bfloat16 and
  float8 arrays as their bits, unsigned ints of the same width: ``z[name].view(aval.dtype)``
  with the function's ``in_avals`` restores every dtype);
- ``d/meta.json``: ``state_names``, ``state_dtypes``, ``input_names``, ``output_names``,
  ``n_user_outputs``, versions.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..compile import lower as _lower
from ..runtime.dtypes import to_jax
from . import artifact as _artifact
from .artifact import ExportError

__all__ = ["exported_program_to_stablehlo", "StableHLOGraphModule", "StableHLOExportOptions",
           "load", "ExportError", "export_function"]

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
_MUTATION_KINDS = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)


class StableHLOExportOptions:
    """Options of ``exported_program_to_stablehlo``.

    ``decompositions``: ``"tpu"`` (default: PyTorch's decompositions for the ops the lowering
    table does not cover, as torch.compile uses; fused attention and norms stay single ops) or
    ``"core"`` (PyTorch's core ATen opset, ``ExportedProgram.run_decompositions()``).
    ``platforms``: JAX platforms to lower for (``["cpu", "tpu", "cuda"]``...); default: the
    platform torchtpu runs on.
    """

    def __init__(self, decompositions: str = "tpu", platforms=None):
        if decompositions not in ("tpu", "core"):
            raise ValueError("decompositions must be 'tpu' or 'core'")
        self.decompositions = decompositions
        self.platforms = list(platforms) if platforms is not None else None


class _ExportLowering(_lower.GraphLowering):
    """The compile path's graph lowering, with what an artifact cannot hold made an error and
    symbolic (``torch.export.Dim``) sizes kept symbolic."""

    def _cpu_callback(self, op, args, kwargs):
        raise ExportError(
            f"torch.tpu.export: {_lower.op_name(op)} has no lowering (or has a data-dependent "
            "output shape): it would need a host callback, which a StableHLO artifact cannot "
            "hold")

    def _eval(self, n, args, kwargs, rng, mutated_vals):
        t = n.target
        if t is torch.ops.aten.sym_size.int:
            return args[0].shape[args[1]]
        if t is torch.ops.aten.sym_numel.default:
            return _prod(args[0].shape)
        if t is torch.ops.aten.sym_stride.int:
            return _prod(args[0].shape[args[1] + 1:])
        return super()._eval(n, args, kwargs, rng, mutated_vals)


def _prod(dims):
    p = 1
    for d in dims:
        p = p * d
    return p


def _decompose(ep: ExportedProgram, opts: StableHLOExportOptions) -> ExportedProgram:
    from torch.export._remove_effect_tokens_pass import _remove_effect_tokens

    retargeted = _sdpa_to_math(ep.graph_module)
    try:
        if opts.decompositions == "core":
            ep = ep.run_decompositions()
        else:
            from ..compile.backend import _decompositions

            ep = ep.run_decompositions(_decompositions())
    finally:  # the caller's program is left as it was
        for n in retargeted:
            n.target = torch.ops.aten.scaled_dot_product_attention.default
        if retargeted:
            retargeted[0].graph.owning_module.recompile()
    # effect tokens (linalg ops' _linalg_check_errors) become plain calls in node order: a
    # StableHLO artifact has no token inputs, and its ops run in that order anyway
    return _remove_effect_tokens(ep)


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)[0]


def _sdpa_to_math(gm):
    """F.scaled_dot_product_attention of a "tpu" model: the composite op has a tpu kernel
    (eager/kernels.py routes it to the fused op), so run_decompositions keeps it whole, and the
    whole op has no lowering (a CPU model's decomposes through CPU's choice of kernel). Its
    nodes are retargeted to PyTorch's math path, which the retrace decomposes (the fused op is
    a random op for its dropout, which an export refuses; in one program both are the same
    math)."""
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and \
                n.target is torch.ops.aten.scaled_dot_product_attention.default:
            q = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            if isinstance(q, torch.Tensor) and q.device.type == "tpu":
                n.target = _sdpa_math
                nodes.append(n)
    if nodes:
        gm.recompile()
    return nodes


def _symbolic_avals(placeholders, ep):
    """ShapeDtypeStructs for the tensor placeholders, with torch's symbolic sizes mapped to JAX
    symbolic dimensions (one shared scope, with the range constraints JAX can express)."""
    exprs = {}
    for p in placeholders:
        v = p.meta.get("val")
        if isinstance(v, torch.Tensor):
            for d in v.shape:
                if isinstance(d, torch.SymInt):
                    for s in d.node.expr.free_symbols:
                        exprs[str(s)] = s
    scope = None
    if exprs:
        constraints = []
        for sym, rng in ep.range_constraints.items():
            name = str(sym)
            if name not in exprs:
                continue
            lo, hi = rng.lower, rng.upper
            if lo is not None and lo.is_finite and int(lo) > 1:
                constraints.append(f"{name} >= {int(lo)}")
            if hi is not None and hi.is_finite:
                constraints.append(f"{name} <= {int(hi)}")
        scope = jax.export.SymbolicScope(constraints)
    avals = []
    for p in placeholders:
        v = p.meta["val"]
        if any(isinstance(d, torch.SymInt) for d in v.shape):
            spec = ", ".join(str(d.node.expr) if isinstance(d, torch.SymInt) else str(int(d))
                             for d in v.shape)
            try:
                shape = jax.export.symbolic_shape(spec, scope=scope)
            except Exception as e:  # noqa: BLE001
                raise ExportError(f"torch.tpu.export: JAX cannot express the symbolic shape "
                                  f"({spec}) of input {p.name}: {e}") from e
        else:
            shape = tuple(int(d) for d in v.shape)
        avals.append(jax.ShapeDtypeStruct(shape, to_jax(v.dtype)))
    return avals


def _to_array(t):
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.device.type == "tpu":
            from ..eager.copy import value_of

            return value_of(t)
        return jnp.asarray(_lower._torch_to_np(t.cpu()))
    return jnp.asarray(t)


def exported_program_to_stablehlo(ep: ExportedProgram, options: StableHLOExportOptions | None
                                  = None) -> "StableHLOGraphModule":
    """Lower an ``ExportedProgram`` (of a "tpu" or CPU model) to a ``StableHLOGraphModule``."""
    opts = options or StableHLOExportOptions()
    ep = _decompose(ep, opts)
    gm = ep.graph_module
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise ExportError("torch.tpu.export: placeholders do not match the graph signature")
    state_names, state_values, state_slots = [], [], []
    user_slots, input_names, statics = [], [], {}
    for i, (p, spec) in enumerate(zip(placeholders, sig.input_specs)):
        val = p.meta.get("val")
        if spec.kind in _STATE_KINDS:
            if not p.users:
                continue  # state the program never reads (an eval BatchNorm's batch count)
            v = ep.state_dict[spec.target] if spec.target in ep.state_dict \
                else ep.constants[spec.target]
            state_names.append(spec.target)
            state_values.append(_to_array(v))
            state_slots.append(i)
        elif spec.kind == InputKind.USER_INPUT:
            if isinstance(val, torch.Tensor):
                user_slots.append(i)
                input_names.append(spec.arg.name)
            else:
                statics[i] = val  # a constant of the exported call (a bool flag, an int)
        else:
            raise ExportError(f"torch.tpu.export: inputs of kind {spec.kind.name} "
                              f"({spec.arg}) are not supported")
    low = _ExportLowering(gm, "exported")
    if low.random_nodes:
        names = sorted({_lower.op_name(n.target) for n in low.random_nodes})
        raise ExportError(f"torch.tpu.export: random ops ({', '.join(names)}) are not "
                          "supported; export the model in eval mode")
    if low.mutated:
        raise ExportError("torch.tpu.export: the decomposed graph writes its inputs in place")
    tensor_slots = state_slots + user_slots
    traced = low.trace_fn(tensor_slots, statics, None)
    # graph outputs: user-facing ones first, then new values of mutated buffers/inputs
    out_specs = sig.output_specs
    order = [j for j, s in enumerate(out_specs) if s.kind not in _MUTATION_KINDS] + \
            [j for j, s in enumerate(out_specs) if s.kind in _MUTATION_KINDS]
    n_user = sum(1 for s in out_specs if s.kind not in _MUTATION_KINDS)
    output_names = []
    for j in order:
        s = out_specs[j]
        if s.kind in _MUTATION_KINDS or s.kind.name.startswith("GRADIENT"):
            output_names.append(f"{s.kind.name.lower()}:{s.target}")
        else:
            output_names.append(getattr(s.arg, "name", f"output{j}"))
    n_arr = len(tensor_slots)

    def program(*flat):
        outs, _news, _checks = traced(*flat)
        consts, _ = low.const_outputs
        full = []
        for kind, v in consts:
            if kind == "array":
                full.append(outs[v])
            elif kind == "input":
                full.append(flat[tensor_slots.index(v)])
            else:
                raise ExportError(f"torch.tpu.export: a non-tensor output ({v!r}) is not "
                                  "supported")
        return tuple(full[j] for j in order)

    program.__name__ = "exported_program"
    avals = _symbolic_avals([placeholders[i] for i in tensor_slots], ep)
    assert len(avals) == n_arr
    kw = {"platforms": opts.platforms} if opts.platforms else {}
    exported = jax.export.export(jax.jit(program), **kw)(*avals)
    return StableHLOGraphModule(exported, state_names, state_values, input_names, output_names,
                                n_user, ep)


def export_function(fn, args, kwargs=None) -> ExportedProgram:
    """``torch.export`` of a plain function that may differentiate (``torch.autograd.grad``):
    a whole training step (forward, loss, backward, optimizer update) as one program.

    ``torch.export.export`` of such code fails in torch 2.13 (the autograd engine's tensors
    become "fake tensor constants"); tracing it first with ``make_fx`` (fake tensors) records
    the backward as ordinary aten ops, and that graph exports. ``fn`` must be functional over
    its arguments (return new parameters and optimizer state instead of writing them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    kwargs = kwargs or {}
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    # one tensor passed twice (a zeros list used for two optimizer states) would be traced as
    # one graph input read twice: trace with a copy, so each argument is its own input
    seen = set()
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                leaves[i] = x.detach().clone()
            seen.add(id(x))

    def flat_fn(*xs):
        a, k = pytree.tree_unflatten(list(xs), spec)
        return fn(*a, **k)

    gm = make_fx(flat_fn, tracing_mode="fake")(*leaves)

    class _Traced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm

        def forward(self, *a, **k):
            return self.gm(*pytree.tree_leaves((a, k)))

    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return torch.export.export(_Traced(), tuple(args), kwargs)


class StableHLOGraphModule:
    """A lowered program: StableHLO text/bytecode, ``save(d)``, and ``__call__`` on "tpu"."""

    def __init__(self, exported, state_names, state_values, input_names, output_names, n_user,
                 ep=None):
        self.exported = exported  # the jax.export.Exported
        self.state_names = list(state_names)
        self.state = list(state_values)
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.n_user_outputs = n_user
        self._ep = ep
        self._call = jax.jit(exported.call)

    def get_stablehlo_text(self, method_name=None) -> str:
        return self.exported.mlir_module()

    def get_stablehlo_bytecode(self, method_name=None) -> bytes:
        return bytes(self.exported.mlir_module_serialized)

    def _flat_inputs(self, args, kwargs):
        if self._ep is not None:
            in_spec = self._ep.call_spec.in_spec
            if kwargs and in_spec is not None:
                from torch.export._tree_utils import reorder_kwargs

                kwargs = reorder_kwargs(kwargs, in_spec)
            leaves = pytree.tree_leaves((args, kwargs))
        else:
            leaves = pytree.tree_leaves((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if len(tensors) != len(self.input_names):
            raise TypeError(f"expected {len(self.input_names)} tensor inputs "
                            f"({', '.join(self.input_names)}), got {len(tensors)}")
        return tensors

    def __call__(self, *args, **kwargs):
        """Run on "tpu" with the program's state; returns what the model returned (tpu tensors).
        Mutated buffers are kept in the program's state, as the module's would be; inputs the
        model writes in place are written."""
        from ..runtime import buffer as _buffer

        inputs = self._flat_inputs(args, kwargs)
        arrays = [_to_array(t) for t in inputs]
        outs = self._call(*self.state, *arrays)
        n = self.n_user_outputs
        for name, new in zip(self.output_names[n:], outs[n:]):
            kind, _, target = name.partition(":")
            if kind == "buffer_mutation" and target in self.state_names:
                self.state[self.state_names.index(target)] = new
            elif kind == "user_input_mutation" and target in self.input_names:
                with torch.no_grad():
                    t = inputs[self.input_names.index(target)]
                    t.copy_(_buffer.wrap(new).to(t.device))
        res = [_buffer.wrap(o) for o in outs[:n]]
        if self._ep is not None:
            user_specs = [s for s in self._ep.graph_signature.output_specs
                          if s.kind not in _MUTATION_KINDS]
            if len(user_specs) == n:
                return pytree.tree_unflatten(res, self._ep.call_spec.out_spec)
        return res[0] if n == 1 else tuple(res)

    def save(self, directory) -> None:
        """Write ``program.jaxexport``, ``state.npz`` and ``meta.json`` to ``directory``."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "program.jaxexport"), "wb") as f:
            f.write(self.exported.serialize())
        arrays = {}
        for n, a in zip(self.state_names, self.state):
            a = np.asarray(jax.device_get(a))
            if type(a.dtype).__module__.startswith("ml_dtypes") or a.dtype.kind == "V":
                # bfloat16/float8 have no .npy type: their bits, as unsigned ints
                a = a.view(np.dtype(f"uint{a.dtype.itemsize * 8}"))
            arrays[n] = a
        np.savez(os.path.join(directory, "state.npz"), **arrays)
        meta = {"format": _artifact.FORMAT, "state_names": self.state_names,
                "state_dtypes": [str(np.dtype(a.dtype)) for a in self.state],
                "input_names": self.input_names, "output_names": self.output_names,
                "n_user_outputs": self.n_user_outputs,
                "torch": torch.__version__, "jax": jax.__version__}
        with open(os.path.join(directory, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)


def load(directory) -> StableHLOGraphModule:
    """A saved program (``save``) as a ``StableHLOGraphModule`` (its ``__call__`` takes the flat
    user tensors)."""
    exported, meta, state = _artifact.read(directory)
    state = [jnp.asarray(a) for a in state]
    return StableHLOGraphModule(exported, meta["state_names"], state, meta["input_names"],
                                meta["output_names"], meta["n_user_outputs"])
