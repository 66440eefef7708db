"""``Plan``: a parallel plan found by ``auto_parallelize`` (or written by hand): readable,
saved as JSON, loaded, applied to a model, translated to TorchTitan's config."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .space import Unit


def _mib(b) -> str:
    return f"{b / 2**20:.2f} MiB"


@dataclass
class Plan:
    dp: int
    tp: int
    device: str
    units: dict  # unit name -> {"kind", "ins", "out", "option", "choice"}
    groups: dict  # parameter group -> {"dp": "fsdp"|"replicate", "tp": placement}
    predicted: dict = field(default_factory=dict)  # step_time_s, memory_bytes, dp/tp bytes...
    compiled: dict = field(default_factory=dict)  # XLA's figures (verify.py), if verified
    why: list = field(default_factory=list)  # lines explaining the choice
    search: dict = field(default_factory=dict)  # solver / verification wall time, candidates
    sequence_parallel: bool = False  # activations between TP blocks sharded on the sequence
    sp_modules: dict = field(default_factory=dict)  # with it: {"norms", "blocks", "entry"}
    loss_parallel: bool = False  # the head's logits vocab-sharded for the model's own loss
    loss_head: str = ""  # with it: the head's unit
    # with it: the loss is the user's (``loss_fn``), the module returns the logits as a DTensor
    # sharded on the vocabulary (and the batch over dp), ``Plan.loss`` computes it
    loss_outside: bool = False
    # with sequence parallelism: each TP block's input saved sharded on the sequence for
    # backward and gathered again there (Megatron's SP), not saved whole per tp rank
    sp_regather: bool = False

    # ---- building ----

    @classmethod
    def from_choice(cls, dp, tp, device, units, unit_choice, group_choice, owner, term,
                    sp=False, lp=False):
        ud = {}
        for u in units:
            ud[u.name] = {"kind": u.kind, "ins": u.ins, "out": u.out, "option": u.option,
                          "choice": unit_choice.get(u.name, "none")}
        gd = {}
        by_name = {u.name: u for u in units}
        for g, d in group_choice.items():
            o = owner.get(g)
            place = "Replicate"
            if o is not None and ud[o]["choice"] != "none":
                u = by_name[o]
                place = u.param_tp(g[len(o) + 1:] if o else g)
            gd[g] = {"dp": d if dp > 1 else "replicate", "tp": place, "unit": o}
        return cls(dp, tp, device, ud, gd, predicted=_term_dict(term), sequence_parallel=sp,
                   loss_parallel=lp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def unit_objects(self) -> list:
        return [Unit(n, u["kind"], [], list(u["ins"]), u["out"], u["option"])
                for n, u in self.units.items()]

    # ---- reading ----

    def __str__(self) -> str:
        lines = [f"Plan for {self.world_size} devices: mesh dp={self.dp} x tp={self.tp} "
                 f"(cost model: {self.device})"]
        p = self.predicted
        if p:
            lines.append(f"  predicted per device: step {p['step_time_s'] * 1e3:.3f} ms "
                         f"(compute {p['compute_s'] * 1e3:.3f}, comm {p['comm_s'] * 1e3:.3f}), "
                         f"memory {_mib(p['memory_bytes'])}, collectives dp "
                         f"{_mib(p['dp_bytes'])} + tp {_mib(p['tp_bytes'])}")
        c = self.compiled
        if c:
            how = f", as applied: {', '.join(c['lowered'])}" if c.get("lowered") else ""
            lines.append(f"  compiled by XLA ({c['devices']} devices{how}): memory "
                         f"{_mib(c['memory_bytes'])}, collectives {_mib(c['collective_bytes'])} "
                         f"{c['collectives']}, {c['flops']:.3g} FLOPs/device"
                         + (f"; UNPREDICTED: {c['unpredicted']}" if c.get("unpredicted") else "")
                         + (f"; OVER the {_mib(c['over_budget'])} budget (predicted under it; "
                            f"no compiled candidate fits)" if c.get("over_budget") else ""))
        tp_units = [n or "<root>" for n, u in self.units.items() if u["choice"] != "none"]
        if tp_units:
            lines.append("  tensor parallel: " + ", ".join(
                f"{n} ({self.units[n if n != '<root>' else '']['choice']})" for n in tp_units))
        if self.sequence_parallel:
            lines.append("  sequence parallel: activations between the TP blocks sharded on "
                         "the sequence (norms: " + ", ".join(self.sp_modules.get("norms", []))
                         + ")" + (f", entered at {self.sp_modules['entry'][0]} (the "
                                  f"prologue before it replicated)"
                                  if self.sp_modules.get("entry") else ""))
            if self.sp_regather:
                lines.append("  block inputs saved sharded on the sequence, gathered again "
                             "in backward")
        if self.loss_parallel and self.loss_outside:
            lines.append("  loss parallel: the model returns its logits as a DTensor sharded "
                         "on the vocabulary; compute the loss with plan.loss(loss_fn)")
        elif self.loss_parallel:
            lines.append("  loss parallel: the head's logits stay sharded on the vocabulary "
                         "for the model's own cross-entropy (outputs gathered)")
        lines.append("  parameters:")
        w = max((len(g) for g in self.groups), default=10)
        for g, d in self.groups.items():
            dp = "Shard(0)" if d["dp"] == "fsdp" else "Replicate"
            lines.append(f"    {g:<{w}}  dp: {dp:<9} tp: {d['tp']}")
        for line in self.why:
            lines.append("  " + line)
        return "\n".join(lines)

    __repr__ = __str__

    # ---- JSON ----

    def to_dict(self) -> dict:
        return {"version": 1, "dp": self.dp, "tp": self.tp, "device": self.device,
                "units": self.units, "groups": self.groups, "predicted": self.predicted,
                "compiled": self.compiled, "why": self.why, "search": self.search,
                "sequence_parallel": self.sequence_parallel, "sp_modules": self.sp_modules,
                "loss_parallel": self.loss_parallel, "loss_head": self.loss_head,
                "loss_outside": self.loss_outside, "sp_regather": self.sp_regather}

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("version") != 1:
            raise ValueError(f"Plan.load: unknown plan version {d.get('version')!r}")
        return cls(d["dp"], d["tp"], d["device"], d["units"], d["groups"], d["predicted"],
                   d["compiled"], d["why"], d["search"], d.get("sequence_parallel", False),
                   d.get("sp_modules", {}), d.get("loss_parallel", False),
                   d.get("loss_head", ""), d.get("loss_outside", False),
                   d.get("sp_regather", False))

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)  # model order: diffable

    @classmethod
    def load(cls, path) -> "Plan":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def decisions(self) -> dict:
        """The placements alone (what apply() uses), for comparing plans."""
        return {"dp": self.dp, "tp": self.tp, "sequence_parallel": self.sequence_parallel,
                "loss_parallel": self.loss_parallel, "loss_outside": self.loss_outside,
                "sp_regather": self.sp_regather, "units": {n: u["choice"] for n, u in self.units.items()},
                "groups": {g: (d["dp"], d["tp"]) for g, d in self.groups.items()}}

    # ---- using ----

    def apply(self, model, mesh=None, device="tpu"):
        """Shard ``model`` in place by this plan (TP through ``parallelize_module``, FSDP
        through ``fully_shard``, replicated parameters' gradients averaged over dp) and return
        it; see ``apply.py``."""
        from .apply import apply_plan

        return apply_plan(self, model, mesh, device)

    def loss(self, loss_fn):
        """``loss_fn`` (called as ``loss_fn(output, *args, **kwargs)``) made to run on what the
        applied module returns: with loss parallelism for a loss outside the model the logits
        are a DTensor sharded on the vocabulary (and on the batch over dp), and each
        ``F.cross_entropy`` on them runs as PyTorch's ``loss_parallel()`` computes it, forward
        and backward (``loss.backward()`` needs no context); targets are the global plain
        tensors. Without loss parallelism it is ``loss_fn`` itself."""
        if not (self.loss_parallel and self.loss_outside):
            return loss_fn
        from .loss_parallel import outside_loss

        return outside_loss(loss_fn)

    def to_torchtitan(self) -> dict:
        """TorchTitan's ``parallelism`` settings for this plan, where one exists: data
        parallel shard/replicate degrees and the tensor parallel degree. TorchTitan's own TP
        plan for llama3 shards attention, MLP, embedding and head all together; a plan that
        shards only some of them, or keeps some parameters replicated under FSDP, has no exact
        TorchTitan equivalent (``exact`` is False then); nor has saving the blocks' inputs
        sharded on the sequence (``sp_regather``: TorchTitan's SP saves them gathered)."""
        dps = {d["dp"] for d in self.groups.values()}
        fsdp = self.dp > 1 and dps == {"fsdp"}
        ddp = self.dp > 1 and dps == {"replicate"}
        tp_all = all(u["choice"] != "none" for u in self.units.values())
        tp_none = all(u["choice"] == "none" for u in self.units.values())
        exact = (self.dp == 1 or fsdp or ddp) and (self.tp == 1 or tp_all) and \
            (self.tp > 1 or tp_none) and not self.sp_regather
        return {"parallelism": {"data_parallel_shard_degree": self.dp if fsdp else 1,
                                "data_parallel_replicate_degree": self.dp if ddp else 1,
                                "tensor_parallel_degree": self.tp,
                                "enable_sequence_parallel": self.sequence_parallel,
                                "disable_loss_parallel": not self.loss_parallel},
                "exact": exact}


def _term_dict(t) -> dict:
    return {"step_time_s": t.time, "compute_s": t.compute, "comm_s": t.comm,
            "memory_bytes": t.memory, "dp_bytes": t.dp_bytes, "tp_bytes": t.tp_bytes}
