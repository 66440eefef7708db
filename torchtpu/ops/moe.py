"""Mixture-of-experts kernels: ``torch.tpu.ops.ragged_dot``.

``ragged_dot(lhs, rhs, group_sizes, *, preferred_element_type=None)`` mirrors
``jax.lax.ragged_dot``: lhs [m, k] holds consecutive row groups of ``group_sizes`` [g] rows
(from row 0; rows past ``sum(group_sizes)`` give zeros), rhs [g, k, n] one matrix per group;
the result [m, n] is ``lhs[group i] @ rhs[i]`` per group, one grouped matmul (on TPU the
megablox ``gmm`` Pallas kernel JAX ships; see ``lowering/grouped_mm.py`` for the others).
Half-precision inputs accumulate in float32; ``preferred_element_type`` picks the result dtype
(default: the inputs'). JAX's ``precision`` argument has no torch spelling: float32 products
follow ``torch.set_float32_matmul_precision`` / ``torch.tpu.precision`` as ``mm`` does.

It is the torch op ``torch.ops.tpu.ragged_dot`` with a fake kernel (Dynamo, FakeTensor and
torch.export see it), autograd (``lhs`` and ``rhs``; the weight gradient is the grouped
contraction ``torch.ops.tpu.ragged_dot_contract``, megablox's ``tgmm``), a lowering in the one
table (Strict, Fused and compiled graphs run it as one XLA program, no CPU fallback), and a
CPU kernel (a per-group ``mm`` loop) for CPU tensors. Group sizes are checked on the device
(non-negative, summing to at most m): a violation raises at the next host sync.
"""
from __future__ import annotations

import torch

from ..eager import kernels as _kernels
from ..lowering import grouped_mm as _gmm
from ..lowering import registry as _registry

__all__ = ["ragged_dot"]

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define("ragged_dot(Tensor lhs, Tensor rhs, Tensor group_sizes, *, "
            "ScalarType? preferred_element_type=None) -> Tensor")
_lib.define("ragged_dot_contract(Tensor lhs, Tensor rhs, Tensor group_sizes, *, "
            "ScalarType? out_dtype=None) -> Tensor")
_ops = torch.ops.tpu


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *,
               preferred_element_type: torch.dtype | None = None) -> torch.Tensor:
    """Grouped matmul, ``jax.lax.ragged_dot``'s signature: lhs [m, k], rhs [g, k, n],
    group_sizes [g] (integer) -> [m, n]. See the module docstring."""
    return _ops.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


# ---------------------------------------------------------------- shapes (fake kernels)

def _check(lhs, rhs, group_sizes, contract):
    name = "ragged_dot_contract" if contract else "ragged_dot"
    if not (lhs.dtype.is_floating_point and lhs.dtype == rhs.dtype):
        raise RuntimeError(f"{name}: expected lhs and rhs of one floating dtype, got "
                           f"{lhs.dtype} and {rhs.dtype}")
    if group_sizes.dim() != 1 or group_sizes.dtype.is_floating_point \
            or group_sizes.dtype == torch.bool or group_sizes.is_complex():
        raise RuntimeError(f"{name}: group_sizes must be a 1-D integer tensor")
    if contract:
        torch._check(lhs.dim() == 2 and rhs.dim() == 2 and lhs.shape[1] == rhs.shape[0],
                     lambda: f"{name}: expected lhs [k, m] and rhs [m, n], got "
                             f"{list(lhs.shape)} and {list(rhs.shape)}")
    else:
        torch._check(lhs.dim() == 2 and rhs.dim() == 3,
                     lambda: f"{name}: expected lhs [m, k] and rhs [g, k, n], got "
                             f"{list(lhs.shape)} and {list(rhs.shape)}")
        torch._check(lhs.shape[1] == rhs.shape[1] and rhs.shape[0] == group_sizes.shape[0],
                     lambda: f"{name}: shapes {list(lhs.shape)}, {list(rhs.shape)} and "
                             f"group_sizes {list(group_sizes.shape)} do not match (lhs [m, k], "
                             "rhs [g, k, n], group_sizes [g])")


@torch.library.register_fake("tpu::ragged_dot")
def _ragged_dot_fake(lhs, rhs, group_sizes, *, preferred_element_type=None):
    _check(lhs, rhs, group_sizes, False)
    return lhs.new_empty((lhs.shape[0], rhs.shape[2]), dtype=preferred_element_type or lhs.dtype)


@torch.library.register_fake("tpu::ragged_dot_contract")
def _contract_fake(lhs, rhs, group_sizes, *, out_dtype=None):
    _check(lhs, rhs, group_sizes, True)
    return lhs.new_empty((group_sizes.shape[0], lhs.shape[0], rhs.shape[1]),
                         dtype=out_dtype or lhs.dtype)


# ---------------------------------------------------------------- CPU tensors: per-group loop

def _acc(t):
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _ragged_dot_cpu(lhs, rhs, group_sizes, *, preferred_element_type=None):
    _check(lhs, rhs, group_sizes, False)
    out = torch.zeros((lhs.shape[0], rhs.shape[2]), dtype=preferred_element_type or lhs.dtype)
    start = 0
    for i, n in enumerate(_sizes(group_sizes, lhs.shape[0])):
        out[start:start + n] = (_acc(lhs[start:start + n]) @ _acc(rhs[i])).to(out.dtype)
        start += n
    return out


def _contract_cpu(lhs, rhs, group_sizes, *, out_dtype=None):
    _check(lhs, rhs, group_sizes, True)
    out = torch.zeros((group_sizes.shape[0], lhs.shape[0], rhs.shape[1]),
                      dtype=out_dtype or lhs.dtype)
    start = 0
    for i, n in enumerate(_sizes(group_sizes, lhs.shape[1])):
        out[i] = (_acc(lhs[:, start:start + n]) @ _acc(rhs[start:start + n])).to(out.dtype)
        start += n
    return out


def _sizes(group_sizes, total):
    sizes = [int(s) for s in group_sizes.tolist()]
    if any(s < 0 for s in sizes) or sum(sizes) > total:
        raise RuntimeError(_SIZES_MSG)
    return sizes


_lib.impl("ragged_dot", _ragged_dot_cpu, "CPU")
_lib.impl("ragged_dot_contract", _contract_cpu, "CPU")

# ---------------------------------------------------------------- tpu tensors: the table

_SIZES_MSG = ("ragged_dot: group_sizes must be non-negative and sum to at most the grouped "
              "dimension's size")


def _rows_ok(lhs, rhs, group_sizes, **kwargs):
    return _gmm.ragged_sizes_ok(lhs, rhs, group_sizes, ragged_dim=0)


def _cols_ok(lhs, rhs, group_sizes, **kwargs):
    return _gmm.ragged_sizes_ok(lhs, rhs, group_sizes, ragged_dim=1)


for _op, _fn, _ok in ((_ops.ragged_dot.default, _gmm.ragged_dot, _rows_ok),
                      (_ops.ragged_dot_contract.default, _gmm.ragged_dot_contract, _cols_ok)):
    _registry.register(_op, reads_precision=True, check=(_ok, RuntimeError, _SIZES_MSG))(_fn)
    # bound now if the device is registered already (torch.tpu imports this module while
    # registering, before the table is bound: bind_table then binds these too)
    _kernels.bind_lowering(_registry.get(_op))


# ---------------------------------------------------------------- autograd

def _setup(ctx, inputs, output, keyword_only_inputs=None):
    lhs, rhs, group_sizes = inputs
    ctx.save_for_backward(lhs, rhs, group_sizes)


def _backward(ctx, grad):
    lhs, rhs, group_sizes = ctx.saved_tensors
    d_lhs = d_rhs = None
    dt = grad.dtype
    if ctx.needs_input_grad[0]:
        d_lhs = _ops.ragged_dot(grad, rhs.to(dt).transpose(1, 2), group_sizes).to(lhs.dtype)
    if ctx.needs_input_grad[1]:
        d_rhs = _ops.ragged_dot_contract(lhs.to(dt).t(), grad, group_sizes).to(rhs.dtype)
    return d_lhs, d_rhs, None


torch.library.register_autograd("tpu::ragged_dot", _backward, setup_context=_setup)
