"""``Plan.apply``: shard a model by a plan with PyTorch's own parallelism APIs.

Order: tensor parallel first (``parallelize_module`` over ``mesh["tp"]``: ColwiseParallel /
RowwiseParallel per unit), then FSDP2 (``fully_shard`` over ``mesh["dp"]`` on every repeated
layer and on the root, the replicated-over-dp parameters passed as ``ignored_params``), then,
for a model built on "meta", ``to_empty`` + its own initialisation, then the gradient hooks of
the replicated-over-dp parameters (an average over dp, what DDP does).

The calling convention of the original module is kept: every rank passes the same global batch.
A forward pre-hook gives each dp rank its slice of every tensor input whose first dimension is
the batch; a forward hook gathers each output back to the global batch (an all-gather over dp;
a 0-dim floating output, such as a loss the model computes itself, is averaged over dp), so
every rank gets the same outputs and computes the same loss. In backward, the gather returns
each rank its slice of the (identical) gradient times dp, the scalar average passes it through:
together with FSDP's / the hooks' average over dp this gives exactly the one-process gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from .analysis import namer
from .dp_ops import _GatherBatch, _MeanScalar


def _batch_hooks(model: nn.Module, dp: int, rank: int, group, mesh) -> None:
    state = {}

    def split(mod, args, kwargs):
        leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not leaves or leaves[0].dim() == 0:
            return None
        b = leaves[0].shape[0]
        if b % dp:
            raise ValueError(f"auto_parallelize: the batch size {b} of the first input is not "
                             f"divisible by the plan's data-parallel degree {dp}")
        state["local"] = b // dp
        _check_even_labels(kwargs.get("labels"), b, dp)

        def cut(t):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == b:
                return t.chunk(dp)[rank]
            return t

        return pytree.tree_map(cut, (args, kwargs))

    def gather(mod, args, kwargs, out):
        local = state.get("local")

        def join(t):
            from torch.distributed.tensor import DTensor, Shard

            if not isinstance(t, torch.Tensor):
                return t
            if isinstance(t, DTensor):  # vocab-sharded logits for the user's loss: their
                # batch stays split over dp too (Plan.loss)
                if t.dim() == 0 or t.device_mesh.ndim != 1 or mesh.ndim != 2:
                    raise NotImplementedError(f"Plan.apply: a DTensor output placed "
                                              f"{t.placements} cannot be batch-gathered")
                return DTensor.from_local(t.to_local(), mesh, [Shard(0), *t.placements],
                                          run_check=False)
            if t.dim() == 0:
                if t.is_floating_point():
                    return _MeanScalar.apply(t, group, dp)
                return t
            if t.shape[0] != local:
                return t
            if t.requires_grad:
                return _GatherBatch.apply(t, group, dp, rank)
            out_ = t.new_empty((t.shape[0] * dp,) + tuple(t.shape[1:]))
            dist.all_gather_into_tensor(out_, t.contiguous(), group=group)
            return out_

        return pytree.tree_map(join, out)

    model.register_forward_pre_hook(split, with_kwargs=True, prepend=True)
    model.register_forward_hook(gather, with_kwargs=True)


def _check_even_labels(labels, b: int, dp: int) -> None:
    """A loss the model computes itself (HF's ``labels=``) is averaged over dp: one process's
    mean only if every dp slice counts as many targets. Labels marked -100 (ignored) unevenly
    across the slices -- as they are or shifted by one token, as causal LMs shift them -- would
    give another loss and other gradients than one process: a clear error instead (one host
    read of the counts; only for integer ``labels`` holding -100)."""
    if dp == 1 or not isinstance(labels, torch.Tensor) or labels.is_floating_point() or \
            labels.dim() == 0 or labels.shape[0] != b:
        return
    valid = (labels != -100).reshape(b, -1)
    counts = torch.stack([valid.reshape(dp, -1).sum(1),
                          valid[:, 1:].reshape(dp, -1).sum(1)]).cpu()
    if bool((counts != counts[:, :1]).any()):
        raise ValueError(
            f"Plan.apply: the model computes its loss from labels whose ignored (-100) targets "
            f"are spread unevenly over the {dp} data-parallel slices of the batch (counted "
            f"targets per slice {counts[0].tolist()}, shifted by one token "
            f"{counts[1].tolist()}): the slices' mean losses averaged would not be one "
            f"process's loss. Compute the loss outside the model and pass it to the search "
            f"(auto_parallelize(..., loss_fn=...), then plan.loss(loss_fn)), which divides by "
            f"the whole batch's count, or spread the ignored targets evenly.")


def _check_same_plan(plan) -> None:
    """Every rank must apply the same plan (a plan searched on each rank could differ if, say,
    the memory budgets differed): compare with rank 0's."""
    mine = [plan.decisions()]
    ref = list(mine)
    dist.broadcast_object_list(ref, src=0)
    if ref[0] != mine[0]:
        raise RuntimeError(f"Plan.apply: rank {dist.get_rank()}'s plan differs from rank 0's "
                           f"(search once and Plan.load the saved plan on every rank)")


def _tp_plan(plan, model: nn.Module, gn) -> dict:
    """``parallelize_module``'s plan. With sequence parallelism it is TorchTitan's: the
    embedding's output leaves sharded on the sequence (``Shard(1)``), the norms run on the
    sharded tokens (``SequenceParallel``), each block gathers its input
    (``PrepareModuleInput``) and its rowwise layer reduce-scatters its output back to
    ``Shard(1)``, the head gathers its input; its output is replicated (the calling
    convention: every rank gets the whole output). Entered at the first repeated layer
    (``sp_modules["entry"]``: the model's prologue -- mask, positions, rotary tables -- reads
    the full sequence), the embedding's output stays replicated and that layer's stream
    argument goes ``Replicate()`` -> ``Shard(1)`` (a local slice). With loss parallelism the
    head's output stays a DTensor sharded on the vocabulary (``loss_parallel.py``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    sp = plan.sequence_parallel
    seq = Shard(1)
    norms = set(plan.sp_modules.get("norms", [])) if sp else set()
    entry = plan.sp_modules.get("entry") if sp else None
    res = {}
    if entry:
        layer, act, nargs = entry
        if isinstance(act, int):
            res[layer] = PrepareModuleInput(
                input_layouts=tuple(Replicate() if i == act else None for i in range(nargs)),
                desired_input_layouts=tuple(seq if i == act else None for i in range(nargs)),
                use_local_output=True)  # the residual stream between blocks: local tensors
        else:
            res[layer] = PrepareModuleInput(input_kwarg_layouts={act: Replicate()},
                                            desired_input_kwarg_layouts={act: seq},
                                            use_local_output=True)
    for fqn, _ in model.named_modules():
        if gn(fqn) in norms:
            res[fqn] = SequenceParallel()
            continue
        u = plan.units.get(gn(fqn))
        if u is None or u["choice"] == "none":
            if sp and u is not None:
                raise ValueError(f"Plan.apply: sequence parallelism needs every TP unit "
                                 f"sharded; {gn(fqn)!r} is not")
            continue
        pre = f"{fqn}." if fqn else ""
        if u["kind"] == "block":
            for i in u["ins"]:
                res[pre + i] = ColwiseParallel()
            res[pre + u["out"]] = RowwiseParallel(output_layouts=seq) if sp else \
                RowwiseParallel()
            if sp:
                act, nargs = plan.sp_modules["blocks"][gn(fqn)]
                if isinstance(act, int):
                    res[fqn] = PrepareModuleInput(
                        input_layouts=tuple(seq if i == act else None for i in range(nargs)),
                        desired_input_layouts=tuple(Replicate() if i == act else None
                                                    for i in range(nargs)))
                else:
                    res[fqn] = PrepareModuleInput(input_kwarg_layouts={act: seq},
                                                  desired_input_kwarg_layouts={act: Replicate()})
        elif u["kind"] == "linear":
            lp = plan.loss_parallel and gn(fqn) == plan.loss_head
            res[fqn] = ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                       output_layouts=Shard(-1) if lp else Replicate(),
                                       use_local_output=not lp)
        else:
            res[fqn] = RowwiseParallel(input_layouts=Replicate(),
                                       output_layouts=seq if sp and not entry else Replicate())
    return res


def apply_plan(plan, model: nn.Module, mesh=None, device="tpu") -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    first = _first_names(model)
    gn0 = namer(model)

    def gn(fqn):  # a tied parameter's other names take its first name's decision
        return gn0(first.get(fqn, fqn))

    names = {n for n, _ in model.named_parameters()}
    missing = sorted(n for n in names if gn(n) not in plan.groups)
    if missing:
        raise ValueError(f"Plan.apply: the plan has no decision for parameter(s) {missing[:5]} "
                         f"(was it made for another model?)")
    n = plan.world_size
    world = dist.get_world_size() if dist.is_initialized() else 1
    if n > 1 and world != n:
        raise RuntimeError(f"Plan.apply: the plan is for {n} processes but the default process "
                           f"group has {world} (call dist.init_process_group first)")
    if mesh is not None and mesh.size() != n:
        raise ValueError(f"Plan.apply: the mesh has {mesh.size()} devices, the plan {n}")
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if n == 1:
        if on_meta:
            model.to_empty(device=device)
            _initialise(model)
            return model
        return model.to(device)
    _check_same_plan(plan)
    dims, shape = [], []
    for name, size in (("dp", plan.dp), ("tp", plan.tp)):
        if size > 1:
            dims.append(name)
            shape.append(size)
    if mesh is not None and tuple(mesh.mesh_dim_names or ()) == tuple(dims) \
            and tuple(mesh.shape) == tuple(shape):
        full = mesh
    else:
        full = init_device_mesh(device, tuple(shape), mesh_dim_names=tuple(dims))
    if not on_meta:
        model.to(device)
    if plan.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        tp_plan = _tp_plan(plan, model, gn)
        if tp_plan:
            parallelize_module(model, full["tp"], tp_plan)
            _retie(model, first)
        if plan.sequence_parallel and plan.sp_regather:
            from .regather import install as save_sharded

            blocks = plan.sp_modules["blocks"]
            save_sharded(model, {fqn: blocks[gn(fqn)][0] for fqn, _ in model.named_modules()
                                 if gn(fqn) in blocks}, full["tp"])
        if plan.loss_parallel:
            from .loss_parallel import install

            install(model, outside=plan.loss_outside)
    _replicate_rest(model, full["tp"] if plan.tp > 1 else full["dp"], plan, gn)
    replicated = []
    if plan.dp > 1:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = full["dp"]
        repl = {p for n_, p in model.named_parameters()
                if plan.groups[gn(n_)]["dp"] == "replicate"}
        sharded_any = any(p not in repl for p in model.parameters())
        if sharded_any:
            for fqn, mod in model.named_modules():
                if fqn and isinstance(_parent(model, fqn), (nn.ModuleList, nn.ModuleDict)):
                    own = set(mod.parameters())
                    if own - repl:
                        fully_shard(mod, mesh=dp_mesh, ignored_params=own & repl or None)
            fully_shard(model, mesh=dp_mesh, ignored_params=repl or None)
        replicated = [p for p in model.parameters() if p in repl]
    if on_meta:
        model.to_empty(device=device)
        _initialise(model)
        _sync_replicated(model)
    if plan.dp > 1:
        dp_mesh = full["dp"]
        _batch_hooks(model, plan.dp, dp_mesh.get_local_rank(), dp_mesh.get_group(), full)
        _average_grads(replicated, dp_mesh.get_group(), plan.dp)
    return model


def _replicate_rest(model: nn.Module, mesh, plan, gn) -> None:
    """Every parameter that tensor parallelism left a plain tensor and FSDP will not shard
    becomes a DTensor replicated on ``mesh`` (the tp mesh, or the dp mesh without tp), with
    its module's tensor inputs entering as replicated DTensors and its outputs leaving as
    local tensors: an optimizer's foreach ops cannot mix plain tensors and DTensors."""
    from torch.distributed.tensor import DTensor, Replicate

    fsdp_owned = plan.tp == 1  # on a dp-only mesh FSDP turns its groups into DTensors itself
    made = {}  # a tied parameter becomes one DTensor parameter in each of its modules

    def plain(fqn, mod, recurse):
        """(module, name, parameter) of what ``mod`` (its subtree with ``recurse``) holds
        that neither tensor parallelism nor FSDP turns into DTensors; None if something in
        the subtree is theirs."""
        res = []
        for n_, p in mod.named_parameters(recurse=recurse, remove_duplicate=False):
            full_name = f"{fqn}.{n_}" if fqn else n_
            if isinstance(p, DTensor) or (fsdp_owned and plan.groups[gn(full_name)]["dp"]
                                          == "fsdp"):
                if recurse:
                    return None
                continue
            owner, _, attr = n_.rpartition(".")
            res.append((mod.get_submodule(owner) if owner else mod, attr, p))
        return res

    done = set()  # subtrees made replicated whole
    for fqn, mod in list(model.named_modules()):
        if any(fqn.startswith(d + ".") or (not d and fqn) for d in done):
            continue
        own = plain(fqn, mod, recurse=False)
        if not own:
            continue
        if any(True for c in mod.children() for _ in c.parameters()):
            # its own parameters and its submodules' meet inside its forward (a ViT's
            # embeddings: CLS token and positions beside the patch convolution): the whole
            # subtree replicated, hooks on this module only
            own = plain(fqn, mod, recurse=True)
            if own is None:
                raise NotImplementedError(
                    f"Plan.apply: module {fqn or '<root>'} ({type(mod).__name__}) holds "
                    f"replicated parameters directly and has submodules that tensor "
                    f"parallelism or FSDP shards: not supported yet")
            done.add(fqn)
        for owner, n_, p in own:
            if p not in made:
                made[p] = nn.Parameter(
                    DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                    requires_grad=p.requires_grad)
            owner.register_parameter(n_, made[p])
        if not _own_forward(mod):
            mod.register_forward_pre_hook(_to_replicated(mesh), with_kwargs=True)
        # else a Linear / Embedding with its own forward (TorchTitan's Embedding unwraps a
        # DTensor weight with ``to_local()`` and takes plain inputs): its inputs stay local
        mod.register_forward_hook(_to_local)


def _first_names(model: nn.Module) -> dict:
    """``fqn -> first fqn`` of every parameter registered under more than one name (a head
    tied to the embedding: ``lm_head.weight`` -> ``transformer.wte.weight``), the first name
    being the one ``named_parameters()`` (and so the plan) keeps."""
    first, res = {}, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p in first:
            res[n] = first[p]
        else:
            first[p] = n
    return res


def _retie(model: nn.Module, first: dict) -> None:
    """``parallelize_module`` distributes each module's parameter apart: a tied parameter's
    modules get one DTensor each. Tie them again (the first name's) where tensor parallelism
    placed them alike; different placements of one tied parameter are refused."""
    from torch.distributed.tensor import DTensor

    for n, f in first.items():
        p, q = model.get_parameter(f), model.get_parameter(n)
        if p is q:
            continue
        lay = [(x.device_mesh, tuple(x.placements)) if isinstance(x, DTensor) else None
               for x in (p, q)]
        if lay[0] != lay[1]:
            raise NotImplementedError(
                f"Plan.apply: {n} is tied to {f} but the plan places them differently "
                f"({lay[1][1] if lay[1] else 'plain'} vs {lay[0][1] if lay[0] else 'plain'}): "
                f"untie them or keep both modules replicated")
        mod, _, attr = n.rpartition(".")
        model.get_submodule(mod).register_parameter(attr, p)


def _own_forward(mod) -> bool:
    """A Linear / Embedding whose class overrides the standard forward."""
    return any(isinstance(mod, b) and type(mod).forward is not b.forward
               for b in (nn.Linear, nn.Embedding))


def _to_replicated(mesh):
    from torch.distributed.tensor import DTensor, Replicate

    def hook(mod, args, kwargs):
        def conv(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
            return t

        return pytree.tree_map(conv, (args, kwargs))

    return hook


def _to_local(mod, args, out):
    from torch.distributed.tensor import DTensor

    return pytree.tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, out)


def _parent(model, fqn):
    parent, _, _ = fqn.rpartition(".")
    return model.get_submodule(parent)


def _initialise(model: nn.Module) -> None:
    """A model built on meta is initialised by its own code: ``init_weights()`` (TorchTitan) or
    every module's ``reset_parameters()``."""
    with torch.no_grad():
        if hasattr(model, "init_weights"):
            model.init_weights()
            return
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _sync_replicated(model: nn.Module) -> None:
    """After initialising on every rank, what is replicated over a mesh dim takes the values of
    that dim's first rank (as DDP broadcasts rank 0's parameters). DTensor's random ops agree
    replicas already (its RNG tracker; seen with ranks seeded apart); this also covers an
    initialiser that writes the local tensors some other way."""
    from torch.distributed.tensor import DTensor, Replicate

    with torch.no_grad():
        for p in model.parameters():
            if not isinstance(p, DTensor):
                continue
            for dim, place in enumerate(p.placements):
                if isinstance(place, Replicate) and p.device_mesh.size(dim) > 1:
                    group = p.device_mesh.get_group(dim)
                    dist.broadcast(p._local_tensor, src=dist.get_global_rank(group, 0),
                                   group=group)


def _average_grads(params, group, n) -> None:
    def hook(p):
        g = p.grad
        local = g._local_tensor if hasattr(g, "_local_tensor") else g
        dist.all_reduce(local, group=group)
        local.div_(n)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
