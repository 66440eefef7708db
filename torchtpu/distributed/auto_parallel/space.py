"""The search space: mesh factorisations, tensor-parallel units and their placements.

A mesh of ``n`` devices is tried as every ``dp x tp = n`` ("dp" outer, "tp" inner, as
TorchTitan lays out its 2-D mesh). On the ``tp`` axis the decisions are per *unit*:
  - a TP block (``analysis.TPBlock``): ``tp`` = its in layers colwise (weight and bias
    Shard(0)) and its out layer rowwise (weight Shard(1), bias Replicate); the block's input and
    output stay replicated (Megatron's attention / MLP split, TorchTitan's plan);
  - a Linear outside any block: ``colwise`` with its output gathered (a vocab-parallel head);
  - an Embedding: ``rowwise`` (vocabulary Shard(0), output all-reduced);
  - otherwise ``none``: replicated over tp.
On the ``dp`` axis each parameter group is ``fsdp`` (Shard(0): FSDP2) or ``replicate`` (DDP:
gradients all-reduced); the batch is split over dp. Repeated layers are one unit and one group
(``layers.*...``), so they share one decision; the 2-D placements are the combinations.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .analysis import Analysis


def factorisations(n: int) -> list:
    """Every (dp, tp) with dp * tp == n."""
    return [(n // t, t) for t in range(1, n + 1) if n % t == 0]


@dataclass
class Unit:
    name: str  # group name of the module (layers.*.attention)
    kind: str  # "block" | "linear" | "embedding"
    instances: list  # module fqns
    ins: list = field(default_factory=list)  # block: in-layer names relative to the module
    out: str = ""  # block: out-layer name relative to the module
    option: str = "tp"  # its tp choice when sharded: "tp" | "colwise" | "rowwise"

    def param_tp(self, pname: str) -> str:
        """The tp placement of one parameter (name relative to the unit's module) when the unit
        is sharded: "Shard(0)", "Shard(1)" or "Replicate"."""
        mod, _, leaf = pname.rpartition(".")
        if self.kind == "block":
            if mod in self.ins:
                return "Shard(0)"
            if mod == self.out:
                return "Shard(1)" if leaf == "weight" else "Replicate"
            return "Replicate"
        return "Shard(0)"  # colwise linear (weight and bias) / rowwise embedding (vocab)


def units(an: Analysis, modules: dict) -> list:
    """The TP units of an analysed model (``modules``: fqn -> nn.Module)."""
    out = {}
    in_block = set()
    for b in an.blocks:
        rel = lambda f, b=b: f[len(b.fqn) + 1:] if b.fqn else f  # noqa: E731
        g = an.namer(b.fqn)
        u = out.get(g)
        if u is None:
            out[g] = Unit(g, "block", [b.fqn], [rel(f) for f in b.ins], rel(b.out), "tp")
        elif [rel(f) for f in b.ins] == u.ins and rel(b.out) == u.out:
            u.instances.append(b.fqn)
        in_block.update(b.ins)
        in_block.add(b.out)
    for fqn, leaf in an.leaves.items():
        if fqn in in_block or fqn in an.custom_leaves:
            continue
        g = an.namer(fqn)
        u = out.get(g)
        if u is None:
            out[g] = Unit(g, leaf.kind, [fqn], option="colwise" if leaf.kind == "linear"
                          else "rowwise")
        elif fqn not in u.instances:
            u.instances.append(fqn)
    return list(out.values())


def tp_ok(unit: Unit, tp: int, modules: dict, an: Analysis) -> bool:
    """Whether ``unit`` can be sharded ``tp`` ways: every sharded dimension divisible by tp,
    and every head count found on a block divisible by tp."""
    if tp == 1:
        return False
    for fqn in unit.instances:
        m = modules[fqn]
        if unit.kind == "block":
            if any(modules[f"{fqn}.{i}" if fqn else i].out_features % tp for i in unit.ins):
                return False
            blk = next(b for b in an.blocks if b.fqn == fqn)
            if any(h % tp for h in blk.heads):
                return False
            if blk.tps is not None and tp not in blk.tps:  # a fused projection: as checked
                return False
        elif unit.kind == "linear":
            if m.out_features % tp:
                return False
        elif m.num_embeddings % tp:
            return False
    return True


def params_of(unit: Unit, an: Analysis) -> dict:
    """Parameter group -> the parameter name relative to the unit's module, for the groups
    this unit's modules own."""
    res = {}
    for g in an.groups:
        if unit.name and g.startswith(unit.name + "."):
            res[g] = g[len(unit.name) + 1:]
        elif not unit.name:
            res[g] = g
    return res
