"""The optimizers' update rules: pure JAX functions of one parameter, its gradient and its state.

Each rule is ``rule(p, g, state, **hyperparameters) -> (new_p, new_state)`` on jax arrays:
``state`` a dict of the parameter's state arrays (named as ``torch.optim`` names them in its
state_dict; a name missing from it is created by the rule, as torch.optim creates it at the
first step). The hyperparameters in ``TRACED[rule]`` arrive as traced 0-d float32 values (a
scheduler changing them never recompiles); the others are static (the rule may branch on them). AdamW and SGD are the lowerings of PyTorch's fused optimizer ops
(``lowering/optim.py``, called on one-element lists), so their math is the one table's; Muon has
no aten op and is written here, following ``torch.optim.Muon``.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from ..lowering.registry import aten, get

_f32 = jnp.float32


def adam(p, g, state, *, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled):
    """torch.optim.Adam / AdamW (``decoupled``): the state has ``step`` (incremented here),
    ``exp_avg``, ``exp_avg_sq`` and with amsgrad ``max_exp_avg_sq``."""
    step = state["step"] + 1
    op = aten._fused_adamw.default if decoupled else aten._fused_adam.default
    vmax = [state["max_exp_avg_sq"]] if amsgrad else []
    new = get(op).fn([p], [g], [state["exp_avg"]], [state["exp_avg_sq"]], vmax, [step], lr=lr,
                     beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                     amsgrad=amsgrad, maximize=maximize)
    out = {"step": step, "exp_avg": new[2][0], "exp_avg_sq": new[3][0]}
    if amsgrad:
        out["max_exp_avg_sq"] = new[4][0]
    return new[0][0], out


def sgd(p, g, state, *, lr, momentum, dampening, weight_decay, nesterov, maximize):
    """torch.optim.SGD: with momentum the state has ``momentum_buffer`` (the gradient itself
    at the first step, as torch.optim makes it)."""
    buf = state.get("momentum_buffer")
    new = get(aten._fused_sgd.default).fn(
        [p], [g], [jnp.zeros_like(p) if buf is None else buf], weight_decay=weight_decay, momentum=momentum,
        lr=lr, dampening=dampening, nesterov=nesterov, maximize=maximize,
        is_first_step=buf is None)
    return new[0][0], ({"momentum_buffer": new[2][0]} if momentum != 0 else {})


def _lerp(a, b, w: float):
    return get(aten.lerp.Scalar).fn(a, b, w)


def newton_schulz(x, coefficients, steps: int, eps: float):
    """``torch.optim.Muon``'s orthogonalisation of a 2-D matrix: quintic Newton-Schulz
    iterations in bfloat16 (each product accumulated in float32 and rounded once, as
    ``torch.mm``/``torch.addmm`` do on bfloat16)."""
    a, b, c = coefficients
    bf16 = jnp.bfloat16
    x = x.astype(bf16)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(_f32)))).astype(bf16)
    x = x / jnp.maximum(norm, jnp.asarray(eps, bf16))
    for _ in range(steps):
        gram = jnp.matmul(x, x.T, preferred_element_type=_f32).astype(bf16)
        upd = (b * gram.astype(_f32)
               + c * jnp.matmul(gram, gram, preferred_element_type=_f32)).astype(bf16)
        x = (a * x.astype(_f32) + jnp.matmul(upd, x, preferred_element_type=_f32)).astype(bf16)
    return x.T if tall else x


def lr_ratio(adjust_lr_fn, shape) -> float:
    """Muon's learning-rate factor for a parameter of ``shape`` (torch.optim.Muon's)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def muon(p, g, state, *, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
         adjust_lr_fn):
    """torch.optim.Muon: momentum (``momentum_buffer``), Newton-Schulz orthogonalisation of
    the (Nesterov) update, decoupled weight decay, the shape-adjusted learning rate."""
    buf = state["momentum_buffer"]
    buf = _lerp(buf, g, 1 - momentum)
    update = _lerp(g, buf, momentum) if nesterov else buf
    update = newton_schulz(update, ns_coefficients, ns_steps, eps)
    pf = p.astype(_f32)
    pf = pf * (1 - lr * weight_decay)
    pf = pf - (lr * lr_ratio(adjust_lr_fn, p.shape)) * update.astype(_f32)
    return pf.astype(p.dtype), {"momentum_buffer": buf}


RULES = {"adam": adam, "sgd": sgd, "muon": muon}
TRACED = {"adam": ("lr", "beta1", "beta2"), "sgd": ("lr",), "muon": ("lr",)}
PAIRS = ("beta1", "beta2")  # traced as (beta, 1 - beta), computed on the host in double


def split(rule: str, hyper: dict) -> tuple[dict, tuple]:
    """(traced, static) of a rule's hyperparameters ``hyper`` (static as sorted pairs)."""
    traced = {k: v for k, v in hyper.items() if k in TRACED[rule]}
    return traced, tuple(sorted((k, v) for k, v in hyper.items() if k not in TRACED[rule]))
