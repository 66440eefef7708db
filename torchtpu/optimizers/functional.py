"""``torch.tpu.optimizers.functional``: the updates as functions of tensor lists, each one XLA
program with the parameters and state donated (``torch.optim``'s functional signatures, less
the implementation switches ``foreach``/``fused``/``capturable``). The tensors are updated in
place, as torch.optim's functionals update them; lists holding tensors that cannot take part
in one program (not on "tpu", views of larger storages, subclasses) run torch.optim's own
functional instead, counted as ``optim_fallbacks``.
"""
from __future__ import annotations

import torch
import torch.optim.adamw as _t_adamw
import torch.optim.adam as _t_adam
import torch.optim.sgd as _t_sgd
import torch.optim._muon as _t_muon

from ..runtime.metrics import count
from . import program as _program
from . import update as _update

__all__ = ["adam", "adamw", "sgd", "muon"]


def _run(rule, hyper, params, grads, states) -> bool:
    """Run one program for these lists; False (nothing done) when they cannot be one."""
    if torch.compiler.is_compiling():
        count("optim_fallbacks", op="compiling")
        return False
    index = (params[0].device.index or 0) if params else 0
    for t in [*params, *grads, *(v for st in states for v in st.values())]:
        why = _program.fallback_reason(t, index)
        if why is not None:
            count("optim_fallbacks", op=why)
            return False
    traced, static = _update.split(rule, hyper)
    entries = [_program.Entry(p, g, st, rule, static, 0) for p, g, st in zip(params, grads, states)]
    _program.run(_program.Plan(entries, [traced]))
    return True


def _adam(decoupled, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
          amsgrad, beta1, beta2, lr, weight_decay, eps, maximize):
    states = []
    for i in range(len(params)):
        st = {"step": state_steps[i], "exp_avg": exp_avgs[i], "exp_avg_sq": exp_avg_sqs[i]}
        if amsgrad:
            st["max_exp_avg_sq"] = max_exp_avg_sqs[i]
        states.append(st)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 amsgrad=amsgrad, maximize=maximize, decoupled=decoupled)
    with torch.no_grad():
        return _run("adam", hyper, params, grads, states)


def adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad=False,
          beta1, beta2, lr, weight_decay, eps, maximize=False) -> None:
    """``torch.optim.adamw.adamw`` as one program (``state_steps`` incremented, as there)."""
    kw = dict(amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
              eps=eps, maximize=maximize)
    if not _adam(True, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kw):
        _t_adamw.adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                       foreach=False, **kw)


def adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad=False,
         beta1, beta2, lr, weight_decay, eps, maximize=False) -> None:
    """``torch.optim.adam.adam`` as one program (``state_steps`` incremented, as there)."""
    kw = dict(amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
              eps=eps, maximize=maximize)
    if not _adam(False, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **kw):
        _t_adam.adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                     foreach=False, **kw)


def sgd(params, d_p_list, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
        nesterov, maximize=False) -> None:
    """``torch.optim.sgd.sgd`` as one program: a ``None`` in ``momentum_buffer_list`` (a first
    step) is replaced by the new buffer, as torch.optim's functional does."""
    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                 nesterov=nesterov, maximize=maximize)
    states = [{} if momentum == 0 or b is None else {"momentum_buffer": b}
              for b in (momentum_buffer_list if momentum != 0 else [None] * len(params))]
    with torch.no_grad():
        done = _run("sgd", hyper, params, d_p_list, states)
    if not done:
        _t_sgd.sgd(params, d_p_list, momentum_buffer_list, foreach=False,
                   weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                   nesterov=nesterov, maximize=maximize)
    elif momentum != 0:
        for i, st in enumerate(states):
            momentum_buffer_list[i] = st["momentum_buffer"]


def muon(params, grads, muon_momentum_bufs, *, lr, weight_decay, momentum, nesterov=True,
         ns_coefficients=(_t_muon.DEFAULT_A, _t_muon.DEFAULT_B, _t_muon.DEFAULT_C),
         ns_steps=_t_muon.DEFAULT_NS_STEPS, eps=_t_muon.EPS, adjust_lr_fn=None) -> None:
    """``torch.optim._muon.muon`` (2-D parameters) as one program."""
    for g in grads:
        if g.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
    hyper = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                 ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                 adjust_lr_fn=adjust_lr_fn)
    states = [{"momentum_buffer": b} for b in muon_momentum_bufs]
    with torch.no_grad():
        done = _run("muon", hyper, params, grads, states)
    if not done:
        _t_muon.muon(params, grads, muon_momentum_bufs, lr=lr, weight_decay=weight_decay,
                     momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
                     ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn, has_complex=False)
