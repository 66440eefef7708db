"""Whether a fused in projection (TorchTitan's ``wqkv``) splits as a Megatron colwise/rowwise pair.

A ``ColwiseParallel`` of a fused projection gives rank r the r-th block of its rows; that is a
correct tensor-parallel split only if every rank then holds whole heads of q, k and v and the
module's own code finds them in its local output. TorchTitan lays ``wqkv``'s rows out per KV
head (``[n_kv_heads, heads_per_kv + 2, head_dim]``: a KV group's q heads, its k, its v), so its
own TP plan is a plain ``ColwiseParallel`` on ``wqkv`` and its forward reshapes with ``-1``
heads; a ``[q; k; v]`` stack would give rank 0 only q rows and compute garbage of the right
shape. Which layout a model uses is not declared anywhere, so it is checked numerically: the
block runs once on CPU with random weights and inputs shaped as in the analysis (the user's
own inputs where the block receives them: positions, masks), then once per rank with the fused
weight's row block and the out layer's column block, as each rank's local forward runs under
``parallelize_module``; the ranks' outputs must sum to the whole block's (the rowwise
all-reduce). A tp degree that fails (or raises) is not offered for the block. The inputs are
cut to one sample where the block runs so (its cost: the block's forward 1 + the sum of the
degrees checked times, on CPU at the analysed sequence length).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

MAX_TP = 8  # tp degrees checked: the divisors of the split dimension up to this


def _rand(t, gen):
    if t.is_complex():
        ang = torch.rand(tuple(t.shape), generator=gen) * (2 * math.pi)
        return torch.polar(torch.ones_like(ang), ang)
    if t.is_floating_point():
        return torch.randn(tuple(t.shape), generator=gen) * 0.5
    if t.dtype == torch.bool:
        return torch.ones(tuple(t.shape), dtype=torch.bool)
    return torch.zeros(tuple(t.shape), dtype=t.dtype)


def _real(x, real_of, gen):
    if id(x) in real_of:  # the user's own input (positions, a BlockMask): its values matter
        r = real_of[id(x)]
        r = r.to("cpu")
        return r.float() if isinstance(r, torch.Tensor) and r.is_floating_point() else r
    return _rand(x, gen) if isinstance(x, torch.Tensor) else x


def fused_split_tps(block: nn.Module, fused: nn.Linear, out: nn.Linear, call, real_of: dict,
                    fused_fqn: str, out_fqn: str, block_fqn: str, eager, degrees=None):
    """The tp degrees (>= 2) at which ``block`` with its fused in layer colwise and its out layer
    rowwise computes what the whole block computes, and why the others are not (a sentence).
    ``eager``: the context the model runs in (``analysis.eager``: compiled code runs eagerly);
    ``degrees``: the tp sizes to check (None: all up to ``MAX_TP``)."""
    if call is None:
        return [], "its call was not recorded"
    g = math.gcd(fused.out_features, out.in_features)
    cands = [d for d in range(2, MAX_TP + 1) if g % d == 0 and (degrees is None or d in degrees)]
    if not cands:
        return [], f"no tp degree up to {MAX_TP} divides {g}"
    cut = len(block_fqn) + 1 if block_fqn else 0
    fw, ow = fused_fqn[cut:], out_fqn[cut:]
    gen = torch.Generator().manual_seed(0)
    params = {n: _rand(p, gen) for n, p in block.named_parameters()}
    buffers = {n: _rand(b, gen) for n, b in block.named_buffers()}
    a, kw = pytree.tree_map(lambda x: _real(x, real_of, gen), call)

    def run(state, a, kw):
        y = torch.func.functional_call(block, {**state, **buffers}, a, kw)
        return [t for t in pytree.tree_leaves(y) if isinstance(t, torch.Tensor)]

    ok, bad = [], []
    first = next((t for t in pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor)), None)
    batch = first.shape[0] if first is not None and first.dim() else 1
    with torch.no_grad(), eager():
        whole = None
        if batch > 1:  # one sample is as good a check and costs 1 / batch: tried first
            one = pytree.tree_map(lambda t: t.narrow(0, 0, 1) if isinstance(t, torch.Tensor)
                                  and t.dim() and t.shape[0] == batch else t, (a, kw))
            try:
                whole = run(params, *one)
                a, kw = one
            except Exception:  # noqa: BLE001 -- the whole batch then
                whole = None
        if whole is None:
            try:
                whole = run(params, a, kw)
            except Exception as e:  # noqa: BLE001 -- the reason is reported, block refused
                return [], (f"its block does not run on CPU for the check: "
                            f"{type(e).__name__}: {e}")
        for tp in cands:
            try:
                acc = None
                for r in range(tp):
                    st = dict(params)
                    st[fw + ".weight"] = params[fw + ".weight"].chunk(tp, 0)[r]
                    if fw + ".bias" in params:
                        st[fw + ".bias"] = params[fw + ".bias"].chunk(tp, 0)[r]
                    st[ow + ".weight"] = params[ow + ".weight"].chunk(tp, 1)[r]
                    if ow + ".bias" in params and r:
                        st[ow + ".bias"] = torch.zeros_like(params[ow + ".bias"])
                    ys = run(st, a, kw)
                    acc = ys if acc is None else [u + v for u, v in zip(acc, ys)]
                same = len(acc) == len(whole) and all(
                    u.shape == v.shape and torch.allclose(
                        u, v, rtol=1e-4, atol=1e-4 * float(v.abs().max().clamp_min(1)))
                    for u, v in zip(acc, whole))
            except Exception as e:  # noqa: BLE001 -- a degree whose local forward fails
                bad.append(f"tp={tp}: the rank-local forward fails ({type(e).__name__})")
                continue
            if same:
                ok.append(tp)
            else:
                bad.append(f"tp={tp}: the ranks' outputs do not sum to the block's (its rows "
                           f"are not grouped per head)")
    return ok, "; ".join(bad)
