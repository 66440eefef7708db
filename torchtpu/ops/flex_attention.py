"""Eager FlexAttention on "tpu" through the lowering table: ``tpu::flex_attention`` ops.

Eager ``flex_attention`` runs the ``flex_attention`` higher-order op on real tensors (under
Dynamo's "eager" backend): its autograd wrapper calls the HOP again below autograd, where
PyTorch's default is the dense math reference (``sdpa_dense``: the L x S scores as tpu ops).
``integrations/flex_attention.py`` registers a PrivateUse1 implementation of the HOP (and of
its backward) that calls the ops defined here instead, so eager FlexAttention gets the same
lowering as a compiled graph (``lowering/flex_attention.py``: blockwise, block-sparse,
memory O(L*d) per head), in Strict and Fused mode alike.

A HOP's ``score_mod`` / ``mask_mod`` are Python callables (Dynamo's graphs of torch
functions); the lowering evaluates aten graphs. ``aten_graph`` traces a callable once with
``make_fx`` on 0-d example values (as PyTorch's own tracing of the HOP does) and files the
graph under a key spelt from its code, which the op takes as a static string argument: the
executors' caches (and the persistent compile cache) key on the graph's code, and a second
process finds the same key after tracing the same function.
"""
from __future__ import annotations

import hashlib
import weakref

import torch

from ..lowering import flex_attention as _lowering
from ..lowering.hops import graph_code, placeholder_dtypes
from ..lowering.registry import register

__all__: list = []

GRAPHS: dict = {}  # key -> aten GraphModule (score_mod, mask_mod, joint graph)
_traced: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define(
    "flex_attention(Tensor query, Tensor key, Tensor value, Tensor?[] block_tables, "
    "int[] block_sizes, Tensor[] score_mod_buffers, Tensor[] mask_mod_buffers, "
    "str score_mod, str mask_mod, float scale) -> (Tensor, Tensor, Tensor)")
_lib.define(
    "flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, Tensor grad_out, Tensor? grad_logsumexp, Tensor?[] block_tables, "
    "int[] block_sizes, Tensor[] score_mod_buffers, Tensor[] mask_mod_buffers, str fw_graph, "
    "str joint_graph, str mask_mod, float scale) -> (Tensor, Tensor, Tensor, Tensor[])")

_fwd = torch.ops.tpu.flex_attention.default
_bwd = torch.ops.tpu.flex_attention_backward.default


def file_graph(gm: torch.fx.GraphModule) -> str:
    """File an aten graph under a key spelt from its code and input dtypes."""
    dts = ",".join(str(d) for d in placeholder_dtypes(gm))
    key = hashlib.sha256((graph_code(gm) + "|" + dts).encode()).hexdigest()[:32]
    GRAPHS.setdefault(key, gm)
    return key


def aten_graph(fn, examples) -> str:
    """The key of ``fn`` traced to an aten graph on ``examples`` (cached per callable and
    example signature). A GraphModule of aten ops is filed as it is."""
    if isinstance(fn, torch.fx.GraphModule) and all(
            n.op in ("placeholder", "output", "get_attr")
            or (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
            for n in fn.graph.nodes) and any(n.op == "placeholder" for n in fn.graph.nodes):
        return file_graph(fn)
    sig = tuple((tuple(e.shape), e.dtype) if isinstance(e, torch.Tensor) else e
                for e in examples)
    per_fn = _traced.get(fn)
    if per_fn is None:
        per_fn = _traced[fn] = {}
    key = per_fn.get(sig)
    if key is None:
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
        from torch.fx.experimental.proxy_tensor import make_fx

        from ..compile.backend import decompositions

        # decomposed as a compiled graph is: eager flex_attention's default mask_mod is
        # `new_ones`, which has no lowering of its own
        with TransformGetItemToIndex():
            gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake")(*examples)
        key = per_fn[sig] = file_graph(gm)
    return key


def _block_mask(block_tables, block_sizes, mask_key):
    q_len, kv_len, q_bs, kv_bs = block_sizes
    kv_num, kv_idx, full_num, full_idx = block_tables
    return (q_len, kv_len, kv_num, kv_idx, full_num, full_idx) + (None,) * 8 + \
        (q_bs, kv_bs, GRAPHS[mask_key])


def _forward_lowering(query, key, value, block_tables, block_sizes, score_mod_buffers,
                      mask_mod_buffers, score_mod, mask_mod, scale):
    return _lowering.flex_attention(
        query, key, value, GRAPHS[score_mod], _block_mask(block_tables, block_sizes, mask_mod),
        scale, {}, tuple(score_mod_buffers), tuple(mask_mod_buffers))


def _backward_lowering(query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                       block_tables, block_sizes, score_mod_buffers, mask_mod_buffers,
                       fw_graph, joint_graph, mask_mod, scale):
    dq, dk, dv, bufs = _lowering.flex_attention_backward(
        query, key, value, out, logsumexp, grad_out, grad_logsumexp, GRAPHS[fw_graph],
        GRAPHS[joint_graph], _block_mask(block_tables, block_sizes, mask_mod), scale, {},
        tuple(score_mod_buffers), tuple(mask_mod_buffers))
    return dq, dk, dv, [g for g in bufs if g is not None]


register(_fwd)(_forward_lowering)
register(_bwd)(_backward_lowering)


@torch.library.register_fake("tpu::flex_attention")
def _fake_forward(query, key, value, block_tables, block_sizes, score_mod_buffers,
                  mask_mod_buffers, score_mod, mask_mod, scale):
    stats = torch.float64 if query.dtype == torch.float64 else torch.float32
    shp = query.shape[:-1]
    return (query.new_empty(shp + value.shape[-1:]), query.new_empty(shp, dtype=stats),
            query.new_empty(shp, dtype=stats))


@torch.library.register_fake("tpu::flex_attention_backward")
def _fake_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, block_tables,
                   block_sizes, score_mod_buffers, mask_mod_buffers, fw_graph, joint_graph,
                   mask_mod, scale):
    need = _lowering._buffers_needing_grad(GRAPHS[joint_graph], len(score_mod_buffers))
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            [torch.empty_like(score_mod_buffers[k]) for k in need])


def _bind_if_late() -> None:
    from ..device import registration
    from ..eager import kernels
    from ..lowering import registry

    if registration._done[0]:
        for op in (_fwd, _bwd):
            kernels.bind_lowering(registry.get(op))


_bind_if_late()


# ---------------------------------------------------------------- the HOP's PrivateUse1 side

def _tables(block_mask):
    return list(block_mask[2:6]), [int(block_mask[0]), int(block_mask[1]),
                                   int(block_mask[-3]), int(block_mask[-2])]


def _index_examples(device):
    return [torch.zeros((), dtype=torch.int32, device=device) for _ in range(4)]


def hop_forward(query, key, value, score_mod, block_mask, scale, kernel_options,
                score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """``flex_attention`` HOP on "tpu" tensors (below autograd)."""
    dev = query.device
    score_key = aten_graph(score_mod, [query.new_zeros(())] + _index_examples(dev)
                           + list(score_mod_other_buffers))
    mask_key = aten_graph(block_mask[-1], _index_examples(dev) + list(mask_mod_other_buffers))
    tables, sizes = _tables(block_mask)
    return tuple(_fwd(query, key, value, tables, sizes, list(score_mod_other_buffers),
                      list(mask_mod_other_buffers), score_key, mask_key, float(scale)))


def hop_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                 joint_graph, block_mask, scale, kernel_options, score_mod_other_buffers=(),
                 mask_mod_other_buffers=()):
    """``flex_attention_backward`` HOP on "tpu" tensors."""
    dev = query.device
    bufs = list(score_mod_other_buffers)
    fw_key = aten_graph(fw_graph, [query.new_zeros(())] + _index_examples(dev) + bufs)
    joint_key = aten_graph(joint_graph, [query.new_zeros(())] + _index_examples(dev)
                           + [query.new_zeros(())] + bufs)
    mask_key = aten_graph(block_mask[-1], _index_examples(dev) + list(mask_mod_other_buffers))
    tables, sizes = _tables(block_mask)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, got = _bwd(query, key, value, out, logsumexp, grad_out, grad_logsumexp, tables,
                           sizes, bufs, list(mask_mod_other_buffers), fw_key, joint_key,
                           mask_key, float(scale))
    need = _lowering._buffers_needing_grad(GRAPHS[joint_key], len(bufs))
    grads = [None] * len(bufs)
    for k, g in zip(need, got):
        grads[k] = g
    return dq, dk, dv, tuple(grads)
