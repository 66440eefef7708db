"""Attention on DTensors: sharding strategies and context parallelism for the ops "tpu" reaches.

On CUDA, ``F.scaled_dot_product_attention`` reaches the flash / efficient / cuDNN ops, which
DTensor has sharding strategies for and context parallelism (ring attention) handles. On
"tpu" it reaches ``_scaled_dot_product_fused_attention_overrideable`` (eager/kernels.py), which
PyTorch leaves without either ("Operator ... does not have a sharding strategy registered").
This module gives it, its backward, and ``tpu::splash_sdpa_forward/backward`` the same
strategies PyTorch gives the flash ops (``torch/distributed/tensor/_ops/_matrix_ops.py``):
everything replicated; heads sharded (tensor parallel: dim 1 of q, k, v, out, logsumexp, and of
a bias that has a head dim); batch sharded (data parallel: dim 0). A sequence-sharded input
(sequence parallel activations) is redistributed to one of those by DTensor, as on CUDA.

Context parallelism (``context_parallel``, TorchTitan's ``context_parallel_degree``):
PyTorch's CP dispatcher routes the flash/efficient/cuDNN ops to its ring attention
(``_templated_ring_attention``: rotate K/V around the CP group, merge partial outputs by their
logsumexp) and, while CP is on, adds sequence-sharded (Shard(2)) strategies. Here the
overrideable op and its backward join both: the same ring, each step running our lowering on
the local blocks.

``install(mod)`` runs when DTensor's op strategies are imported, ``install_cp(mod)`` when
PyTorch's context-parallel module is (post-import hooks, ``integrations/__init__.py``).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_fused_attention_overrideable.default
_BWD = aten._scaled_dot_product_fused_attention_overrideable_backward.default
SEQ_DIM = 2
_done = [False]


def _tensor_args(op_schema):
    from torch.distributed.tensor._op_schema import OpStrategy

    return [a for a in op_schema.args_schema if isinstance(a, OpStrategy)]


def _bias_placements(bias_shape, ndim):
    """(heads placement, batch placement) of an additive/boolean mask right-aligned to
    (B, H, L, S): sharded where it has that dim, replicated where it broadcasts."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    shp = (1,) * (ndim - len(bias_shape)) + tuple(bias_shape)
    off = len(bias_shape) - ndim  # bias dim of q's dim d: d + off
    heads = Shard(1 + off) if shp[1] > 1 and 1 + off >= 0 else Replicate()
    batch = Shard(0 + off) if shp[0] > 1 and off >= 0 else Replicate()
    return heads, batch


def _fwd_base(op_schema, seq=False):
    from torch.distributed.tensor.placement_types import Replicate, Shard

    q = op_schema.args_schema[0]
    bias = op_schema.args_schema[3] if len(op_schema.args_schema) > 3 else None
    has_bias = bias is not None and not isinstance(bias, (int, float, bool))
    R = Replicate()
    outs_r = [R, R, None, None, None, None, R, R, None]
    rows = [outs_r + [R, R, R] + ([R] if has_bias else [])]
    if q.ndim == 4:
        bh, bb = _bias_placements(bias.shape, 4) if has_bias else (None, None)
        for dim, bp in ((1, bh), (0, bb)):
            s = Shard(dim)
            rows.append([s, s, None, None, None, None, R, R, None, s, s, s]
                        + ([bp] if has_bias else []))
        if seq and not has_bias:
            s = Shard(SEQ_DIM)
            rows.append([s, s, None, None, None, None, R, R, None, s, s, s])
    return rows


def _bwd_base(op_schema, seq=False):
    """Tensor inputs in order: grad_out, q, k, v, [bias], out, logsumexp, [cum_seq_q,
    cum_seq_k], philox_seed, philox_offset; outputs grad q, k, v, bias."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    args = op_schema.args_schema
    bias = args[4]
    has_bias = bias is not None and not isinstance(bias, (int, float, bool))
    n_tensors = len(_tensor_args(op_schema))
    n_rest = n_tensors - 6 - (1 if has_bias else 0)  # seeds, offsets, cum_seq tensors
    R = Replicate()
    rows = [[R, R, R, R if has_bias else None] + [R] * n_tensors]
    q = args[1]
    if q.ndim == 4:
        bh, bb = _bias_placements(bias.shape, 4) if has_bias else (None, None)
        cases = [(Shard(1), bh), (Shard(0), bb)]
        if seq and not has_bias:
            cases.append((Shard(SEQ_DIM), None))
        for s, bp in cases:
            row = [s, s, s, bp if has_bias else None, s, s, s, s]
            if has_bias:
                row.append(bp)
            row += [s, s] + [R] * n_rest
            rows.append(row)
    return rows


def _fwd_strategy(op_schema, seq=False):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _fwd_base(op_schema, seq),
                                           input_index=9)


def _bwd_strategy(op_schema, seq=False):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _bwd_base(op_schema, seq),
                                           input_index=4)


# ------------------------------------------------ tpu::splash_sdpa (heads / batch sharding)

def _splash_fwd_strategy(op_schema):
    """splash_sdpa_forward(q, k, v, q_seg?, kv_seg?, ...) -> (out, lse)."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    n_seg = len(_tensor_args(op_schema)) - 3
    R = Replicate()
    rows = [[R, R, R, R, R] + [R] * n_seg,
            [Shard(1)] * 5 + [R] * n_seg,
            [Shard(0)] * 5 + [Shard(0)] * n_seg]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, rows,
                                           input_index=2)


def _splash_bwd_strategy(op_schema):
    """splash_sdpa_backward(grad_out, q, k, v, out, lse, q_seg?, kv_seg?, ...) -> (dq, dk, dv)."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    n_seg = len(_tensor_args(op_schema)) - 6
    R = Replicate()
    rows = [[R] * 9 + [R] * n_seg,
            [Shard(1)] * 9 + [R] * n_seg,
            [Shard(0)] * 9 + [Shard(0)] * n_seg]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False),
                                           op_schema, rows, input_index=3)


# ------------------------------------------------ context parallelism (ring attention)

def _ring_forward(mesh, query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False,
                  return_debug_mask=False, *, scale=None):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if attn_bias is not None:
        raise NotImplementedError("context parallel attention on 'tpu': attn_mask is not "
                                  "supported (use is_causal)")
    return cp._templated_ring_attention(mesh.get_group(), SEQ_DIM, _FWD, query=query, key=key,
                                        value=value, is_causal=is_causal, dropout_p=dropout_p,
                                        scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, attn_bias, grad_input_mask, out,
                   logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   philox_seed, philox_offset, *, scale=None):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    return cp._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, _BWD, grad_out=grad_out, grad_out_name="grad_out",
        query=query, key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal,
        attn_bias=None, grad_input_mask=grad_input_mask, cum_seq_q=cum_seq_q,
        cum_seq_k=cum_seq_k, max_q=max_q, max_k=max_k, dropout_p=dropout_p,
        philox_seed=philox_seed, philox_offset=philox_offset, scale=scale)


def _cp_handler(op_call, args, kwargs):
    """PyTorch's ``_sdpa_handler`` for the overrideable ops: propagate (the CP strategy makes
    the sequence-sharded inputs valid as they are), run the ring on the local shards, wrap."""
    from torch.distributed.tensor import DTensor

    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise RuntimeError(f"context parallel {op_call}: the inputs would need a "
                           "redistribution (expected q, k, v sharded on the sequence dim)")
    fn = _ring_forward if op_call == _FWD else _ring_backward
    local = fn(info.compute_mesh, *info.local_args, **info.local_kwargs)
    return DTensor._op_dispatcher.wrap(local, sharding.output_spec)


def install_cp(mod=None) -> None:
    """Join PyTorch's context-parallel dispatcher (when its module is imported)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules as rules

    cp.custom_ops[_FWD] = _cp_handler
    cp.custom_ops[_BWD] = _cp_handler
    if getattr(rules.register_cp_sharding_rules, "_torchtpu", False):
        return
    orig_register, orig_unregister = rules.register_cp_sharding_rules, \
        rules.unregister_cp_sharding_rules
    ctxs: dict = {}

    def register_cp_sharding_rules():
        orig_register()
        if ctxs:
            return
        for op, fn, info in ((_FWD, lambda s: _fwd_strategy(s, seq=True),
                              RuntimeSchemaInfo(4, static_kwargkey=["scale"])),
                             (_BWD, lambda s: _bwd_strategy(s, seq=True), None)):
            ctx = rules._op_strategy_context(op, fn, info)
            ctx.__enter__()
            ctxs[op] = ctx

    def unregister_cp_sharding_rules(clear_the_cache=False):
        for ctx in ctxs.values():
            ctx.__exit__(None, None, None)
        ctxs.clear()
        orig_unregister(clear_the_cache)

    register_cp_sharding_rules._torchtpu = True
    rules.register_cp_sharding_rules = register_cp_sharding_rules
    rules.unregister_cp_sharding_rules = unregister_cp_sharding_rules


def install(mod=None) -> None:
    """Register the strategies (idempotent); ``mod``: the module whose import triggered it."""
    if _done[0]:
        return
    _done[0] = True
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy

    register_op_strategy(_FWD, schema_info=RuntimeSchemaInfo(4, static_kwargkey=["scale"]))(
        _fwd_strategy)
    register_op_strategy(_BWD)(_bwd_strategy)
    from ..ops import attention as splash  # noqa: F401  (defines the tpu ops)

    register_op_strategy(torch.ops.tpu.splash_sdpa_forward.default,
                         schema_info=RuntimeSchemaInfo(5))(_splash_fwd_strategy)
    register_op_strategy(torch.ops.tpu.splash_sdpa_backward.default,
                         schema_info=RuntimeSchemaInfo(8))(_splash_bwd_strategy)
