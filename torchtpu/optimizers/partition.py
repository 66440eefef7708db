"""The trainer's joint forward/backward graph partitioned like ``torch.compile``'s AOTAutograd
(``min_cut_rematerialization_partition``: cheap forward ops recomputed in the backward rather
than saved), then stitched back into ONE aten graph (forward, then backward seeded with
``ones_like(loss)``) for ``SingleTraceTrainer``'s one program.

``aot_export_module(trace_joint=True)`` gives a joint graph whose placeholders are
``arg{i}_1`` and whose backward is seeded by ``ones_like(loss)``; the partitioner wants
``primals_*`` / ``tangents_*`` placeholders and the forward outputs first. ``joint_partitioned``
renames, partitions, and inlines the forward and backward graphs into one graph with the
original inputs and outputs (same order), so the trainer lowers it exactly as before.
"""
from __future__ import annotations

import torch
from torch import fx

from ..runtime.metrics import count


def joint_partitioned(gm: fx.GraphModule, n_fwd: int, loss: str) -> fx.GraphModule:
    """``gm``'s outputs are ``n_fwd`` forward outputs (buffer updates, the loss: the node named
    ``loss``) then the gradients. Returns an equivalent graph laid out as the min-cut
    partition's forward followed by its backward (the values recomputed in the backward
    computed there)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    g = gm.graph
    phs = [n for n in g.nodes if n.op == "placeholder"]
    outs = list(g.output_node().args[0])
    loss_pos = next((i for i, o in enumerate(outs[:n_fwd])
                     if isinstance(o, fx.Node) and o.name == loss), None)
    seeds = [] if loss_pos is None else [
        n for n in outs[loss_pos].users
        if n.target is torch.ops.aten.ones_like.default]
    if len(seeds) != 1:  # not the one-loss joint graph this expects: lower it as it is
        count("trainer_partitions_skipped")
        return gm
    seed = seeds[0]
    orig_names = [p.name for p in phs]
    joint = fx.GraphModule(gm, _renamed(g, phs, seed))
    fw, bw = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=n_fwd)
    count("trainer_partitions")
    return _stitch(gm, fw, bw, orig_names, n_fwd, loss_pos, seed.meta)


def _renamed(g, phs, seed):
    new = fx.Graph()
    env = {}
    for i, p in enumerate(phs):
        env[p] = new.placeholder(f"primals_{i + 1}")
        env[p].meta = dict(p.meta)
    tangent = new.placeholder("tangents_1")
    tangent.meta = dict(seed.meta)
    for n in g.nodes:
        if n.op == "placeholder":
            continue
        if n is seed:
            env[n] = tangent
            continue
        env[n] = new.node_copy(n, lambda a: env[a])
    return new


def _stitch(gm, fw, bw, orig_names, n_fwd, loss_pos, seed_meta):
    """One graph: ``fw``'s nodes, then ``bw``'s reading ``fw``'s saved outputs, its tangent
    ``ones_like(loss)``; placeholders named as ``gm``'s (whose attributes it holds)."""
    out = fx.Graph()
    env = {}
    fw_phs = [n for n in fw.graph.nodes if n.op == "placeholder"]
    if len(fw_phs) != len(orig_names):
        return gm  # the partition dropped an input: lower the joint graph as it is
    for p, name in zip(fw_phs, orig_names):
        env[p] = out.placeholder(name)
        env[p].meta = dict(p.meta)
    fw_out = None
    for n in fw.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            fw_out = n.args[0]
            continue
        env[n] = out.node_copy(n, lambda a: env[a])
    fwd_vals = [env[a] if isinstance(a, fx.Node) else a for a in fw_out[:n_fwd]]
    saved = {a.name: env[a] for a in fw_out[n_fwd:]}
    transposed = [env[a] for a in fw_out[n_fwd:] if _transposed_activation(a)]
    loss = fwd_vals[loss_pos]
    benv = {}
    for n in bw.graph.nodes:
        if n.op == "placeholder":
            if n.name.startswith("tangents"):
                v = out.call_function(torch.ops.aten.ones_like.default, (loss,),
                                      {"pin_memory": False,
                                       "memory_format": torch.preserve_format})
                v.meta = dict(seed_meta)
                benv[n] = v
            else:
                benv[n] = saved[n.name]
            continue
        if n.op == "output":
            bw_out = n.args[0]
            continue
        benv[n] = out.node_copy(n, lambda a: benv[a])
    grads = [benv[a] if isinstance(a, fx.Node) else a for a in bw_out]
    out.output(tuple(fwd_vals + grads))
    res = fx.GraphModule(gm, out)
    res.meta[SAVED_TRANSPOSES] = transposed
    res.meta[SAVED_VALUES] = [v for v in saved.values() if not _of_input(v)]
    return res


# ``GraphModule.meta`` key: the saved values (forward results the backward reads) that are
# transposes of activations (see _transposed_activation)
SAVED_TRANSPOSES = "torchtpu_saved_transposes"
# ``GraphModule.meta`` key: the saved values computed by the forward (not an input or a view
# of one)
SAVED_VALUES = "torchtpu_saved_values"
_TRANSPOSES = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default)
_VIEWS = _TRANSPOSES + (torch.ops.aten.t.default, torch.ops.aten.view.default,
                        torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
                        torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
                        torch.ops.aten.expand.default, torch.ops.aten.alias.default)


def _of_input(n) -> bool:
    """``n`` is a graph input or a view (a chain of view ops) of one: returning it from the
    program would copy an input (a weight's transpose) rather than keep a computed value."""
    while (n.op == "call_function" and n.target in _VIEWS and n.args
           and isinstance(n.args[0], fx.Node)):
        n = n.args[0]
    return n.op == "placeholder"


def _transposed_activation(n) -> bool:
    """A saved value that is a transpose of a computed value (not of an input). torch.compile's
    forward program returns it materialized in its own (transposed) shape, so the backward's
    batched matmuls read it row-major (XLA:CPU gives such dots to YNNPACK); in one program XLA
    folds the transpose into the dot instead (a transposed-operand Eigen dot, slower)."""
    return (isinstance(n, fx.Node) and n.op == "call_function" and n.target in _TRANSPOSES
            and isinstance(n.args[0], fx.Node) and n.args[0].op != "placeholder")

