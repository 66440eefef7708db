"""One XLA program for a whole optimizer step, its parameters and state donated.

A step is a ``Plan``: one ``Entry`` per parameter that has a gradient (its rule, the rule's
static hyperparameters, which group it belongs to) and each group's traced hyperparameters
(the learning rate; Adam's betas, which OneCycleLR and CyclicLR cycle). ``apply`` is the
pure JAX function of the plan (also what ``SingleTraceTrainer`` appends to its traced training
step); ``run`` calls it as one program on the tensors' storage arrays and writes the new
values back. A Program is cached per plan *structure* (rules, static hyperparameters, which
state exists, which arrays are donated); shapes select executables inside it, and the learning
rates, betas and step counts are traced arguments, so a scheduler never recompiles.

Donation: a parameter's or state tensor's old array is donated when nothing but its storage
holds it (the reference-count test of ``eager/executor.py``); XLA then writes the update into
the same device memory, so a step never holds two copies of the parameters or the state.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..eager import copy as _copy
from ..eager import views
from ..eager import executor as _executor
from ..eager.executor import _SOLE, _probe
from ..runtime import buffer as _buffer
from ..runtime import program_cache
from ..runtime.metrics import count
from . import update as _update


@dataclasses.dataclass
class Entry:
    """One parameter's update: ``param``/``grad`` tensors, ``state`` {name: tensor} (names the
    rule creates are absent), ``rule`` (a key of ``update.RULES``), ``static`` (its static
    hyperparameters, sorted (name, value) pairs) and ``group`` (index into the plan's
    ``scalars``: the traced hyperparameters)."""
    param: torch.Tensor
    grad: torch.Tensor
    state: dict
    rule: str
    static: tuple
    group: int

    def structure(self):
        # the tensors' shapes too: a storage array may hold its tensor reshaped (a gradient
        # summed with keepdim), read and written in the array's own shape
        return (self.rule, self.static, tuple(self.state), self.group, tuple(self.param.shape),
                tuple(tuple(t.shape) for t in self.state.values()))


class Plan:
    """``entries``, and ``scalars``: per group a dict of its traced hyperparameters (numbers
    or one-element tensors)."""

    def __init__(self, entries, scalars):
        self.entries = entries
        self.scalars = scalars

    def structure(self) -> tuple:
        return (tuple(e.structure() for e in self.entries),
                tuple(tuple(sorted(s)) for s in self.scalars))

    def scalar_values(self) -> list:
        """The traced hyperparameters as the program's arguments (``apply``'s ``scalars``)."""
        return [scalar_value(s[k], k in _update.PAIRS) for s in self.scalars for k in sorted(s)]


def apply(structure, params, grads, states, scalars):
    """The pure update: new params and new state dicts (jax arrays) for the plan ``structure``
    (``Plan.structure()``); ``states``: per entry a dict of its state arrays; ``scalars``: the
    traced hyperparameters, flat (``Plan.scalar_values()``)."""
    entries, names = structure
    groups, k = [], 0
    for ks in names:
        groups.append(dict(zip(ks, scalars[k:k + len(ks)])))
        k += len(ks)
    new_params, new_states = [], []
    for (rule, static, _names, gi, *_shapes), p, g, st in zip(entries, params, grads, states):
        new_p, new_st = _update.RULES[rule](p, g, st, **groups[gi], **dict(static))
        new_params.append(new_p)
        new_states.append(new_st)
    return new_params, new_states


def fallback_reason(t: torch.Tensor, device_index=None):
    """Why tensor ``t`` cannot take part in a one-program step (None: it can)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return "subclass"
    if t.device.type != "tpu":
        return "device"
    if t.is_sparse or t.is_complex():
        return "layout"
    if device_index is not None and (t.device.index or 0) != device_index:
        return "devices"
    buf = getattr(t.untyped_storage(), "_tpu_buffer", None)
    if buf is None:
        return "storage"
    spec = views.spec_of(t, buf.array)[0]
    if spec is not None and spec[0] != "r":
        return "view"  # a view of a larger storage (FSDP's flat buffers): torch.optim's path
    return None


def sole(flat, positions):
    """The positions of ``flat`` whose arrays nothing but their storage (and ``flat``) holds."""
    if not _executor.DONATE:  # TORCHTPU_DONATE=0
        return ()
    out = []
    for s in positions:
        if _probe(flat, s) <= _SOLE and hasattr(flat[s], "sharding") \
                and len(flat[s].sharding.device_set) == 1:
            out.append(s)
    return tuple(out)


_PROGRAMS: dict = {}


def n_scalars(structure) -> int:
    return sum(len(ks) for ks in structure[1])


def scalar_value(v, pair=False):
    """A hyperparameter as a traced float32 argument: 0-d (a learning rate), or with ``pair``
    the pair (v, 1 - v) computed in double precision (Adam's betas, see lowering/optim.py)."""
    if isinstance(v, torch.Tensor):
        if v.device.type != "cpu" and not pair:
            return _copy.value_of(v).reshape(()).astype(np.float32)
        v = v.item()
    if pair:
        return np.asarray((v, 1 - v), np.float32)
    return np.asarray(v, np.float32)


def _program(structure, n_entries, donate):
    key = (structure, donate)
    prog = _PROGRAMS.get(key)
    if prog is None:
        n_lr = n_scalars(structure)

        def optimizer_step(*flat):
            count("optim_traces")
            params, grads, states, k = [], [], [], 0
            for _rule, _static, names, _lr, shape, shapes in structure[0]:
                params.append(flat[k].reshape(shape))
                grads.append(flat[k + 1].reshape(shape))
                states.append({n: flat[k + 2 + j].reshape(s)
                               for j, (n, s) in enumerate(zip(names, shapes))})
                k += 2 + len(names)
            new_p, new_s = apply(structure, params, grads, states, flat[k:k + n_lr])
            out, k = [], 0
            for (_r, _s, names, *_), p, st in zip(structure[0], new_p, new_s):
                out.append(p.reshape(flat[k].shape))  # written in the storage array's shape
                olds = dict(zip(names, flat[k + 2:k + 2 + len(names)]))
                out.extend(st[n].reshape(olds[n].shape) if n in olds else st[n]
                           for n in sorted(st))
                k += 2 + len(names)
            return tuple(out)

        prog = _PROGRAMS[key] = program_cache.Program(
            "optim", optimizer_step, program_cache.BY_TEXT, donate_argnums=donate)
    return prog


def run(plan: Plan) -> None:
    """Run ``plan`` as one program and write every new parameter and state value back (new
    state tensors are created in the entries' ``state`` dicts)."""
    if not plan.entries:
        return
    structure = plan.structure()
    flat, written = [], []
    for e in plan.entries:
        written.append(len(flat))
        flat.append(_buffer.buffer_of(e.param).array)
        flat.append(_buffer.buffer_of(e.grad).array)
        for t in e.state.values():
            written.append(len(flat))
            flat.append(_buffer.buffer_of(t).array)
    flat.extend(plan.scalar_values())
    donate = sole(flat, written)
    prog = _program(structure, len(plan.entries), donate)
    count("optim_programs")
    if donate:
        count("optim_donated_buffers", len(donate))
    out = prog(*flat)
    del flat
    k = 0
    for e in plan.entries:
        _buffer.buffer_of(e.param).array = out[k]
        k += 1
        for name in state_names_of(e.rule, e.static):  # sorted, as optimizer_step emits them
            t = e.state.get(name)
            if t is None:
                e.state[name] = _buffer.wrap(out[k])
            else:
                _buffer.buffer_of(t).array = out[k]
            k += 1


def state_names_of(rule, static) -> tuple:
    """The state names ``rule`` returns (sorted), given its static hyperparameters."""
    st = dict(static)
    if rule == "adam":
        return tuple(sorted(("step", "exp_avg", "exp_avg_sq")
                            + (("max_exp_avg_sq",) if st["amsgrad"] else ())))
    if rule == "sgd":
        return ("momentum_buffer",) if st["momentum"] != 0 else ()
    return ("momentum_buffer",)
