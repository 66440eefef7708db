"""``torch.tpu.optimizers.SingleTraceTrainer``: forward, loss, backward and the optimizer step of
a training step traced once and run as one XLA program per step.

How: ``aot_export_module(..., trace_joint=True)`` traces ``loss_fn(model, *batch)`` and its
backward into one functional aten graph (gradients and BatchNorm's buffer updates are its
outputs; PyTorch's decompositions for ops the lowering table lacks, as ``torch.compile(backend=
"tpu")`` uses); ``compile/lower.py`` turns it into a JAX function with the one lowering table;
``program.apply`` appends the optimizer's update rule (the same rules ``optimizer.step`` runs).
The whole is one ``jax.jit`` whose parameters, optimizer state and mutated buffers are donated
(when nothing else holds them), so a step holds one copy of them. The learning rates and step
counts are arguments: a scheduler changing ``param_groups[i]["lr"]`` never recompiles. A new
batch shape traces again (one program per shape), as does a change of the optimizer's static
hyperparameters or of ``model.training``.

The optimizer's state lives in the optimizer (``optimizer.state_dict()`` is torch.optim's, and
``optimizer.step()`` can continue from it). The gradients stay inside the program unless
``write_grads=True`` (then each parameter's ``p.grad`` holds this step's gradient afterwards, as
after ``zero_grad(); loss.backward()``, clipped when clipping is on). ``max_grad_norm``: the
program clips as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm,
norm_type)`` between backward and the update (the norm over every parameter with a gradient;
``trainer.grad_norm`` is the total norm before clipping, what ``clip_grad_norm_`` returns).
Gradient hooks (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``, module
backward hooks) cannot run inside the program: a model with one is refused with an error.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import numpy as np
import torch
from torch import nn

from ..eager import checks as _checks
from ..eager import copy as _copy
from ..eager import rng as _rng
from ..runtime import buffer as _buffer
from ..runtime import devices
from ..runtime import program_cache
from ..runtime.metrics import count
from . import partition as _partition
from . import program as _program
from .optimizer import _OneProgramStep


# the joint graph partitioned as torch.compile's AOTAutograd does (partition.py); False: as
# aot_export_module gives it (for A/B measurements; read when a trainer is made)
PARTITION = True
# the saved transposed activations written out in their own shape, as torch.compile's forward
# program returns them (``_materialized``). Off: measured no faster on the GPT step (see
# docs/ARCHITECTURE.md, Optimizers); benchmarks/single_trace.py's trainer+rowmajor turns it on
MATERIALIZE_SAVED_TRANSPOSES = False
# the values the backward reads from the forward (the partition's saved values, less inputs
# and views of inputs) returned as extra outputs of the one program and dropped after the step
# (``_Traced.captured``): XLA:CPU gives each output a buffer of its own, which the heap reuses
# step after step, where a value kept inside the program takes room in the one temporary block
# XLA:CPU allocates per run, which glibc maps afresh (and the kernel zeroes page by page) every
# step when it is over its 32 MB mmap threshold. GPT step: the block 184 -> 97 MB, page faults
# per step 44,900 -> 24,800, system CPU 105 -> 82 ms, process CPU 0.98x, wall 0.98x (loaded
# host); results identical. The price, without SAVED_ROOTS: XLA duplicates a cheap producer
# that reads a weight (``mm + bias``) into the returned value's own fusion and copies that
# weight (the GPT step: six 3-4 KB biases). None (the default): on when the platform is
# XLA:CPU, whose allocator this is about, off elsewhere (a TPU's HBM temporaries are not
# mapped per run, and the outputs would only pin XLA's layout and rematerialization choices);
# True / False force it.
# benchmarks/single_trace.py's trainer+savedout forces it on, trainer forces it off
SAVED_AS_OUTPUTS = None
# with SAVED_AS_OUTPUTS: each saved value is returned as the array the backward actually
# reads after XLA's fusion, so that the output buffer is that array and it leaves the temporary
# block. (1) A saved transpose of a computed value (the attention's ``q^T``, ``k^T``, ``p^T``:
# partition.py's SAVED_TRANSPOSES) is returned as the value it transposes (XLA folds the
# transpose into the backward's dot); returned as the transpose, XLA wrote a transposed copy
# out, which nothing read, and kept the value in the block (GPT step: block 97 -> 78 MB, 48
# fusions and 18 output copies fewer). (2) A saved float32 Linear output ``addmm(bias, x, W)``
# is computed as ``mm(x, W) + bias`` and the ``mm`` returned (``_split_addmm``): XLA re-adds
# the bias inside every reader's fusion, so the backward reads the product, which stayed in the
# block while the sum was written out with its bias copied (GPT: block 78 -> 53 MB, no bias
# copies). Results bit-identical. False: the saved values as they are (benchmarks/
# single_trace.py's trainer+savedview, the A/B)
SAVED_ROOTS = True
# with SAVED_AS_OUTPUTS: two more kinds of values returned (and dropped) so that they leave the
# temporary block. (1) The gradients, as the backward gives them (before clipping; tied
# parameters' summed): ``_after_all`` makes every update wait for every gradient, so all of
# them were live together at the end of the backward, in the block (GPT step: 26 MB of its 53).
# (2) The loss's backward values on the logits (``_LOSS_BACKWARD``: ``nll_loss_backward``,
# the targets' one-hot scaled by the loss's gradient, which reads no activation, so XLA
# computes it at the top of the program and keeps it across the forward; and
# ``_log_softmax_backward_data``, the logits' gradient, read by two dots): [tokens, vocab]
# each (GPT step: 16.8 MB each). GPT step: block 53 -> 18 MB, under glibc's 32 MB mmap
# threshold; a process running only the trainer: page faults per step ~12,900 -> ~4,900,
# system CPU 22-25 -> 7.5-12 ms (beside other programs the heap's history decides; process
# CPU within noise); same fusions, no copies added; results bit-identical.
# False: only the forward's saved values (benchmarks/single_trace.py's trainer+savedfwd, the A/B)
SAVED_BACKWARD = True
# the loss backward ops whose results SAVED_BACKWARD returns (see there)
_LOSS_BACKWARD = (torch.ops.aten.nll_loss_backward.default,
                  torch.ops.aten.nll_loss2d_backward.default,
                  torch.ops.aten._log_softmax_backward_data.default)


class _Loss(nn.Module):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch):
        return (self.loss_fn(self.model, *batch),)


class _Traced:
    """One exported training graph: its lowering and how its inputs/outputs map to tensors."""

    def __init__(self, module, batch, partition=True, materialize=False, saved_out=False,
                 capture_roots=True, capture_backward=True):
        # imported here: compile/ brings in Dynamo, which ``import torch`` should not load
        from torch._functorch.aot_autograd import aot_export_module

        from ..compile import lower as _lower
        from ..compile.backend import _LazyDecompositions

        gm, sig = aot_export_module(module, tuple(batch), trace_joint=True,
                                    output_loss_index=0, decompositions=_LazyDecompositions())
        count("trainer_traces")
        # the output names, before partitioning renames any node
        out_names = [o.name if isinstance(o, torch.fx.Node) else None
                     for o in gm.graph.output_node().args[0]]
        if partition:
            n_fwd = len(sig.buffers_to_mutate) + len(sig.user_outputs)
            gm = _partition.joint_partitioned(gm, n_fwd, sig.user_outputs[0])
        # the program returns the gradients too (SAVED_BACKWARD; each its own output buffer)
        self.grads_out = bool(partition and saved_out and capture_backward)
        self._captured = None  # while tracing with saved_out: the saved values, in order
        self.captured = []  # the saved values of the latest trace (extra program outputs)
        self.capture_nodes = []  # the graph's nodes whose values the program returns
        if partition and saved_out:
            transposed = set(gm.meta.get(_partition.SAVED_TRANSPOSES, ()))
            split = {}
            for n in gm.meta.get(_partition.SAVED_VALUES, ()):
                if (capture_roots and not materialize and n in transposed
                        and not _partition._of_input(n.args[0])):
                    n = n.args[0]  # the value the backward's dot reads, transposed in the dot
                if capture_roots:
                    n = _split_addmm(gm, n, split)  # a Linear's output: return its product
                if n in self.capture_nodes:
                    continue
                self.capture_nodes.append(n)
            if capture_backward:  # the loss's backward values on the logits (SAVED_BACKWARD)
                self.capture_nodes.extend(
                    n for n in gm.graph.nodes
                    if n.op == "call_function" and n.target in _LOSS_BACKWARD
                    and n not in self.capture_nodes)
            if split:
                gm.recompile()
        self.low = _lower.GraphLowering(gm, "trainer")
        if partition and materialize:
            for n in gm.meta.get(_partition.SAVED_TRANSPOSES, ()):
                self.low.node_hooks[n] = _materialized
        for n in self.capture_nodes:
            prev = self.low.node_hooks.get(n)
            self.low.node_hooks[n] = self._capture_hook(prev)
        if self.low.mutated:
            raise RuntimeError("SingleTraceTrainer: the exported training graph writes its "
                               "inputs in place, which a functional graph should not")
        named = dict(module.named_parameters(remove_duplicate=False))
        named.update(module.named_buffers(remove_duplicate=False))
        # the graph's inputs: parameters, buffers (each by name), then the batch
        self.inputs = [named[n] for n in sig.parameters] + [named[n] for n in sig.buffers]
        self.n_batch = len(sig.user_inputs)
        self.n_out = len(out_names)
        # the loss is the one user output (backward_signature.loss_output names the graph's
        # first output, which is a buffer update when the model has BatchNorm)
        self.loss_pos = out_names.index(sig.user_outputs[0])
        grads = sig.backward_signature.gradients_to_parameters
        self.grad_pos = {}  # id(param) -> output positions of its gradients (tied: several)
        for j, name in enumerate(out_names):
            if name in grads:
                self.grad_pos.setdefault(id(named[grads[name]]), []).append(j)
        seen = set()  # the parameters with a gradient, each once (tied: one Parameter)
        self.grad_params = []
        for t in self.inputs:
            if id(t) in self.grad_pos and id(t) not in seen:
                seen.add(id(t))
                self.grad_params.append(t)
        self.buffer_pos = [(j, named[sig.buffers_to_mutate[name]])
                           for j, name in enumerate(out_names)
                           if name in sig.buffers_to_mutate]
        self.fn = self.low.trace_fn(list(range(len(self.low.placeholders))), {}, None)
        self.n_random = len(self.low.random_nodes)

    def _capture_hook(self, prev):
        """A node hook that records the node's value (after ``prev``, another hook) while
        ``outputs`` traces, for the program to return (SAVED_AS_OUTPUTS)."""
        def hook(x):
            if prev is not None:
                x = prev(x)
            if self._captured is not None and hasattr(x, "shape"):
                self._captured.append(x)
            return x
        return hook

    def outputs(self, ph_arrays, rng):
        """The graph's outputs, every position filled (None where PyTorch returns None)."""
        args = list(ph_arrays) + ([rng] if self.n_random else [])
        self._captured = []
        try:
            flat, _news, flags = self.fn(*args)
            self.captured = self._captured
        finally:
            self._captured = None
        consts, _seq = self.low.const_outputs
        full = []
        for kind, v in consts:
            if kind == "array":
                full.append(flat[v])
            elif kind == "input":
                full.append(ph_arrays[v])
            elif kind == "const":
                full.append(v)
            else:
                raise RuntimeError(f"SingleTraceTrainer: graph output of kind {kind!r}")
        return full, flags


class SingleTraceTrainer:
    """``trainer.step(*batch)`` runs ``loss = loss_fn(model, *batch)``, its backward and
    ``optimizer``'s step as one XLA program and returns the loss (a 0-d "tpu" tensor).

    ``optimizer``: a ``torch.tpu.optimizers`` optimizer (AdamW, Adam, SGD, Muon) over ``model``'s
    parameters on "tpu"; its param groups, learning rates (schedulers work) and state are read
    at every step.
    """

    def __init__(self, model: nn.Module, loss_fn, optimizer, *, write_grads: bool = False,
                 max_grad_norm: float | None = None, norm_type: float = 2.0):
        if not isinstance(optimizer, _OneProgramStep):
            raise TypeError("SingleTraceTrainer needs a torch.tpu.optimizers optimizer "
                            f"(AdamW, Adam, SGD or Muon), got {type(optimizer).__name__}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"SingleTraceTrainer: max_grad_norm must be positive, got "
                             f"{max_grad_norm}")
        self.write_grads = bool(write_grads)
        self._clip = None if max_grad_norm is None else (float(max_grad_norm),
                                                         float(norm_type))
        self.grad_norm = None  # the last step's total gradient norm (with max_grad_norm)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self._module = _Loss(model, loss_fn)
        self._traced: dict = {}
        self._programs: dict = {}
        self._partition = PARTITION  # benchmarks/single_trace.py's trainer+joint sets False
        self._materialize = MATERIALIZE_SAVED_TRANSPOSES  # trainer+rowmajor sets True
        self._saved_out = (devices.platform() == "cpu" if SAVED_AS_OUTPUTS is None
                           else SAVED_AS_OUTPUTS)  # benchmarks/single_trace.py sets it
        self._capture_roots = SAVED_ROOTS  # trainer+savedview sets False
        self._capture_backward = SAVED_BACKWARD  # trainer+savedfwd sets False

    # ---- one step ----

    def _plan(self, traced):
        """The optimizer's entries for the parameters the graph gives a gradient."""
        opt = self.optimizer
        entries, scalars = [], []
        for group in opt.param_groups:
            params = [p for p in group["params"] if id(p) in traced.grad_pos]
            if not params:
                continue
            scalars.append(opt._traced(group))
            entries.extend(opt._entry(p, group, len(scalars) - 1) for p in params)
        known = {id(t) for t in traced.inputs}
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError("SingleTraceTrainer: the optimizer has a parameter of "
                                     f"shape {tuple(p.shape)} that the model does not")
        return _program.Plan(entries, scalars)

    def step(self, *batch) -> torch.Tensor:
        for t in batch:
            if not isinstance(t, torch.Tensor) or t.device.type != "tpu":
                raise TypeError("SingleTraceTrainer.step expects tensors on the 'tpu' device, "
                                f"got {type(t).__name__}"
                                + (f" on {t.device}" if isinstance(t, torch.Tensor) else ""))
        self._refuse_hooks()
        key = (tuple((tuple(t.shape), t.dtype) for t in batch), self.model.training)
        traced = self._traced.get(key)
        if traced is None:
            traced = self._traced[key] = _Traced(self._module, batch, self._partition,
                                                 self._materialize, self._saved_out,
                                                 self._capture_roots, self._capture_backward)
        plan = self._plan(traced)
        for t in [*traced.inputs, *(v for e in plan.entries for v in e.state.values())]:
            why = _program.fallback_reason(t)
            if why is not None:
                raise RuntimeError(f"SingleTraceTrainer: a parameter, buffer or optimizer state "
                                   f"tensor cannot be passed to one program ({why})")
        return self._run(traced, plan, batch)

    def _refuse_hooks(self) -> None:
        """Hooks run by the autograd engine never run inside the one program: refuse them."""
        from torch.nn.modules import module as _m

        if _m._global_backward_hooks or _m._global_backward_pre_hooks:
            raise RuntimeError("SingleTraceTrainer: global module backward hooks are registered "
                               "(nn.modules.module.register_module_full_backward_hook); they "
                               "cannot run inside the one program")
        for name, p in self.model.named_parameters():
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                raise RuntimeError(
                    f"SingleTraceTrainer: parameter {name!r} has a gradient hook "
                    "(register_hook / register_post_accumulate_grad_hook), which cannot run "
                    "inside the one program; remove it, or train with loss.backward() and "
                    "optimizer.step()")
        for name, m in self.model.named_modules():
            if m._backward_hooks or m._backward_pre_hooks:
                raise RuntimeError(
                    f"SingleTraceTrainer: module {name or type(m).__name__!r} has a backward "
                    "hook (register_full_backward_hook / register_full_backward_pre_hook), "
                    "which cannot run inside the one program; remove it, or train with "
                    "loss.backward() and optimizer.step()")

    def _run(self, traced, plan, batch):
        # flat arguments: each distinct tensor once (tied parameters are one Parameter), the
        # optimizer states, the learning rates, the batch, the random words
        slot = {}
        flat, tensors = [], []
        for t in traced.inputs:
            if id(t) not in slot:
                slot[id(t)] = len(flat)
                flat.append(_buffer.buffer_of(t).array)
                tensors.append(t)
        n_inputs = len(flat)
        state_slots = []
        for e in plan.entries:
            state_slots.append(len(flat))
            flat.extend(_buffer.buffer_of(t).array for t in e.state.values())
        lr_slot = len(flat)
        flat.extend(plan.scalar_values())
        flat.extend(_copy.value_of(t) for t in batch)  # a view's value, not its storage
        if traced.n_random:
            flat.append(np.stack([_rng.next_state(None) for _ in range(traced.n_random)]))
        updated = {id(e.param) for e in plan.entries} | {id(b) for _, b in traced.buffer_pos}
        written = [slot[id(t)] for t in tensors if id(t) in updated] + list(range(n_inputs,
                                                                                  lr_slot))
        donate = _program.sole(flat, written)
        structure = plan.structure()
        shapes = (tuple(tuple(t.shape) for t in tensors), tuple(tuple(t.shape) for t in batch))
        pkey = (id(traced), structure, shapes, donate, self.write_grads, self._clip)
        prog = self._programs.get(pkey)
        if prog is None:
            prog = self._programs[pkey] = self._program(traced, plan, tensors, slot, state_slots,
                                                        lr_slot, batch, donate)
        count("trainer_programs")
        if donate:
            count("trainer_donated_buffers", len(donate))
        out = prog(*flat)
        del flat
        loss, flags, new_inputs, new_states, grads, norm, _saved = out
        del _saved  # the saved values' buffers go back to the heap (SAVED_AS_OUTPUTS)
        for ok, info in zip(flags, traced.low.check_info):
            _checks.add(ok, *info)
        for j, t in enumerate(tensors):
            if new_inputs[j] is not None:
                _buffer.buffer_of(t).array = new_inputs[j]
        for e, st in zip(plan.entries, new_states):
            for name, arr in st.items():
                if name in e.state:
                    _buffer.buffer_of(e.state[name]).array = arr
                else:  # created by the rule (SGD's first buffer with dampening)
                    e.state[name] = _buffer.wrap(arr)
        if self.write_grads:
            for p, g in zip(traced.grad_params, grads):
                p.grad = _buffer.wrap(g)
        if norm is not None:
            self.grad_norm = _buffer.wrap(norm)
        self.optimizer._opt_called = True  # a scheduler's "step() before optimizer.step()" check
        return _buffer.wrap(loss)

    def _program(self, traced, plan, tensors, slot, state_slots, lr_slot, batch, donate):
        structure = plan.structure()
        n_lr = _program.n_scalars(structure)
        batch_slot = lr_slot + n_lr
        n_batch = len(batch)
        t_shapes = [tuple(t.shape) for t in tensors]
        ph_src = [slot[id(t)] for t in traced.inputs]
        entry_slot = [slot[id(e.param)] for e in plan.entries]
        buffer_out = {slot[id(b)]: j for j, b in traced.buffer_pos}
        grad_index = {id(p): k for k, p in enumerate(traced.grad_params)}
        entry_index = [grad_index[id(e.param)] for e in plan.entries]
        write_grads, clip = self.write_grads, self._clip

        def train_step(*flat):
            count("trainer_program_traces")
            vals = [flat[i].reshape(s) for i, s in enumerate(t_shapes)]
            ph = [vals[i] for i in ph_src] + list(flat[batch_slot:batch_slot + n_batch])
            rng = flat[batch_slot + n_batch] if traced.n_random else None
            outs, flags = traced.outputs(ph, rng)
            all_grads = []  # every parameter with a gradient (clip_grad_norm_'s set)
            for p in traced.grad_params:
                gs = [outs[j] for j in traced.grad_pos[id(p)] if outs[j] is not None]
                g = gs[0]
                for extra in gs[1:]:
                    g = g + extra  # a tied parameter: autograd's accumulation
                all_grads.append(g)
            # the gradients returned and dropped (SAVED_BACKWARD; write_grads returns them)
            grads_out = tuple(all_grads) if traced.grads_out and not write_grads else ()
            norm = None
            if clip is not None:
                all_grads, norm = _clip_grads(all_grads, *clip)
            grads = [all_grads[k] for k in entry_index]
            # the updates after every read of the old weights (see _after_all)
            zero = _after_all([outs[traced.loss_pos], *flags, *all_grads,
                               *(outs[j] for _i, j in buffer_out.items())])
            grads = [g - zero.astype(g.dtype) for g in grads]
            params = [vals[i] for i in entry_slot]
            states = []
            for (_r, _s, names, _lr, _shape, shapes), k in zip(structure[0], state_slots):
                states.append({n: flat[k + j].reshape(s)
                               for j, (n, s) in enumerate(zip(names, shapes))})
            new_p, new_s = _program.apply(structure, params, grads,
                                          states, flat[lr_slot:lr_slot + n_lr])
            new_inputs = [None] * len(tensors)
            for i, p in zip(entry_slot, new_p):
                new_inputs[i] = p.reshape(flat[i].shape)
            for i, j in buffer_out.items():
                new_inputs[i] = outs[j].astype(flat[i].dtype).reshape(flat[i].shape)
            out_states = []
            for (_r, _s, names, *_), k, st in zip(structure[0], state_slots, new_s):
                olds = dict(zip(names, flat[k:k + len(names)]))
                out_states.append({n: v.reshape(olds[n].shape) if n in olds else v
                                   for n, v in st.items()})
            return (outs[traced.loss_pos], tuple(flags), new_inputs, out_states,
                    tuple(all_grads) if write_grads else (), norm,
                    tuple(traced.captured) + grads_out)

        return program_cache.Program("trainer", train_step, program_cache.BY_TEXT,
                                     donate_argnums=donate)


def _after_all(arrays):
    """A 0 (int32 scalar) computed from one element of each of ``arrays`` (every output of
    the training graph: the loss, its check flags, the gradients, the buffer updates), for the
    updates to subtract from their gradients (exact: ``g - 0.0`` is ``g`` for every value,
    -0.0 and NaN included), so that every in-place write of a donated weight depends on every
    op that reads the old weights (each such op is an ancestor of some output).

    Why: the backward reads a weight in ops its own update does not depend on (the input
    gradient ``dy @ W`` flows to the layers below, not to ``W``'s gradient). XLA's copy
    insertion, ordering ops by their data dependencies, could not place those reads before the
    weight's update written into the same (donated) buffer and copied every such parameter at
    the top of the program (likewise a bias read by the loss alone): 38 parameter-sized
    copies, a second copy of most weights, in the GPT benchmark's step. ``lax.optimization_barrier`` does not order them: XLA:CPU removes
    barriers before copy insertion. ``min(max(x, 0), 0)`` is not folded away (``x & 0``
    is)."""
    firsts = [a.reshape(-1)[0].astype(jnp.float32) for a in arrays
              if a is not None and hasattr(a, "shape") and a.size]
    if not firsts:
        return jnp.zeros((), jnp.int32)
    firsts = jnp.stack(firsts)
    bits = lax.bitcast_convert_type(jnp.sum(firsts), jnp.int32)
    return jnp.minimum(jnp.maximum(bits, 0), 0)


# the views ``_split_addmm`` looks through (reshapes: a bitcast in XLA, the same buffer)
_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.reshape.default, torch.ops.aten.alias.default)


def _split_addmm(gm, n, done):
    """The node to return for the saved value ``n`` (SAVED_ROOTS): when ``n`` is a float32
    ``addmm(bias, a, b)`` with a 1-D bias (a Linear's output), or a reshape of one, the addmm is
    rewritten as ``add(mm(a, b), bias)`` (bit-identical: the lowering's addmm is ``bias + a @ b``
    in float32, and the sum commutes) and the ``mm`` is returned. XLA adds a bias inside each
    reader's fusion, so the backward reads the product, not the sum: returned, the sum was a
    second array (written out, its bias copied) and the product stayed in the temporary block
    from the forward to the backward. Otherwise ``n`` itself. ``done``: addmm -> mm of the
    rewrites so far."""
    r = n
    while (r.op == "call_function" and r.target in _RESHAPES and r.args
           and isinstance(r.args[0], torch.fx.Node)):
        r = r.args[0]
    if r in done:
        return done[r]
    if (r.op != "call_function" or r.target is not torch.ops.aten.addmm.default or r.kwargs
            or len(r.args) != 3 or not all(isinstance(a, torch.fx.Node) for a in r.args)):
        return n
    bias, a, b = r.args
    val, bval = r.meta.get("val"), bias.meta.get("val")
    if val is None or val.dtype != torch.float32 or bval is None or bval.dim() != 1:
        return n
    g = gm.graph
    with g.inserting_before(r):
        mm = g.call_function(torch.ops.aten.mm.default, (a, b))
        add = g.call_function(torch.ops.aten.add.Tensor, (mm, bias))
    mm.meta = dict(r.meta)
    add.meta = dict(r.meta)
    r.replace_all_uses_with(add)
    g.erase_node(r)
    done[r] = mm
    return mm


def _materialized(x):
    """``x`` (a transposed activation the backward reads) computed into an array of its own
    shape: ``x - 0`` with an opaque 0 (``_after_all``; exact for every value), which XLA cannot
    fold into the reading dot as it folds a bare transpose. The backward's batched matmuls then
    read a row-major operand, as in torch.compile's backward program (XLA:CPU runs those on
    YNNPACK; folded, with a transposed operand, on Eigen). Off by default: the GPT step was
    no faster with it (MATERIALIZE_SAVED_TRANSPOSES)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or not x.size:
        return x
    return x - _after_all([x]).astype(x.dtype)


def _clip_grads(grads, max_norm: float, norm_type: float):
    """``torch.nn.utils.clip_grad_norm_``'s arithmetic: each gradient's norm, the norm of
    those, ``max_norm / (total + 1e-6)`` clamped to 1, every gradient scaled by it (in its
    dtype). Returns (clipped gradients, total norm)."""
    if not grads:
        return grads, jnp.zeros((), jnp.float32)
    if norm_type == float("inf"):
        norms = [jnp.max(jnp.abs(g)) for g in grads]
        total = jnp.max(jnp.stack([n.astype(jnp.float32) for n in norms]))
    else:
        def vnorm(v):
            if norm_type == 2.0:
                return jnp.sqrt(jnp.sum(v * v))
            if norm_type == 1.0:
                return jnp.sum(jnp.abs(v))
            return jnp.sum(jnp.abs(v) ** norm_type) ** (1.0 / norm_type)
        norms = [vnorm(g.ravel()) for g in grads]
        total = vnorm(jnp.stack([n.astype(jnp.float32) for n in norms]))
    coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
    return [g * coef.astype(g.dtype) for g in grads], total
