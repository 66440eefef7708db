"""The cost model: per device, per training step, for one mesh factorisation (dp, tp).

Compute: the model's forward + backward FLOPs (``FlopCounterMode``), split over dp (the batch)
and, inside a sharded unit, over tp, against the device's peak times its efficiency.
Communication: ring collectives per mesh axis, alpha-beta: an all-gather or reduce-scatter of
``S`` bytes over ``n`` devices sends ``(n-1)/n * S`` bytes in ``n-1`` steps, an all-reduce twice
that. FSDP: all-gather in forward and again in backward, reduce-scatter of the gradients; DDP:
one all-reduce of the gradients; a TP block: an all-reduce of its output in forward and, in
backward, one of its input's gradient per colwise layer reading that input; a colwise head: an all-gather of its output and an all-reduce of
its input's gradient; a rowwise embedding: an all-reduce of its output. No overlap of
communication with compute is assumed (an upper bound).
Memory: parameters + gradients + optimizer state (``optimizer_states`` copies of each
parameter) of the local shard, plus for FSDP one instance per group unsharded (its parameters
and, until their reduce-scatter, its gradients), plus the activations
autograd saves (split over dp, and over tp inside a sharded unit except the replicated input of
its colwise layers), plus the inputs and the model's buffers (replicated), plus the score
tiles of the dense attention calls (``attention_tiles``: kept from forward to backward by
the one-program train step XLA compiles).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .analysis import Analysis
from .devices import DeviceSpec
from .space import params_of, tp_ok


def ring(kind: str, nbytes: float, n: int, spec: DeviceSpec):
    """(bytes sent per device, seconds) of one collective over an axis of n devices."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    k = 2 if kind == "all_reduce" else 1
    sent = k * (n - 1) / n * nbytes
    return sent, k * (n - 1) * spec.latency + sent / spec.axis_bandwidth


@dataclass
class Costs:
    """Linear coefficients of one factorisation. Options: ``unit_opts[u]`` -> {opt: Term};
    ``group_opts[g]`` -> {(tp opt of its unit, dp opt): Term}; plus a constant Term."""
    dp: int
    tp: int
    unit_opts: dict = field(default_factory=dict)
    group_opts: dict = field(default_factory=dict)
    owner: dict = field(default_factory=dict)  # group -> unit name or None
    const: "Term" = None
    sp: "Term" = None  # what sequence parallelism adds (negative: saves), None if it cannot
    # what saving the blocks' inputs sharded on the sequence adds to SP (Megatron's: the
    # all-gather's input is saved and the gather re-run in backward), None if SP cannot
    sg: "Term" = None
    lp: "Term" = None  # what loss parallelism adds, None if it cannot
    head: str = None  # the head's unit (loss parallelism needs it sharded)


@dataclass
class Term:
    compute: float = 0.0  # seconds
    comm: float = 0.0  # seconds
    memory: float = 0.0  # bytes
    dp_bytes: float = 0.0  # bytes sent per device on the dp axis
    tp_bytes: float = 0.0

    @property
    def time(self) -> float:
        return self.compute + self.comm

    def __add__(self, o):
        return Term(self.compute + o.compute, self.comm + o.comm, self.memory + o.memory,
                    self.dp_bytes + o.dp_bytes, self.tp_bytes + o.tp_bytes)


# The score-sized float tensors of the dense attention calls in the compiled train step. The
# lowering's backward recomputes the scores and probabilities and forms their gradients
# (``lowering/attention.py``: s, p, dP, dS), but forward and backward are one XLA program here
# and XLA merges the recomputed scores with the forward's (CSE): each call keeps
# ``DENSE_TILES_KEPT`` score tensors alive from its forward to its backward, two
# (``DENSE_TILES_KEPT_UNIT_DIM``) where the call's local batch or local heads is 1 (XLA:CPU
# then emits the batched dots on 3-D shapes and keeps a 3-D and a 4-D copy of the
# probabilities); one more (``DENSE_TILES_TRANSIENT``, the largest call's) lives while a
# backward runs. Measured (the test Transformer, 512 tokens, XLA:CPU's buffer assignment,
# 2026-12-07): 1, 2 and 4 layers on dp=2 x tp=2 (local batch 2, heads 2) hold 2, 3 and 5
# tiles at the peak; on dp=4 (local batch 1) 3, 5 and 9; one device at batch 2 and 4, 3 (two
# layers); tp=4 (local heads 1) and dp=2 x tp=2 at batch 2 (local batch 1) 5.
DENSE_TILES_KEPT = 1
DENSE_TILES_KEPT_UNIT_DIM = 2
DENSE_TILES_TRANSIENT = 1


def attention_tiles(an: Analysis, units: list, dp: int, tp: int) -> dict:
    """The memory of the dense attention calls' score tiles per device (see
    ``DENSE_TILES_KEPT``): ``{owner: {False: bytes, True: bytes}}``, the owner the unit whose
    module runs the call (None outside any unit), True where that unit is sharded over tp
    (its heads split). Calls above ``DENSE_MAX_ELEMENTS`` take the lowering's blockwise kernel,
    which holds only blocks: none counted. The choice is the lowering's on the global shapes, as
    the verification's program makes it."""
    from ...lowering.attention import DENSE_MAX_ELEMENTS

    dense = [c for c in an.attention if c[1] <= DENSE_MAX_ELEMENTS]
    if not dense:
        return {}

    def owner(fqn):
        return next((u.name for u in units for f in u.instances
                     if fqn == f or fqn.startswith(f + ".") or not f), None)

    out = {}
    largest = max(dense, key=lambda c: c[1] * c[2])
    for sharded in (False, True):
        split = dp * (tp if sharded else 1)
        for fqn, elements, size, batch, heads in dense:
            unit_dim = batch // dp <= 1 or (heads // tp if sharded else heads) <= 1
            k = DENSE_TILES_KEPT_UNIT_DIM if unit_dim else DENSE_TILES_KEPT
            per = out.setdefault(owner(fqn), {False: 0.0, True: 0.0})
            per[sharded] += k * elements * size / split
        per = out.setdefault(owner(largest[0]), {False: 0.0, True: 0.0})
        per[sharded] += DENSE_TILES_TRANSIENT * largest[1] * largest[2] / split
    return out


def _subtree(d: dict, fqn: str) -> float:
    if not fqn:
        return sum(d.values())
    return sum(v for k, v in d.items() if k == fqn or k.startswith(fqn + "."))


def _flops(an: Analysis, fqn: str) -> float:
    return an.flops.get(fqn, 0)


def costs(an: Analysis, units: list, modules: dict, dp: int, tp: int, spec: DeviceSpec,
          optimizer_states: int) -> Costs:
    fp32 = any(size == 4 for _, size in an.params.values())
    sec_per_flop = (spec.fp32_slowdown if fp32 else 1.0) / (spec.peak_flops * spec.efficiency)
    c = Costs(dp, tp)
    unit_flops = 0.0
    unit_saved = 0.0
    tiles = attention_tiles(an, units, dp, tp)
    no_tiles = {False: 0.0, True: 0.0}
    for u in units:
        flops = sum(_flops(an, f) for f in u.instances)
        saved = sum(_subtree(an.saved, f) for f in u.instances)
        unit_flops += flops
        unit_saved += saved
        tile = tiles.get(u.name, no_tiles)
        opts = {"none": Term(flops / dp * sec_per_flop, memory=saved / dp + tile[False])}
        if tp_ok(u, tp, modules, an):
            t = Term(0.0, memory=tile[True])  # its heads split over tp
            if u.kind == "block":
                for f in u.instances:
                    blk = next(b for b in an.blocks if b.fqn == f)
                    repl = sum(_subtree(an.saved, x) for x in blk.ins)
                    sh = _subtree(an.saved, f) - repl
                    t.memory += (repl + sh / tp) / dp
                    # forward: one all-reduce of the rowwise output; backward: one of the
                    # input's gradient per colwise layer reading it (q, k, v: three), as
                    # DTensor's ColwiseParallel (each its own Replicate input) and XLA's
                    # partitioner (each dot's partial sum) both reduce them
                    for nbytes in (blk.out_act_bytes, *[blk.in_act_bytes] * len(blk.ins)):
                        b, s = ring("all_reduce", nbytes / dp, tp, spec)
                        t.tp_bytes += b
                        t.comm += s
            else:
                for f in u.instances:
                    leaf = an.leaves[f]
                    t.memory += _subtree(an.saved, f) / dp  # its input stays replicated
                    colls = ([("all_gather", leaf.out_bytes), ("all_reduce", leaf.in_bytes)]
                             if u.kind == "linear" else [("all_reduce", leaf.out_bytes)])
                    for kind, nbytes in colls:
                        b, s = ring(kind, nbytes / dp, tp, spec)
                        t.tp_bytes += b
                        t.comm += s
            t.compute = flops / dp / tp * sec_per_flop
            opts[u.option] = t
        c.unit_opts[u.name] = opts
    owned = {}
    for u in units:
        for g, rel in params_of(u, an).items():
            owned.setdefault(g, (u, rel))
    for g, names in an.groups.items():
        u, rel = owned.get(g, (None, None))
        c.owner[g] = u.name if u is not None else None
        tp_opts = list(c.unit_opts[u.name]) if u is not None else ["none"]
        per = {}
        nbytes = sum(_numel(an.params[n][0]) * an.params[n][1] for n in names)
        for t in tp_opts:
            local = nbytes / (tp if t != "none" and u.param_tp(rel) != "Replicate" else 1)
            per_inst = local / max(len(names), 1)
            repl_b, repl_s = ring("all_reduce", local, dp, spec)
            per[(t, "replicate")] = Term(memory=local * (2 + optimizer_states), dp_bytes=repl_b,
                                         comm=repl_s)
            if dp > 1:
                ag_b, ag_s = ring("all_gather", per_inst, dp, spec)
                rs_b, rs_s = ring("reduce_scatter", per_inst, dp, spec)
                k = len(names)
                # FSDP2 holds one instance unsharded: its parameters (all-gathered) and, in
                # backward, its gradients until they are reduce-scattered
                per[(t, "fsdp")] = Term(memory=local * (2 + optimizer_states) / dp + 2 * per_inst,
                                        dp_bytes=k * (2 * ag_b + rs_b),
                                        comm=k * (2 * ag_s + rs_s))
        c.group_opts[g] = per
    rest_flops = max(_flops(an, "") - unit_flops, 0.0)
    rest_saved = max(sum(an.saved.values()) - unit_saved, 0.0)
    c.const = Term(rest_flops / dp * sec_per_flop,
                   memory=rest_saved / dp + tiles.get(None, no_tiles)[False] + an.input_bytes
                   + an.buffer_bytes)
    if an.loss_outside:
        # the user's loss runs on the outputs gathered over dp: every rank saves the global
        # batch's log-probabilities (unless loss parallelism keeps the logits sharded)
        c.const.memory += (1 - 1 / dp) * an.loss_saved
    if tp > 1 and not an.sp_blocker and an.seq_len % tp == 0 and \
            all(len(o) > 1 for o in c.unit_opts.values()):
        c.sp = _sp_term(an, modules, dp, tp, spec, sec_per_flop)
        c.sg = _regather_term(an, units, dp, tp, spec)
    head = next((u for u in units if an.leaf_order and an.leaf_order[-1] in u.instances), None)
    if tp > 1 and an.loss_inside and head is not None and head.kind == "linear" and \
            len(c.unit_opts[head.name]) > 1:
        # loss parallel: the head's logits stay sharded on the vocabulary and the model's own
        # cross-entropy runs on them (torch.distributed.tensor.parallel.loss_parallel): its
        # saved log-probabilities are divided by tp, the head's output all-gather is gone, and
        # three all-reduces of one float per token (max, sum of exp, target logit) come in
        leaf = an.leaves[an.leaf_order[-1]]
        per_token = leaf.out_bytes / max(modules[leaf.fqn].out_features, 1)  # one value each
        ag_b, ag_s = ring("all_gather", leaf.out_bytes / dp, tp, spec)
        ar_b, ar_s = ring("all_reduce", 3 * per_token / dp, tp, spec)
        if an.loss_outside:  # the user's loss on the (dp, vocab)-sharded logits
            lp_mem = -(1 - 1 / (dp * tp)) * an.loss_saved
        else:
            lp_mem = -(1 - 1 / tp) * an.loss_saved / dp
        c.lp = Term(0.0, ar_s - ag_s, lp_mem, tp_bytes=ar_b - ag_b)
        c.head = head.name
    return c


def _sp_term(an: Analysis, modules: dict, dp: int, tp: int, spec: DeviceSpec,
             sec_per_flop: float) -> Term:
    """What sequence parallelism (every unit sharded) changes: what runs on the stream between
    the blocks -- the norms and the repeated layers' own ops (residual adds) -- runs on seq / tp
    tokens and keeps 1 / tp of its saved activations; each block's forward all-reduce becomes
    an all-gather of its input and a reduce-scatter of its output (the same bytes), and its
    output's gradient, sequence-sharded, is all-gathered in backward for the rowwise layer
    (its input's gradient still all-reduced per colwise layer, then sliced); the head
    gathers its input instead of all-reducing its input gradient (the same). Entered at the
    embedding (TorchTitan's), the embedding's all-reduce becomes a reduce-scatter; entered at
    the first repeated layer (``an.sp_entry``: the prologue stays replicated), the embedding
    keeps its all-reduce and the entry's slice costs an all-gather of its gradient."""
    from .analysis import sp_norms

    region = sp_norms(an, modules)
    saved = sum(an.saved.get(f, 0) for f in region)
    flops = sum(_flops(an, f) for f in region)
    for layer in an.layers:
        saved += an.saved.get(layer, 0)
        kids = [f"{layer}.{n}" for n, _ in modules[layer].named_children()]
        flops += max(_flops(an, layer) - sum(_flops(an, k) for k in kids), 0.0)
    emb = an.leaves[an.leaf_order[0]]
    b, t = ring("all_gather", emb.out_bytes / dp, tp, spec)
    keep = 1 - 1 / tp
    if an.sp_entry is None:
        b, t = -b, -t
    for blk in an.blocks:
        gb, gt = ring("all_gather", blk.out_act_bytes / dp, tp, spec)
        b, t = b + gb, t + gt
    return Term(-keep * flops / dp * sec_per_flop, t, -keep * saved / dp, tp_bytes=b)


def _regather_term(an: Analysis, units: list, dp: int, tp: int, spec: DeviceSpec) -> Term:
    """What saving each TP block's input sharded on the sequence changes under SP: its colwise
    layers' saved input (the all-gathered stream, whole on every tp rank) is kept as the
    rank's 1 / tp slice and gathered again in backward: one more all-gather of the block input
    per block instance."""
    t = Term(0.0)
    for u in units:
        if u.kind != "block":
            continue
        for f in u.instances:
            blk = next(b for b in an.blocks if b.fqn == f)
            repl = sum(_subtree(an.saved, x) for x in blk.ins)
            t.memory -= (1 - 1 / tp) * repl / dp
            b, s = ring("all_gather", blk.in_act_bytes / dp, tp, spec)
            t.tp_bytes += b
            t.comm += s
    return t


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def evaluate(c: Costs, unit_choice: dict, group_choice: dict, sp: bool = False,
             lp: bool = False, sg: bool = False) -> Term:
    """The predicted Term of one assignment (unit -> tp opt, group -> dp opt, sequence
    parallel or not, loss parallel or not, block inputs saved sharded or not)."""
    tot = c.const
    if sp:
        if c.sp is None:
            raise ValueError("sequence parallelism is not possible for this model and mesh")
        tot = tot + c.sp
    if sg:
        if not sp:
            raise ValueError("saving the blocks' inputs sharded on the sequence needs "
                             "sequence parallelism")
        tot = tot + c.sg
    if lp:
        if c.lp is None or unit_choice.get(c.head, "none") == "none":
            raise ValueError("loss parallelism needs a cross-entropy on the head's output (in "
                             "the model, or in the loss_fn given to the search), and the head "
                             "sharded")
        tot = tot + c.lp
    for u, opt in unit_choice.items():
        tot = tot + c.unit_opts[u][opt]
    for g, d in group_choice.items():
        owner = c.owner[g]
        t = unit_choice[owner] if owner is not None else "none"
        tot = tot + c.group_opts[g][(t, d)]
    return tot
