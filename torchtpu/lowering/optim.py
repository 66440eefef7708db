"""PyTorch's fused optimizer ops (``torch.optim.Adam/AdamW/SGD/Adagrad(fused=True)``): the whole
update of every parameter as one pure function.

The functional forms (``_fused_adam(w)``, ``_fused_sgd``, ``_fused_adagrad``: new params, grads,
state) are the lowerings, which torch.compile graphs use; the in-place forms that eager calls
update their lists in place and are composed of the functional op and ``_foreach_copy_``
(``eager/multi_write_kernels.py``).
The math follows CUDA's and CPU's fused kernels: the step counts are already incremented; with
``grad_scale`` the gradients are unscaled (and written back); with ``found_inf`` set, nothing
changes.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch

from .registry import aten, register


def _scalar(x):
    """A 0-d float32 value of a Python number or a one-element tensor (lr, grad_scale)."""
    if hasattr(x, "dtype"):
        return x.reshape(()).astype(jnp.float32)
    return x


def _unscaled(g, grad_scale):
    """A gradient in float32, divided by GradScaler's scale when there is one."""
    g = g.astype(jnp.float32)
    return g if grad_scale is None else g / _scalar(grad_scale)


def _skipped(found_inf):
    """The "skip this step" flag (found_inf == 1), or None when no check applies."""
    return None if found_inf is None else _scalar(found_inf) == 1.0


def _emit(outs, olds, new, skip):
    """Append each new value (cast back to its tensor's dtype; the old one on a skipped step)."""
    for k, (o, n) in enumerate(zip(olds, new)):
        n = n.astype(o.dtype)
        outs[k].append(n if skip is None else jnp.where(skip, o, n))


def _beta(beta):
    """(beta, 1 - beta) of an Adam beta: a Python float, or a traced float32 pair (beta,
    1 - beta) that torch.tpu.optimizers computes on the host in double precision (so that a
    scheduler cycling the betas, OneCycleLR's, neither recompiles nor rounds 1 - beta in
    float32)."""
    if hasattr(beta, "shape"):
        return beta[0], beta[1]
    return jnp.float32(beta), 1 - beta


def _adam(adamw: bool):
    def fused_adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr,
                   beta1, beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None,
                   found_inf=None):
        lr = _scalar(lr)
        skip = _skipped(found_inf)
        outs = ([], [], [], [], [])
        for i, p0 in enumerate(self):
            f32 = jnp.float32
            p, m0, v0 = p0.astype(f32), exp_avgs[i].astype(f32), exp_avg_sqs[i].astype(f32)
            g = _unscaled(grads[i], grad_scale)
            g_out = g
            if maximize:
                g = -g
            if weight_decay != 0:
                if adamw:
                    p = p * (1 - lr * weight_decay)
                else:
                    g = g + weight_decay * p
            step = _scalar(state_steps[i])
            (b1, c1), (b2, c2) = _beta(beta1), _beta(beta2)
            m = m0 + (g - m0) * c1
            v = v0 * b2 + g * g * c2
            bias1 = 1 - jnp.power(b1, step)
            bias2_sqrt = jnp.sqrt(1 - jnp.power(b2, step))
            new = [p, g_out, m, v]
            if amsgrad:
                vmax = jnp.maximum(max_exp_avg_sqs[i].astype(f32), v)
                denom = jnp.sqrt(vmax) / bias2_sqrt + eps
                new.append(vmax)
            else:
                denom = jnp.sqrt(v) / bias2_sqrt + eps
            new[0] = p - (lr / bias1) * m / denom
            olds = [p0, grads[i], exp_avgs[i], exp_avg_sqs[i]] + (
                [max_exp_avg_sqs[i]] if amsgrad else [])
            _emit(outs, olds, new, skip)
        return tuple(list(o) for o in outs)

    return fused_adam


register(aten._fused_adam.default, aten._fused_adam.tensor_lr)(_adam(adamw=False))
register(aten._fused_adamw.default, aten._fused_adamw.tensor_lr)(_adam(adamw=True))


@register(aten._fused_sgd.default, aten._fused_sgd.tensor_lr)
def fused_sgd(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
              nesterov, maximize, is_first_step, grad_scale=None, found_inf=None):
    lr = _scalar(lr)
    skip = _skipped(found_inf)
    outs = ([], [], [])
    for i, p0 in enumerate(self):
        p = p0.astype(jnp.float32)
        g = _unscaled(grads[i], grad_scale)
        new = [None, g]
        olds = [p0, grads[i]]
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            buf = g if is_first_step else (
                momentum * momentum_buffer_list[i].astype(jnp.float32) + (1 - dampening) * g)
            g = g + momentum * buf if nesterov else buf
            new.append(buf)
            olds.append(momentum_buffer_list[i])
        new[0] = p - lr * g
        _emit(outs, olds, new, skip)
    return tuple(list(o) for o in outs)


@register(aten._fused_adagrad.default, aten._fused_adagrad.tensor_lr)
def fused_adagrad(self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps,
                  maximize, grad_scale=None, found_inf=None):
    tensor_lr = hasattr(lr, "dtype")
    lr = _scalar(lr)
    skip = _skipped(found_inf)
    outs = ([], [], [], [])
    for i, p0 in enumerate(self):
        p = p0.astype(jnp.float32)
        g = _unscaled(grads[i], grad_scale)
        g_out = g
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g + weight_decay * p
        clr = lr / (1 + (_scalar(state_steps[i]) - 1) * lr_decay)
        total = state_sums[i].astype(jnp.float32) + g * g
        new = [p - clr * g / (jnp.sqrt(total) + eps), g_out, total, state_steps[i]]
        _emit(outs, [p0, grads[i], state_sums[i], state_steps[i]], new, skip)
    # the tensor_lr overload returns no state_steps list (its schema has three results)
    return tuple(list(o) for o in outs[:3 if tensor_lr else 4])


# The in-place forms eager calls (``_fused_adamw_``...): one program that writes every changed
# list into its tensors' storages (flag ``writes``), so the executors donate the old parameter
# and state arrays and the update needs no second copy of them (eager/multi_write_kernels.py
# routes there unless written tensors share a storage).
def _in_place(functional, returns, writes):
    """The in-place lowering of a fused optimizer op: the functional lowering's new values of
    the arguments ``writes(args, kwargs)`` names (``returns``: the names of its result lists),
    flattened in that order."""
    def fused_in_place(*args, **kwargs):
        new = functional(*args, **kwargs)
        names = writes(args, kwargs)
        return [a for name, values in zip(returns, new) if name in names for a in values]

    return fused_in_place


def _unscaled_grads(kwargs):
    return kwargs.get("grad_scale") is not None  # the gradients change only when unscaled


def _adam_writes(args, kwargs):
    return (("self",) + (("grads",) if _unscaled_grads(kwargs) else ())
            + ("exp_avgs", "exp_avg_sqs") + (("max_exp_avg_sqs",) if kwargs.get("amsgrad") else ()))


def _sgd_writes(args, kwargs):
    return (("self",) + (("grads",) if _unscaled_grads(kwargs) else ())
            + (("momentum_buffer_list",) if kwargs.get("momentum", 0) != 0 else ()))


def _adagrad_writes(args, kwargs):
    # the step counts are incremented by the optimizer before the op (returned unchanged)
    return ("self",) + (("grads",) if _unscaled_grads(kwargs) else ()) + ("state_sums",)


_ADAM_RESULTS = ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")
for _name, _adamw in (("_fused_adam_", False), ("_fused_adamw_", True)):
    _packet = getattr(aten, _name)
    register(_packet.default, _packet.tensor_lr, writes=_adam_writes)(
        _in_place(_adam(_adamw), _ADAM_RESULTS, _adam_writes))
register(aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr, writes=_sgd_writes)(
    _in_place(fused_sgd, ("self", "grads", "momentum_buffer_list"), _sgd_writes))
register(aten._fused_adagrad_.default, aten._fused_adagrad_.tensor_lr, writes=_adagrad_writes)(
    _in_place(fused_adagrad, ("self", "grads", "state_sums", "state_steps"), _adagrad_writes))
