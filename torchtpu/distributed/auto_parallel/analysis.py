"""What the search needs to know about a model, measured by one forward + backward on fake tensors.

Parameters are replaced by fake CPU tensors (``torch.func.functional_call``), so a model on "tpu",
on CPU or already on meta is analysed without touching its memory. Forward hooks record, per
module, the call order of the ``nn.Linear`` / ``nn.Embedding`` leaves and the tensors they
read and write; ``FlopCounterMode`` counts forward and backward FLOPs per module;
``saved_tensors_hooks`` attribute the bytes autograd keeps for backward to the innermost module
running when they were saved (a tensor saved by several ops -- the input of q, k and v -- once).

Groups: a parameter's name with its ``ModuleList`` indices replaced by ``*``
(``layers.*.attention.wq.weight``), so repeated layers share one decision.
TP blocks: a module whose forward first runs one or more Linears on the same tensor ("in"
layers, colwise) and then exactly one more Linear ("out", rowwise) whose ``in_features`` is a
multiple of every in layer's ``out_features`` (attention with q/k/v/o, GQA included; a gated
MLP); a fused QKV projection (one in layer wider than the out layer's input) is a block only at
the tp degrees where its split is checked numerically (``fused_split.py``); modules with other
parametrised leaves between are left out.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .fused_split import fused_split_tps

def namer(model: nn.Module):
    """``fqn -> group name`` for ``model``: the index of a child of a ``ModuleList`` /
    ``ModuleDict`` (numeric keys) becomes ``*`` (``layers.3.attention.wq`` ->
    ``layers.*.attention.wq``), so repeated layers share one decision; the positions inside
    an ``nn.Sequential`` stay apart (``0.weight`` and ``2.weight`` are different layers)."""
    containers = {n for n, m in model.named_modules()
                  if isinstance(m, (nn.ModuleList, nn.ModuleDict))}

    def name(fqn: str) -> str:
        parts = fqn.split(".")
        out = []
        for i, p in enumerate(parts):
            if p.isdigit() and ".".join(parts[:i]) in containers:
                out.append("*")
            else:
                out.append(p)
        return ".".join(out)

    return name


@dataclass
class Leaf:
    """One nn.Linear / nn.Embedding call seen in the forward."""
    fqn: str
    kind: str  # "linear" | "embedding"
    in_id: int
    out_bytes: int  # bytes of its output at the analysed batch
    in_bytes: int
    out_shape: tuple = ()


@dataclass
class TPBlock:
    fqn: str
    ins: list
    out: str
    out_act_bytes: int  # the out layer's output (all-reduced over tp in forward)
    in_act_bytes: int  # the block input (its gradient all-reduced over tp in backward)
    heads: list = field(default_factory=list)  # head counts found on the module, for divisibility
    act_arg: object = None  # where the block takes its input: positional index or kwarg name
    nargs: int = 0  # its positional arguments
    # a fused in layer (TorchTitan's wqkv): the tp degrees at which the split was checked
    # numerically (``fused_split_tps``); None for ordinary blocks (head counts decide)
    tps: object = None


@dataclass
class Analysis:
    namer: object  # fqn -> group name (see ``namer``)
    params: dict  # fqn -> (shape, dtype itemsize)
    groups: dict  # group name -> [param fqns]
    flops: dict  # module fqn -> fwd+bwd FLOPs ("" = whole model)
    saved: dict  # module fqn -> bytes saved for backward by ops run directly in it
    leaves: dict  # fqn -> Leaf
    blocks: list  # [TPBlock]
    batch: int
    input_bytes: int
    output_bytes: int
    leaf_order: list = field(default_factory=list)  # Linear / Embedding fqns in call order
    seq_len: int = 0  # dim 1 of the first input (tokens), 0 if it has none
    sp_blocker: str = "not analysed"  # why sequence parallelism cannot apply ("" if it can)
    not_blocks: dict = field(default_factory=dict)  # group -> why it is not a TP block
    # where sequence parallelism starts: None at the embedding's output (TorchTitan's), or
    # (first repeated layer's fqn, its stream argument: index or kwarg name, its positional
    # count): the prologue (embedding, mask, positions, rotary tables) stays replicated
    sp_entry: object = None
    layers: list = field(default_factory=list)  # the repeated layers holding TP blocks
    loss_inside: bool = False  # the model applies F.cross_entropy to its head's output
    loss_saved: int = 0  # bytes autograd saves inside that cross_entropy
    # the cross-entropy is the user's ``loss_fn`` on the model's output (TorchTitan's): it runs
    # on the (dp-gathered) global batch on every rank unless loss parallelism keeps it sharded
    loss_outside: bool = False
    # Linear / Embedding leaves whose class overrides ``forward`` (TorchTitan's Embedding
    # unwraps a DTensor weight for its own vocab-parallel path): ColwiseParallel /
    # RowwiseParallel would hand that code DTensors it does not expect, so they are never
    # tensor-parallel (fqn -> why)
    custom_leaves: dict = field(default_factory=dict)
    # every attention call of the forward: (innermost module, score elements at the analysed
    # batch, bytes per score element, batch, query heads)
    attention: list = field(default_factory=list)
    buffer_bytes: int = 0  # the model's buffers (rotary tables...): replicated on every device


_SDPA = ("_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention")


class _Flops(TorchDispatchMode):
    """FLOPs of the ops run under it, per module of ``stack`` (forward) or as backward.

    PyTorch's ``FlopCounterMode`` formulas (``flop_registry``), plus flex_attention's
    higher-order ops (``FlopCounterMode`` itself fails on those in eager: TorchTitan's llama3):
    4 * B * Hq * Lq * Lk * D forward, 2.5 times that backward (dense: an upper bound under a
    block-sparse mask)."""

    supports_higher_order_operators = True

    def __init__(self, stack):
        super().__init__()
        self.stack = stack
        self.fwd = defaultdict(float)
        self.bwd = 0.0
        self.backward = False
        self.attention = []

    def _add(self, n):
        if self.backward:
            self.bwd += n
            return
        for fqn in set(self.stack) | {""}:
            self.fwd[fqn] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if not self.backward and (name == "flex_attention" or name.split(".")[0] in _SDPA):
            q, k = args[0], args[1]
            # (module, batch * query heads * queries * keys, bytes of one score, batch, query
            # heads): the scores and probabilities a dense lowering holds (float32 for a 16-bit
            # input)
            self.attention.append((self.stack[-1] if self.stack else "",
                                   q.numel() // q.shape[-1] * k.shape[-2],
                                   max(q.element_size(), 4),
                                   q.shape[0] if q.dim() == 4 else 1,
                                   q.shape[-3] if q.dim() >= 3 else 1))
        if name in ("flex_attention", "flex_attention_backward"):
            q, k = args[0], args[1]
            b, h, lq, d = q.shape
            n = 4.0 * b * h * lq * k.shape[-2] * d
            self._add(n if name == "flex_attention" else 2.5 * n)
            return out
        packet = getattr(func, "_overloadpacket", None)
        if packet in flop_registry:
            self._add(float(flop_registry[packet](*args, **kwargs, out_val=out)))
        return out


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_like(fm, t):
    """A fake CPU tensor with ``t``'s shape and dtype (no memory; "meta" would not do: some
    ops, such as flex_attention, accept only real device types)."""
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(t, BlockMask):  # not a pytree: its tensors moved as a whole
        with fm:
            return t.to("tpu")
    if not isinstance(t, torch.Tensor):
        return t
    with fm:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="tpu")


@contextlib.contextmanager
def eager():
    """``torch.compile``d functions inside the model (TorchTitan's flex_attention) run as
    their eager code (inlined when traced by ``make_fx``) while the model is analysed or
    traced; flex_attention's warning about running uncompiled is silenced."""
    import torch._dynamo.config as dcfg

    with torch.compiler.set_stance("force_eager"), \
            dcfg.patch(error_on_nested_fx_trace=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without")
        yield


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _head_counts(mod: nn.Module) -> list:
    found = []
    srcs = [mod] + list(mod.modules())[1:]
    cfg = getattr(mod, "config", None)
    if cfg is not None and hasattr(mod, "head_dim"):  # an attention module (HF): its heads
        srcs.append(cfg)
    for s in srcs:
        for k, v in vars(s).items():
            if isinstance(v, int) and not isinstance(v, bool) and "head" in k.lower() \
                    and "dim" not in k.lower() and "size" not in k.lower() and v > 0:
                found.append(v)
    return found


def analyse(model: nn.Module, args: tuple, kwargs: dict, tp_degrees=None, loss_fn=None,
            loss_args=()) -> Analysis:
    """``tp_degrees``: the tp sizes the search will consider (a fused projection's split is
    checked at those only; None: every degree up to ``fused_split.MAX_TP``). ``loss_fn``: the
    user's loss, called as ``loss_fn(output, *loss_args)`` after the forward (else the
    backward starts from the sum of the float outputs)."""
    params = {n: (tuple(p.shape), p.element_size()) for n, p in model.named_parameters()}
    gn = namer(model)
    groups = defaultdict(list)
    for n in params:
        groups[gn(n)].append(n)
    fm = fake_mode()
    meta_params = {n: fake_like(fm, p).requires_grad_(p.requires_grad)
                   for n, p in model.named_parameters()}
    meta_buffers = {n: fake_like(fm, b) for n, b in model.named_buffers()}
    real_of = {}  # id(fake input) -> the user's tensor (for the fused-projection check)

    def fake_in(x):
        f = fake_like(fm, x)
        if f is not x:  # a tensor, or a BlockMask moved as a whole
            real_of[id(f)] = x
        return f

    margs, mkwargs = pytree.tree_map(fake_in, (args, kwargs))
    mloss_args = pytree.tree_map(fake_in, tuple(loss_args))
    tensors = [t for t in pytree.tree_leaves((margs, mkwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError("auto_parallelize: example_inputs hold no tensor")
    batch = tensors[0].shape[0] if tensors[0].dim() else 1

    names = {m: n for n, m in model.named_modules()}
    stack = []
    leaf_order = []
    calls = defaultdict(list)  # module fqn -> [leaf fqn in call order] (every ancestor)
    leaves = {}
    block_inputs = {}
    call_args = {}  # module fqn -> (positional arg ids, {kwarg name: id}) of its first call
    first_call = {}  # module fqn -> (args, kwargs) of its first call (fake tensors)
    arg_shapes = {}  # module fqn -> the same with the float tensors' shapes (else None)
    saved = defaultdict(int)
    seen = {}
    hooks = []

    def pre(mod, a, kw):
        fqn = names[mod]
        stack.append(fqn)
        first = next((t for t in pytree.tree_leaves((a, kw)) if isinstance(t, torch.Tensor)), None)
        block_inputs.setdefault(fqn, (id(first), _nbytes(first)))
        call_args.setdefault(fqn, ([id(x) for x in a], {k: id(v) for k, v in kw.items()}))
        first_call.setdefault(fqn, (a, kw))
        arg_shapes.setdefault(fqn, ([_shape(x) for x in a], {k: _shape(v) for k, v in kw.items()}))

    def post(mod, a, kw, out):
        fqn = stack.pop()
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            x = a[0] if a else next(iter(kw.values()))
            if fqn not in leaves:
                leaf_order.append(fqn)
            leaves[fqn] = Leaf(fqn, "linear" if isinstance(mod, nn.Linear) else "embedding",
                               id(x), _nbytes(out), _nbytes(x), tuple(out.shape))
            for anc in stack:
                calls[anc].append(fqn)

    for mod in model.modules():
        hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(mod.register_forward_hook(post, with_kwargs=True))

    def pack(t):
        base = t._base if t._base is not None else t
        key = (id(base), t.storage_offset(), tuple(t.shape))
        if key in seen:  # saved again (q, k and v save their one input): stored once
            return t
        seen[key] = base  # alive: its id is not reused
        if not (base.is_leaf and base.requires_grad):  # parameters are counted apart
            saved[stack[-1] if stack else ""] += _nbytes(t)
            if lw.depth:
                lw.saved += _nbytes(t)
        return t

    fc = _Flops(stack)
    lw = _LossWatch(leaf_order)
    try:
        with fm, eager(), fc, lw, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(model, (meta_params, meta_buffers), margs, mkwargs)
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                    and t.is_floating_point()]
            if not outs:
                raise ValueError("auto_parallelize: the model returned no floating-point tensor")
            if loss_fn is not None:
                loss = loss_fn(out, *mloss_args)
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                    raise ValueError("auto_parallelize: loss_fn must return a 0-dim tensor")
            else:
                loss = sum(o.float().sum() for o in outs)
            fc.backward = True
            if loss.requires_grad:
                loss.backward()
    finally:
        for h in hooks:
            h.remove()
    # backward FLOPs are given to the modules in proportion to their forward FLOPs
    root_fwd = max(fc.fwd.get("", 0.0), 1.0)
    scale = 1.0 + fc.bwd / root_fwd
    flops = {k: v * scale for k, v in fc.fwd.items()}
    flops.setdefault("", 0)

    mods = dict(model.named_modules())
    custom = {f: f"{type(mods[f]).__name__} overrides nn.{base.__name__}.forward: its own code "
                 f"would see DTensors, so it is not tensor-parallel"
              for f in leaves for base in (nn.Linear, nn.Embedding)
              if isinstance(mods[f], base) and type(mods[f]).forward is not base.forward}
    blocks = []
    refused = {}
    fused_checked = {}
    for fqn, seq in calls.items():
        mod = mods[fqn]
        if isinstance(mod, (nn.Linear, nn.Embedding)) or len(seq) < 2:
            continue
        lin = [leaves[s] for s in seq]
        if any(l.kind != "linear" for l in lin) or len(set(seq)) != len(seq):
            continue
        if any(f in custom for f in seq):
            refused[fqn] = custom[next(f for f in seq if f in custom)]
            continue
        out = lin[-1]
        ins = lin[:-1]
        if len({l.in_id for l in ins}) != 1 or out.in_id == ins[0].in_id:
            continue
        o_mod = mods[out.fqn]
        tps = None  # tp degrees a fused projection was checked to split at (None: not fused)
        if any(o_mod.in_features % mods[l.fqn].out_features for l in ins):
            if len(ins) == 1 and mods[ins[0].fqn].out_features > o_mod.in_features:
                # one projection wider than the out layer's input: a fused QKV (or gate/up).
                # Whether a Shard(0) of its rows gives each rank whole heads of q, k and v
                # depends on the rows' layout (TorchTitan's groups them per KV head, so its
                # own TP plan is a plain ColwiseParallel; a [q; k; v] stack would not split):
                # checked numerically per tp degree (``fused_split_tps``)
                if gn(fqn) not in fused_checked:  # repeated layers: one check
                    fused_checked[gn(fqn)] = fused_split_tps(
                        mod, mods[ins[0].fqn], o_mod, first_call.get(fqn), real_of,
                        ins[0].fqn, out.fqn, fqn, eager, tp_degrees)
                tps, why = fused_checked[gn(fqn)]
                if not tps:
                    refused[fqn] = (f"{ins[0].fqn} (out_features "
                                    f"{mods[ins[0].fqn].out_features}) looks like a fused "
                                    f"projection feeding {out.fqn} (in_features "
                                    f"{o_mod.in_features}): not split as a colwise/rowwise "
                                    f"pair ({why})")
                    continue
            else:
                continue
        own = {f"{l}.{p}" for l in seq for p, _ in mods[l].named_parameters()}
        pre_ = f"{fqn}." if fqn else ""
        if any(pre_ + p not in own for p, _ in mod.named_parameters()):
            continue  # other parametrised modules (a norm) would see sharded activations
        # the smallest such module: not one whose child already qualifies with the same leaves
        pos, kws = call_args.get(fqn, ([], {}))
        act = next((i for i, x in enumerate(pos) if x == ins[0].in_id),
                   next((k for k, x in kws.items() if x == ins[0].in_id), None))
        blocks.append(TPBlock(fqn, [l.fqn for l in ins], out.fqn, out.out_bytes, ins[0].in_bytes,
                              _head_counts(mod) if tps is None else [], act, len(pos), tps))
    # keep the innermost block for a given set of leaves
    by_leaves = {}
    for b in sorted(blocks, key=lambda b: -len(b.fqn)):
        by_leaves.setdefault((tuple(b.ins), b.out), b)
    blocks = sorted(by_leaves.values(), key=lambda b: b.fqn)
    # a leaf belongs to at most one block
    used, keep = set(), []
    for b in blocks:
        ls = set(b.ins) | {b.out}
        if ls & used:
            continue
        used |= ls
        keep.append(b)
    out_bytes = sum(_nbytes(t) for t in outs)
    an = Analysis(gn, params, dict(groups), flops, dict(saved), leaves, keep, batch,
                  sum(_nbytes(t) for t in tensors), out_bytes, leaf_order,
                  tensors[0].shape[1] if tensors[0].dim() >= 2 else 0)
    an.attention = fc.attention
    an.buffer_bytes = sum(_nbytes(b) for b in model.buffers())
    an.not_blocks = {gn(k): v for k, v in refused.items()}
    an.custom_leaves = custom
    an.not_blocks.update({gn(k): v for k, v in custom.items()})
    head = leaves.get(leaf_order[-1]) if leaf_order else None
    an.loss_inside = bool(head is not None and head.kind == "linear" and
                          lw.last_leaf == head.fqn and mods[head.fqn].out_features in lw.classes)
    an.loss_saved = lw.saved if an.loss_inside else 0
    an.loss_outside = an.loss_inside and loss_fn is not None
    an.layers = _layers(an, mods)
    an.sp_blocker = _sp_blocker(model, an, mods)
    if not an.sp_blocker:
        state, want = (meta_params, meta_buffers), [tuple(o.shape) for o in outs]
        first = an.leaf_order[0]
        at_embedding = (f"its embedding is not sharded ({custom[first]})" if first in custom
                        else _sp_shapes(model, an, fm, state, margs, mkwargs, want))
        an.sp_blocker = at_embedding
        entry = _layer_entry(an, mods, arg_shapes, leaves) if at_embedding else None
        if isinstance(entry, str):
            an.sp_blocker = f"{at_embedding}; entering at the first layer: {entry}"
        elif entry is not None:
            at_layer = _sp_shapes(model, an, fm, state, margs, mkwargs, want, entry)
            if at_layer:
                an.sp_blocker = f"{at_embedding}; entering at the first layer: {at_layer}"
            else:
                an.sp_blocker, an.sp_entry = "", entry
    return an


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) and t.is_floating_point() else None


class _LossWatch(torch.overrides.TorchFunctionMode):
    """Notes ``F.cross_entropy`` calls inside the forward that come after the last Linear (a
    loss the model computes itself, HF's ``labels=``): their class counts, and the bytes
    autograd saves inside them (``depth`` > 0 while one runs)."""

    def __init__(self, leaf_order):
        super().__init__()
        self.leaf_order, self.depth, self.saved = leaf_order, 0, 0
        self.classes, self.last_leaf = set(), None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.cross_entropy:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs["input"]
        self.classes.add(x.shape[1] if x.dim() > 1 else x.shape[0])
        self.last_leaf = self.leaf_order[-1] if self.leaf_order else None
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1


def _layers(an: Analysis, mods: dict) -> list:
    """The repeated layers (children of a ModuleList / ModuleDict) holding TP blocks, in call
    order."""
    res = []
    for b in sorted(an.blocks, key=lambda b: an.leaf_order.index(b.ins[0])):
        parts = b.fqn.split(".")
        for i in range(1, len(parts)):
            layer = ".".join(parts[:i + 1])
            if an.namer(layer).endswith("*") and layer != b.fqn:
                if layer not in res:
                    res.append(layer)
                break
    return res


def _layer_entry(an: Analysis, mods: dict, arg_shapes: dict, leaves: dict):
    """(first layer's fqn, its stream argument, its positional count) for sequence parallelism
    entered at the first repeated layer, or why not (a str): the stream is the layer's one
    floating argument shaped like the embedding's output."""
    if not an.layers:
        return "no repeated layer holds the TP blocks"
    first = an.layers[0]
    emb = leaves[an.leaf_order[0]]
    pos, kws = arg_shapes.get(first, ([], {}))
    want = emb.out_shape
    hits = [i for i, s in enumerate(pos) if s == want] + [k for k, s in kws.items() if s == want]
    if len(hits) != 1:
        return f"{first} takes {len(hits)} arguments shaped like the embedding's output {want}"
    return (first, hits[0], len(pos))


def sp_norms(an: Analysis, mods: dict) -> list:
    """The modules that hold parameters besides the Linear / Embedding leaves: under sequence
    parallelism they see the sequence-sharded activations (``SequenceParallel``)."""
    res = []
    for fqn, m in mods.items():
        own = list(m.parameters(recurse=False))
        if own and fqn not in an.leaves:
            res.append(fqn)
    return res


def _sp_blocker(model: nn.Module, an: Analysis, mods: dict) -> str:
    """Why TorchTitan's sequence parallelism (the residual stream sharded on the sequence
    between blocks) does not fit this model's structure; "" when it does: tokens of shape
    (batch, seq) enter an Embedding called first, every other Linear is in a TP block except
    one head called last, every TP block takes the stream as one argument, and every other
    parametrised module is a norm (1-D parameters only: it acts on each token alone)."""
    if an.seq_len < 2:
        return "the first input has no sequence dimension"
    order = an.leaf_order
    if len(order) < 3 or an.leaves[order[0]].kind != "embedding":
        return "the model does not start with an Embedding"
    if an.leaves[order[-1]].kind != "linear":
        return "the model does not end with a Linear head"
    in_block = {f for b in an.blocks for f in b.ins + [b.out]}
    loose = [f for f in order[1:-1] if f not in in_block]
    if loose:
        return f"Linear / Embedding outside a TP block: {loose[:3]}"
    if any(b.act_arg is None for b in an.blocks):
        return "a TP block takes its input other than as one argument"
    for fqn in sp_norms(an, mods):
        m = mods[fqn]
        if any(p.dim() != 1 for p in m.parameters(recurse=False)) or list(m.children()):
            return f"{fqn} ({type(m).__name__}) is not a norm"
    return ""


class _Stream(TorchDispatchMode):
    """Watches the ops that read the sequence-sharded stream outside the blocks, norms and
    leaves (``inside`` counts those open): each must act on every token alone (a pointwise op,
    a copy or a dtype cast; metadata queries, ``prim.device``, pass), else ``bad`` names it (a mean over the sequence, a cumulative sum
    or a token shift between the blocks would be wrong on a rank's half of the tokens)."""

    _OK = ("_to_copy", "clone", "copy_", "detach", "alias")
    supports_higher_order_operators = True  # flex_attention inside a block (TorchTitan)

    def __init__(self):
        super().__init__()
        self.ids, self.inside, self.busy, self.bad, self.keep = set(), 0, False, None, []

    def mark(self, t):
        self.ids.add(id(t))
        self.keep.append(t)  # alive, so that its id is never reused by another tensor
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.busy or self.inside:
            return out
        if any(id(t) in self.ids for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)):
            packet = getattr(func, "overloadpacket", func)  # a higher-order op: itself
            if torch.Tag.pointwise not in getattr(func, "tags", ()) and \
                    getattr(func, "namespace", "") != "prim" and \
                    getattr(packet, "__name__", "") not in self._OK and self.bad is None:
                self.bad = str(func)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return out


def _sp_shapes(model, an: Analysis, fm, state, margs, mkwargs, want, entry=None) -> str:
    """The forward re-run on fake tensors as one rank of tp=2 sequence parallelism sees it
    (the stream cut to half the sequence where SP starts: the embedding's output, or with
    ``entry`` the first repeated layer's stream argument; each block's input gathered and its
    output cut, the head's input gathered): "" if it runs, gives the same output shapes and
    every op on the stream between the blocks acts on each token alone (``_Stream``), else
    why not (code between the blocks that reads the sequence length, such as a causal mask or
    positions built from the hidden states' shape, would see the local half)."""
    if an.seq_len % 2:
        return "odd sequence length"
    half = an.seq_len // 2
    mods = dict(model.named_modules())
    hooks = []
    watch = _Stream()

    def enter(gather_at=None):
        def hook(mod, a, kw):
            if gather_at is not None:
                watch.busy = True
                if isinstance(gather_at, int):
                    a = a[:gather_at] + (torch.cat([a[gather_at]] * 2, dim=1),) + \
                        a[gather_at + 1:]
                else:
                    kw = dict(kw, **{gather_at: torch.cat([kw[gather_at]] * 2, dim=1)})
                watch.busy = False
            watch.inside += 1
            return a, kw
        return hook

    def leave(cut, mark=True):
        def hook(mod, a, out):
            watch.inside -= 1
            if cut:  # the stream in what it returns (a block may return a tuple)
                watch.busy = True
                out = pytree.tree_map(lambda t: t.narrow(1, 0, half) if isinstance(
                    t, torch.Tensor) and t.dim() > 1 and t.shape[1] == 2 * half else t, out)
                watch.busy = False
            if not mark:
                return out
            return pytree.tree_map(lambda t: watch.mark(t) if isinstance(t, torch.Tensor)
                                   else t, out)
        return hook

    def watch_module(fqn, gather_at=None, cut=False, mark=True):
        m = mods[fqn]
        hooks.append(m.register_forward_pre_hook(enter(gather_at), with_kwargs=True))
        hooks.append(m.register_forward_hook(leave(cut, mark)))

    if entry is None:
        watch_module(an.leaf_order[0], cut=True)
    else:
        layer, at, _ = entry

        def cut_entry(mod, a, kw):  # Replicate -> Shard(1): the rank's slice
            watch.busy = True
            if isinstance(at, int):
                a = a[:at] + (watch.mark(a[at].narrow(1, 0, half)),) + a[at + 1:]
            else:
                kw = dict(kw, **{at: watch.mark(kw[at].narrow(1, 0, half))})
            watch.busy = False
            return a, kw

        hooks.append(mods[layer].register_forward_pre_hook(cut_entry, with_kwargs=True))
    for b in an.blocks:
        watch_module(b.fqn, b.act_arg, cut=True)
    # the stream ends at the head: what reads its (gathered) output, such as a loss the
    # model computes itself, is outside sequence parallelism
    watch_module(an.leaf_order[-1], 0, mark=False)
    for f in sp_norms(an, mods):
        watch_module(f)
    import logging

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the failure is the answer, not an error to log
    try:
        with fm, eager(), torch.no_grad(), watch:
            out = torch.func.functional_call(model, state, margs, mkwargs)
        got = [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
               and t.is_floating_point()]
    except Exception as e:  # noqa: BLE001 - any failure means the structure does not hold
        return f"the forward with a sequence-sharded stream fails ({type(e).__name__}: " \
               f"{str(e).splitlines()[0][:120] if str(e) else ''})"
    finally:
        quiet.setLevel(level)
        for h in hooks:
            h.remove()
    if got != want:
        return f"the forward with a sequence-sharded stream gives shapes {got}, not {want}"
    if watch.bad:
        return f"{watch.bad} runs on the stream between the blocks (it may mix tokens)"
    return ""
