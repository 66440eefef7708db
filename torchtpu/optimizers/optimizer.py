"""``torch.tpu.optimizers.AdamW``, ``Adam``, ``SGD`` and ``Muon``: ``torch.optim``'s classes
whose ``step()`` updates every parameter of every group in one XLA program.

Each class subclasses its ``torch.optim`` namesake, so parameter groups, ``state_dict`` /
``load_state_dict`` (the same keys and state names; ``step`` lives on the device, as with
``fused=True``), learning-rate schedulers, hooks and ``zero_grad`` are torch.optim's own. Only
``step`` differs: it builds a ``program.Plan`` and runs it (``program.run``). Where a step
cannot be one program (a parameter on another device, a view of a larger storage as FSDP's
flat parameters are, a tensor subclass, ``differentiable=True``, inside a ``torch.compile``d
region), ``step`` is torch.optim's, counted in ``torch.tpu.metrics()`` as
``optim_fallbacks`` with the reason.
"""
from __future__ import annotations

import torch

from ..runtime.metrics import count
from . import program as _program
from . import update as _update


def _zeros_like(p):
    return torch.zeros_like(p, memory_format=torch.preserve_format)


class _OneProgramStep:
    """The ``step`` shared by the classes below (mixed in before the torch.optim class)."""

    _rule: str = ""

    def _hyper(self, group) -> dict:  # the rule's hyperparameters (update.py's names)
        raise NotImplementedError

    def _init_state(self, p, group, state) -> None:  # torch.optim's lazy state initialisation
        raise NotImplementedError

    def _has_state(self, group) -> bool:  # False: torch.optim keeps no state for the group
        return True

    def _traced(self, group) -> dict:
        """The group's hyperparameters that the program takes as arguments."""
        return _update.split(self._rule, self._hyper(group))[0]

    def _entry(self, p, group, index) -> _program.Entry:
        """``p``'s Entry (its state initialised as torch.optim initialises it); ``index``: its
        group's position in the plan's ``scalars``."""
        static = _update.split(self._rule, self._hyper(group))[1]
        if not self._has_state(group):
            return _program.Entry(p, p.grad, {}, self._rule, static, index)
        state = self.state[p]
        self._init_state(p, group, state)
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != p.device:
            state["step"] = step.to(p.device, torch.float32)  # loaded from a CPU state_dict
        return _program.Entry(p, p.grad, state, self._rule, static, index)

    def _plan(self):
        """(Plan, None) for this step, or (None, why it cannot be one program)."""
        if torch.compiler.is_compiling():
            return None, "compiling"
        entries, scalars = [], []
        index = None
        for group in self.param_groups:
            if group.get("differentiable"):
                return None, "differentiable"
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if index is None:
                    index = p.device.index or 0
                why = _program.fallback_reason(p, index) or _program.fallback_reason(p.grad, index)
                if why is not None:
                    return None, why
            scalars.append(self._traced(group))
            entries.extend(self._entry(p, group, len(scalars) - 1) for p in params)
        for e in entries:
            for t in e.state.values():
                why = _program.fallback_reason(t, index)
                if why is not None:
                    return None, why
        return _program.Plan(entries, scalars), None

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step over every parameter with a gradient: one XLA program."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan, why = self._plan()
        if plan is None:
            count("optim_fallbacks", op=why)
            base = self._torch_class.step
            base = base.__wrapped__ if getattr(base, "hooked", False) else base
            base(self)  # torch.optim's step (its hooks already ran around this one)
            return loss
        _program.run(plan)
        return loss


class Adam(_OneProgramStep, torch.optim.Adam):
    """``torch.optim.Adam`` with the whole step as one program (``_fused_adam``'s math)."""

    _rule = "adam"
    _torch_class = torch.optim.Adam

    def _hyper(self, group):
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                    maximize=group["maximize"],
                    decoupled=bool(group.get("decoupled_weight_decay", False)))

    def _init_state(self, p, group, state):
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = _zeros_like(p)
            state["exp_avg_sq"] = _zeros_like(p)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = _zeros_like(p)


class AdamW(Adam, torch.optim.AdamW):
    """``torch.optim.AdamW`` with the whole step as one program (``_fused_adamw``'s math)."""

    _torch_class = torch.optim.AdamW

    def _hyper(self, group):
        return dict(super()._hyper(group),
                    decoupled=bool(group.get("decoupled_weight_decay", True)))


class SGD(_OneProgramStep, torch.optim.SGD):
    """``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, maximize) with the
    whole step as one program (``_fused_sgd``'s math)."""

    _rule = "sgd"
    _torch_class = torch.optim.SGD

    def _hyper(self, group):
        return dict(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                    weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                    maximize=group["maximize"])

    def _has_state(self, group):
        return group["momentum"] != 0

    def _init_state(self, p, group, state):
        # torch.optim's first buffer is the gradient itself; with no dampening that equals
        # momentum * 0 + grad, so the buffer starts at zeros and every step is one program
        # variant. With dampening the first step is its own variant (the rule makes the buffer).
        if group["momentum"] != 0 and group["dampening"] == 0 \
                and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = _zeros_like(p)
        if state.get("momentum_buffer", 0) is None:
            del state["momentum_buffer"]  # a torch.optim state_dict saved before a first step


class Muon(_OneProgramStep, torch.optim.Muon):
    """``torch.optim.Muon`` (2-D parameters) with the whole step as one program."""

    _rule = "muon"
    _torch_class = torch.optim.Muon

    def _hyper(self, group):
        return dict(lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                    nesterov=group["nesterov"], ns_coefficients=tuple(group["ns_coefficients"]),
                    eps=group["eps"], ns_steps=group["ns_steps"],
                    adjust_lr_fn=group["adjust_lr_fn"])

    def _init_state(self, p, group, state):
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = _zeros_like(p)
