"""torchtpu.distributed.auto_parallelize: plans for an MLP, a hand-written transformer, a tiny
HF Llama and TorchTitan's llama3 debug model; memory budgets (tight ones force sharding, an
impossible one is a clear error); verification by compiling with XLA for virtual devices;
save / load; plans applied and trained on tpu_dist against one CPU process
(dist_scripts/auto_parallel_check.py)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import dist_launch as dl
import torchtpu.distributed as td
from auto_parallel_models import (MLP, VOCAB, FusedTransformer, MixingTransformer, Transformer,
                                  beyond_buffers, tiny_llama)
from torchtpu.distributed.auto_parallel import Plan, plan_for


def tokens(b=4, s=8):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))


def replicated_memory(model, n, x, **kw):
    return plan_for(model, n, (x,), dp=n, tp=1, tp_units=None, data_parallel="replicate",
                    device_spec="cpu", **kw).predicted["memory_bytes"]


def test_exported_from_torchtpu_distributed():
    assert td.auto_parallelize is __import__(
        "torchtpu.distributed.auto_parallel", fromlist=["x"]).auto_parallelize
    assert td.Plan is Plan


def test_mlp_groups_blocks_and_factorisations():
    torch.manual_seed(0)
    m = MLP(depth=3)
    plan = td.auto_parallelize(m, 4, torch.randn(8, 32), device_spec="v6e", verify=False)
    # repeated layers share one decision: one group per position in the block
    assert set(plan.groups) == {"blocks.*.0.weight", "blocks.*.0.bias", "blocks.*.2.weight",
                                "blocks.*.2.bias", "head.weight", "head.bias"}
    # each Sequential(Linear, GELU, Linear) is a TP block (colwise in, rowwise out)
    assert plan.units["blocks.*"]["kind"] == "block"
    assert plan.units["blocks.*"]["ins"] == ["0"] and plan.units["blocks.*"]["out"] == "2"
    assert plan.search["factorisations"] == [[4, 1], [2, 2], [1, 4]]
    assert plan.dp * plan.tp == 4
    assert "blocks.*.0.weight" in str(plan)


def test_tight_budget_forces_tensor_parallel():
    torch.manual_seed(0)
    m, x = Transformer(), tokens()
    none = plan_for(m, 2, (x,), dp=1, tp=2, tp_units=None, device_spec="cpu")
    every = plan_for(m, 2, (x,), dp=1, tp=2, device_spec="cpu")
    assert every.predicted["memory_bytes"] < 0.7 * none.predicted["memory_bytes"]
    budget = 1.01 * every.predicted["memory_bytes"]
    plan = td.auto_parallelize(m, 2, (x,), memory_budget=budget, device_spec="cpu",
                               mesh_shapes=[(1, 2)], verify=False)
    assert plan.predicted["memory_bytes"] <= budget
    assert plan.units["layers.*.attention"]["choice"] == "tp"
    assert plan.groups["layers.*.attention.wq.weight"]["tp"] == "Shard(0)"
    assert plan.groups["layers.*.attention.wo.weight"]["tp"] == "Shard(1)"
    assert plan.groups["layers.*.feed_forward.w2.weight"]["tp"] == "Shard(1)"
    # without a budget, the tiny model's fastest plan on this host shards as little as it
    # may (collective latency outweighs its compute) and does not fit: the budget forced TP
    free = td.auto_parallelize(m, 2, (x,), device_spec="cpu", mesh_shapes=[(1, 2)],
                               verify=False)
    assert free.predicted["memory_bytes"] > budget
    assert sum(u["choice"] != "none" for u in free.units.values()) < \
        sum(u["choice"] != "none" for u in plan.units.values())


def test_budget_forces_fsdp_and_infeasible_budget_is_clear():
    torch.manual_seed(0)
    m, x = Transformer(), tokens()
    # FSDP2 keeps one instance of each group unsharded (parameters and gradients): on 2
    # devices a 2-layer model's FSDP plan needs 0.82 x the replicated plan's memory
    budget = 0.9 * replicated_memory(m, 2, x)
    plan = td.auto_parallelize(m, 2, (x,), memory_budget=budget, device_spec="cpu",
                               mesh_shapes=[(2, 1)], verify=False)
    assert any(g["dp"] == "fsdp" for g in plan.groups.values())
    assert plan.predicted["memory_bytes"] <= budget
    with pytest.raises(ValueError, match=r"no plan fits memory_budget=0\.000 MiB \(100 bytes\)"
                                         r".*smallest plan \(dp=\d x tp=\d\) needs"):
        td.auto_parallelize(m, 2, (x,), memory_budget=100, device_spec="cpu", verify=False)


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(0)
    m, x = Transformer(), tokens()
    plan = td.auto_parallelize(m, 4, (x,), memory_budget=0.7 * replicated_memory(m, 4, x),
                               device_spec="v5e", verify=False)
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back.to_dict() == plan.to_dict()
    assert back.decisions() == plan.decisions()
    assert str(back) == str(plan)
    tt = plan_for(m, 4, (x,), dp=2, tp=2, device_spec="v5e").to_torchtitan()
    assert tt["parallelism"]["tensor_parallel_degree"] == 2
    assert tt["parallelism"]["data_parallel_shard_degree"] == 2 and tt["exact"]


def test_hf_llama_blocks_and_head_divisibility():
    torch.manual_seed(0)
    m = tiny_llama()
    x = tokens()
    kw = {"input_ids": x, "labels": x}
    mlp_only = plan_for(m, 4, (), dp=1, tp=4, tp_units=["model.layers.*.mlp"],
                        device_spec="v6e", example_kwargs=kw)
    plan = td.auto_parallelize(m, 4, (), example_kwargs=kw, device_spec="v6e",
                               mesh_shapes=[(1, 4)], verify=False,
                               memory_budget=1.01 * mlp_only.predicted["memory_bytes"])
    units = plan.units
    assert units["model.layers.*.self_attn"]["ins"] == ["q_proj", "k_proj", "v_proj"]
    assert units["model.layers.*.self_attn"]["out"] == "o_proj"
    assert units["model.layers.*.mlp"]["ins"] == ["gate_proj", "up_proj"]
    # 2 key/value heads cannot be split 4 ways: attention stays replicated at tp=4
    assert units["model.layers.*.self_attn"]["choice"] == "none"
    assert units["model.layers.*.mlp"]["choice"] == "tp"


def test_verification_compiles_candidates_and_reranks():
    """The top 3 plans compiled by XLA for 4 virtual devices (a subprocess): per-device
    memory, FLOPs and collectives read back, the plans re-ranked by them."""
    torch.manual_seed(0)
    m, x = Transformer(), tokens()
    plan = td.auto_parallelize(m, 4, (x,), memory_budget=0.7 * replicated_memory(m, 4, x),
                               device_spec="cpu", top_k=3)
    c = plan.compiled
    assert c["devices"] == 4 and c["memory_bytes"] > 0 and c["flops"] > 0
    assert 0.4 < c["memory_bytes"] / plan.predicted["memory_bytes"] < 2.5
    assert len(plan.search["ranking"]) == 3 and plan.search["verify_s"] > 0
    assert "compiled by XLA (4 devices)" in str(plan)


def test_verification_traces_the_loss_fn():
    """With ``loss_fn`` the compiled train step is the user's loss on the outputs (its targets
    one more input, sharded over dp like the batch), not the sum of the outputs."""
    from torchtpu.distributed.auto_parallel.analysis import namer
    from torchtpu.distributed.auto_parallel.verify import candidate_specs, trace_step

    torch.manual_seed(0)
    m, x = Transformer(), tokens()
    y = tokens()
    gm0, names, n0 = trace_step(m, (x,), {}, 2)
    gm1, _, n1 = trace_step(m, (x,), {}, 2, _token_loss, (y,))
    assert n1 == n0 + 1
    ops0 = {str(n.target) for n in gm0.graph.nodes if n.op == "call_function"}
    ops1 = {str(n.target) for n in gm1.graph.nodes if n.op == "call_function"}
    assert not any("nll_loss" in o for o in ops0)
    assert any("nll_loss_forward" in o for o in ops1), sorted(ops1)
    fsdp = plan_for(m, 4, (x,), dp=4, tp=1, tp_units=None, device_spec="cpu",
                    loss_fn=_token_loss, loss_args=(y,))
    shapes = [n.meta["val"] for n in gm1.graph.nodes if n.op == "placeholder"]
    specs = candidate_specs(fsdp, names, shapes, 2, len(list(m.buffers())), 4, n1, namer(m))
    assert specs["in_specs"][n1 - 1] == ["dp", None]  # the labels: split like the batch


def test_verification_compiles_sequence_and_loss_parallel_as_applied():
    """SP, loss parallelism and ``sp_regather`` are in the compiled program as ``apply`` runs
    them (``layouts.py``), not compiled as the plain TP plan: the traced step carries their
    layouts (stream sharded on the sequence between the blocks, each block's input gathered,
    the logits sharded on the vocabulary, each block's input gathered again in backward after
    its gradient arrives), and XLA's collectives change accordingly: SP gathers the blocks'
    inputs (TP only all-reduces), ``sp_regather`` one more all-gather per block call; the
    predicted memory is near XLA's."""
    from torchtpu.distributed.auto_parallel.devices import device_spec
    from torchtpu.distributed.auto_parallel.verify import compile_plans, judge, trace_step

    torch.manual_seed(0)
    m, x, y = Transformer(), tokens(1, 512), tokens(1, 512)
    kw = dict(dp=1, tp=2, device_spec="cpu", loss_fn=_token_loss, loss_args=(y,))
    tp = plan_for(m, 2, (x,), **kw)
    sp = plan_for(m, 2, (x,), sequence_parallel=True, **kw)
    sg = plan_for(m, 2, (x,), sequence_parallel=True, loss_parallel=True, sp_regather=True,
                  **kw)
    gm, _, _ = trace_step(m, (x,), {}, 2, _token_loss, (y,), plan=sg)
    marks = [(str(n.target), n.args[2] if "tied" in str(n.target) else n.args[1])
             for n in gm.graph.nodes if "tpu_autopar" in str(n.target)]
    seq, whole, vocab = "1x2:_,tp,_", "1x2:_,_,_", "1x2:_,_,tp"
    blocks = 2 * len(m.layers)
    fwd = [f for o, f in marks if o.endswith("layout.default")]
    assert fwd.count(f"{seq};{whole}") == 1  # the head's input (the blocks': two steps each)
    assert fwd.count(whole) == blocks and fwd.count(vocab) == 2  # logits and their gradient
    assert [f for o, f in marks if "tied" in o] == [whole] * blocks
    plain, _, _ = trace_step(m, (x,), {}, 2, _token_loss, (y,), plan=tp)
    assert not any("tpu_autopar" in str(n.target) for n in plain.graph.nodes)
    rtp, rsp, rsg = compile_plans(m, (x,), {}, [tp, sp, sg], 2, 1, loss_fn=_token_loss,
                                  loss_args=(y,))
    assert rtp["lowered"] == [] and rsp["lowered"] == ["sequence parallel"]
    assert rsg["lowered"] == ["sequence parallel", "loss parallel", "block inputs regathered"]
    assert set(rtp["collectives"]) == {"all-reduce"}
    assert rsp["collectives"].get("all-gather", 0) >= blocks
    assert rsg["collectives"]["all-gather"] == rsp["collectives"]["all-gather"] + blocks
    sg.compiled = judge(sg, rsg, device_spec("cpu"), 1e-12)
    assert "as applied: sequence parallel, loss parallel, block inputs regathered" in str(sg)
    # the cost model's memory tracks XLA's: the dense attention's score tiles (the largest
    # buffers of this model's step at 512 tokens; XLA keeps 3 to 6 of them alive) are counted
    # (without them XLA's memory was 4 to 7 times the prediction)
    for p, r in ((tp, rtp), (sp, rsp), (sg, rsg)):
        assert 0.7 < r["memory_bytes"] / p.predicted["memory_bytes"] < 1.45, \
            (p.predicted["memory_bytes"], r["memory_bytes"])


def test_attention_tiles_counted_per_call_as_compiled():
    """XLA keeps the dense attention's score tiles from each call's forward to its backward
    (the one-program train step merges the backward's recomputed scores with the forward's):
    one per call with a local batch and heads above 1 (dp=2 x tp=2), two where the local batch
    is 1 (dp=4), plus one while a backward runs. The prediction follows XLA's memory at 1 and 4
    layers (counting 4 tiles of one call, as before 2026-12-07 09:10, it was 0.49-0.70 of
    XLA's at one layer and 1.13-1.88 at four)."""
    from torchtpu.distributed.auto_parallel.verify import compile_plans

    torch.manual_seed(0)
    x, y = tokens(4, 512), tokens(4, 512)
    for layers in (1, 4):
        m = Transformer(layers=layers)
        kw = dict(device_spec="cpu", loss_fn=_token_loss, loss_args=(y,))
        plans = [plan_for(m, 4, (x,), dp=4, tp=1, tp_units=None, **kw),
                 plan_for(m, 4, (x,), dp=2, tp=2, **kw)]
        res = compile_plans(m, (x,), {}, plans, 2, 4, loss_fn=_token_loss, loss_args=(y,))
        for p, r in zip(plans, res):
            ratio = r["memory_bytes"] / p.predicted["memory_bytes"]
            assert 0.8 < ratio < 1.1, (layers, p.dp, p.tp, ratio)


def test_budget_holds_for_compiled_memory(monkeypatch):
    """The memory budget is a constraint on XLA's compiled memory: with a cost model that
    under-estimates it (here: the attention's score tiles left out, as before they were
    counted), the plans the prediction fits but XLA does not are replaced by the next ones,
    searched again with the corrected estimate, until one fits by compilation; when none
    does, the error names the smallest compiled plan."""
    from torchtpu.distributed.auto_parallel import cost
    from torchtpu.distributed.auto_parallel.verify import compile_plans

    for k in ("DENSE_TILES_KEPT", "DENSE_TILES_KEPT_UNIT_DIM", "DENSE_TILES_TRANSIENT"):
        monkeypatch.setattr(cost, k, 0)
    torch.manual_seed(0)
    m, x, y = Transformer(), tokens(4, 512), tokens(4, 512)
    kw = dict(device_spec="cpu", loss_fn=_token_loss, loss_args=(y,), mesh_shapes=[(2, 2)])
    plain = plan_for(m, 4, (x,), dp=2, tp=2, device_spec="cpu", loss_fn=_token_loss,
                     loss_args=(y,))
    small = plan_for(m, 4, (x,), dp=2, tp=2, sequence_parallel=True, loss_parallel=True,
                     sp_regather=True, device_spec="cpu", loss_fn=_token_loss, loss_args=(y,))
    rplain, rsmall = compile_plans(m, (x,), {}, [plain, small], 2, 4, loss_fn=_token_loss,
                                   loss_args=(y,))
    # the prediction: a few MiB; XLA: several times that (its 4 MiB score tiles); a budget
    # that the plain TP plan (the fastest) exceeds by XLA's count and the smallest meets
    assert rplain["memory_bytes"] > 2 * plain.predicted["memory_bytes"]
    assert rsmall["memory_bytes"] < rplain["memory_bytes"]
    budget = (rplain["memory_bytes"] + rsmall["memory_bytes"]) / 2
    plan = td.auto_parallelize(m, 4, (x,), memory_budget=budget, top_k=1, **kw)
    rounds = plan.search["verify_rounds"]
    assert plan.compiled["memory_bytes"] <= budget and len(rounds) >= 2
    assert "rounds of verification" in str(plan)
    compiled = plan.search["ranking"]
    assert len(compiled) == len(rounds) and all(r["plans"] == 1 for r in rounds)
    assert all(c["compiled_memory"] > budget for c in compiled[:-1])
    assert all(c["predicted_memory"] <= budget for c in compiled)
    # a budget every plan meets by the prediction and none by compilation: a clear error
    tight = 1.2 * small.predicted["memory_bytes"]
    with pytest.raises(ValueError, match=r"no plan fits memory_budget=.* by XLA's compiled "
                                         r"memory .*the smallest compiled plan \(dp=2 x tp=2"
                                         r".*\) needs .* \(predicted"):
        td.auto_parallelize(m, 4, (x,), memory_budget=tight, top_k=3, **kw)


@pytest.mark.slow  # ~30 s: one more compile subprocess
def test_compiled_collectives_of_hand_written_plans():
    """A TP plan's compiled all-reduces are exactly the predicted ones; FSDP's per-device
    arguments are a fraction of DDP's."""
    from torchtpu.distributed.auto_parallel.verify import compile_plans

    torch.manual_seed(0)
    m, x = Transformer(), tokens()

    tp = plan_for(m, 4, (x,), dp=1, tp=4, device_spec="cpu",
                  tp_units=["layers.*.attention", "layers.*.feed_forward"])
    fsdp = plan_for(m, 4, (x,), dp=4, tp=1, tp_units=None, device_spec="cpu")
    ddp = plan_for(m, 4, (x,), dp=4, tp=1, tp_units=None, data_parallel="replicate",
                   device_spec="cpu")
    rtp, rfsdp, rddp = compile_plans(m, (x,), {}, [tp, fsdp, ddp], 2, 4)
    # two blocks per layer, an all-reduce of each block's output in forward and of its input
    # gradient in backward: 2 layers x 2 blocks x 2
    assert rtp["collectives"] == {"all-reduce": 8}, rtp["collectives"]
    # FSDP's parameters, gradients and optimizer state are a quarter of DDP's per device
    assert rfsdp["argument_bytes"] < 0.5 * rddp["argument_bytes"]
    assert "all-gather" in rfsdp["collectives"] or "reduce-scatter" in rfsdp["collectives"]


@pytest.mark.slow  # ~40 s: three compile subprocesses
def test_verification_of_deep_models_extrapolates_from_two_layers():
    """A 6-layer stack is compiled with 1 and 2 layers and XLA's figures extrapolated: they
    match compiling all 6 (parameters, FLOPs and collective bytes exactly; memory within 2%),
    also for an SP + ``sp_regather`` plan compiled with its layouts."""
    from torchtpu.distributed.auto_parallel.verify import compile_plans

    torch.manual_seed(0)
    m, x = Transformer(layers=6), tokens()
    plans = [plan_for(m, 4, (x,), dp=1, tp=4, device_spec="cpu",
                      tp_units=["layers.*.attention", "layers.*.feed_forward"]),
             plan_for(m, 4, (x,), dp=2, tp=2, device_spec="cpu"),
             # compiled as applied: its layouts traced into each depth's program
             plan_for(m, 4, (x,), dp=2, tp=2, sequence_parallel=True, sp_regather=True,
                      device_spec="cpu")]
    full = compile_plans(m, (x,), {}, plans, 2, 4, full_depth=True)
    ext = compile_plans(m, (x,), {}, plans, 2, 4)
    for f, e in zip(full, ext):
        assert e["depth"] == "extrapolated from 1 and 2 of 6 layers" and "depth" not in f
        for k in ("argument_bytes", "flops", "collective_bytes"):
            assert e[k] == pytest.approx(f[k], rel=1e-9), k
        assert e["memory_bytes"] == pytest.approx(f["memory_bytes"], rel=0.02)
    assert ext[0]["collectives"] == full[0]["collectives"] == {"all-reduce": 24}


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed")
def test_torchtitan_llama3_debug_plan():
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        m = model_registry("debugmodel").model.build()
    # under 0.9 x pure FSDP's memory (beyond the buffers: rotary tables, 48 MiB) on 2
    # devices (dist_scripts' titan_sp trains this plan):
    # TP with the fused wqkv colwise + SP. (Longer sequences on more devices do not fit: the
    # loss is computed outside the model, so the head's output is the whole logits on every
    # rank, where FSDP holds its batch slice's)
    x = torch.randint(0, 2048, (4, 32))
    pos = torch.arange(32).repeat(4, 1)
    kw = {"positions": pos, "attention_masks": _titan_masks(pos)}
    fsdp = plan_for(m, 2, (x,), dp=2, tp=1, tp_units=None, device_spec="cpu",
                    example_kwargs=kw)
    budget = beyond_buffers(m, fsdp.predicted["memory_bytes"])
    tight = td.auto_parallelize(m, 2, (x,), memory_budget=budget, device_spec="cpu",
                                example_kwargs=kw, verify=False, objective="memory")
    assert tight.predicted["memory_bytes"] <= budget
    # the fused QKV projection (rows grouped per KV head) splits as a colwise/rowwise pair, as
    # in TorchTitan's own plan; its Embedding (own forward, unwrapping DTensors) is never TP
    why = tight.search["not_tp_blocks"]
    assert "layers.*.attention" not in why, why
    assert "overrides nn.Embedding.forward" in why["tok_embeddings"]
    assert tight.search["sequence_parallel"].startswith("possible, entered at layers.0"), \
        tight.search["sequence_parallel"]
    assert tight.sequence_parallel and tight.tp > 1, tight
    assert tight.units["layers.*.attention"]["ins"] == ["qkv_linear.wqkv"]
    assert tight.units["layers.*.attention"]["choice"] == "tp"
    assert tight.units["layers.*.feed_forward"]["ins"] == ["w1", "w3"]
    assert not tight.loss_parallel  # its loss is computed outside the model, unknown here
    assert "tok_embeddings" not in tight.units
    # the loss given to the search (TorchTitan's loss_fn): it is counted (every rank's loss on
    # the dp-gathered logits: pure FSDP needs more), and loss parallelism for it is offered
    # and chosen (dist_scripts' titan_lp trains it)
    lkw = dict(example_kwargs=kw, device_spec="cpu", loss_fn=_token_loss, loss_args=(x,))
    fsdp_l = plan_for(m, 2, (x,), dp=2, tp=1, tp_units=None, **lkw)
    assert fsdp_l.predicted["memory_bytes"] > fsdp.predicted["memory_bytes"]
    lp = td.auto_parallelize(m, 2, (x,),
                             memory_budget=beyond_buffers(m, fsdp_l.predicted["memory_bytes"]),
                             verify=False, objective="memory", **lkw)
    assert lp.sequence_parallel and lp.loss_parallel and lp.loss_outside, lp
    assert lp.search["loss_parallel"] == "possible (the loss_fn's cross-entropy)"
    assert "plan.loss(loss_fn)" in str(lp)
    assert Plan.from_dict(lp.to_dict()).decisions() == lp.decisions()
    # what loss parallelism saves: the log-probabilities of every rank's whole batch (without
    # it, gathered over dp) -> its batch and vocabulary slice
    nolp = plan_for(m, 2, (x,), dp=lp.dp, tp=lp.tp, sequence_parallel=True, **lkw)
    lp_ = plan_for(m, 2, (x,), dp=lp.dp, tp=lp.tp, sequence_parallel=True, loss_parallel=True,
                   **lkw)
    logprobs = 4 * 32 * 2048 * 4  # batch x seq x vocab float32 (+ the NLL's int64 targets)
    assert nolp.predicted["memory_bytes"] - lp_.predicted["memory_bytes"] == pytest.approx(
        (logprobs + 4 * 32 * 8) * (1 - 1 / lp.world_size), abs=8)


def _token_loss(pred, labels):
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def test_fused_qkv_split_checked_numerically():
    """A fused q/k/v projection is a colwise/rowwise pair only where each rank's row block holds
    whole heads: rows grouped per head (TorchTitan's layout) split at tp=2 and 4 (not 8: a rank
    would hold part of a head); a [q; k; v] stack split by ``chunk(3)`` runs with the same
    shapes on a row block but computes other numbers, and is refused at every degree."""
    from torchtpu.distributed.auto_parallel.analysis import analyse

    x = tokens(2, 8)
    good = analyse(FusedTransformer(grouped=True), (x,), {})
    blk = next(b for b in good.blocks if b.fqn == "layers.0.attention")
    assert blk.ins == ["layers.0.attention.wqkv"] and blk.tps == [2, 4]
    plan = plan_for(FusedTransformer(grouped=True), 4, (x,), dp=1, tp=4, device_spec="cpu")
    assert plan.units["layers.*.attention"]["choice"] == "tp"
    bad = analyse(FusedTransformer(grouped=False), (x,), {})
    assert not any(b.fqn.endswith("attention") for b in bad.blocks)
    why = bad.not_blocks["layers.*.attention"]
    assert "tp=2: the ranks' outputs do not sum to the block's" in why, why
    assert "tp=4: the ranks' outputs do not sum to the block's" in why, why


def _titan_masks(pos):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: q >= k, None, None, pos.shape[1], pos.shape[1],
                             device="cpu")


def test_apply_one_process_meta_model_trains():
    """A plan for one device applied to a model built on meta: materialised on "tpu" by its
    own reset_parameters, and an ordinary loop trains it."""
    with torch.device("meta"):
        m = Transformer()
    x = tokens()
    plan = td.auto_parallelize(m, 1, (x,), device_spec="cpu", verify=False)
    m = plan.apply(m)
    assert all(p.device.type == "tpu" for p in m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(m(x.to("tpu")).flatten(0, 1),
                                                 x.flatten().to("tpu"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_plans_train_on_two_processes_like_one():
    """An FSDP plan (budget-forced) and a TP + sequence parallel plan (a budget only SP
    meets): losses, every step's gradients and the final parameters equal one CPU process's;
    the SP plan's applied module under torch.compile(backend="tpu"), equal to the eager
    applied module and to one CPU process."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "fsdp", "sp_compile", timeout=400))


@pytest.mark.slow  # ~3 min, 2 + 4 processes
def test_compiled_and_sequence_parallel_plans_train_like_one():
    """torch.compile(backend="tpu") of FSDP and TP (2 processes) and dp x tp (4 processes)
    applied modules: forward, backward and optimizer step equal to eager and to one CPU
    process; dp x tp with sequence parallelism (4 processes)."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "fsdp_compile", "tp_compile", timeout=400))
    dl.ok(*dl.torchrun("auto_parallel_check.py", "2d_compile", "2d_sp", nproc=4, timeout=600))


def test_sequence_parallel_chosen_where_it_fits_and_refused_where_not():
    """One long sequence (no batch to split over dp) makes activations dominate: under a
    budget that TP alone exceeds, the search chooses TP + sequence parallelism (TorchTitan's
    SP); HF Llama, whose prologue builds its causal mask from the hidden states' shape, gets
    SP entered at its first decoder layer; a model whose code between the blocks mixes tokens
    and one without an embedding are never given SP, and say why."""
    torch.manual_seed(0)
    m, x = Transformer(), tokens(1, 512)
    kw = dict(dp=1, tp=2, device_spec="cpu")
    tp_only = plan_for(m, 2, (x,), **kw)
    with_sp = plan_for(m, 2, (x,), sequence_parallel=True, **kw)
    # the norms' and residuals' activations are halved (of 1 x 512 x 32 floats each); the
    # attention's score tiles (most of the step's memory, by XLA's count too) stay
    assert with_sp.predicted["memory_bytes"] < tp_only.predicted["memory_bytes"] - 2**18
    # it saves memory, not time: each block's output gradient, sequence-sharded, is
    # all-gathered in backward (DTensor's SP and XLA's compiled program both do)
    assert with_sp.predicted["tp_bytes"] > tp_only.predicted["tp_bytes"]
    plan = td.auto_parallelize(m, 2, (x,), memory_budget=1.001 * with_sp.predicted["memory_bytes"],
                               device_spec="cpu", verify=False)
    assert plan.search["factorisations"] == [[1, 2]]  # a batch of 1 cannot be split
    assert plan.sequence_parallel and plan.search["sequence_parallel"] == "possible"
    assert plan.to_torchtitan()["parallelism"]["enable_sequence_parallel"]
    assert plan.sp_modules["norms"] == ["layers.*.attention_norm", "layers.*.ffn_norm", "norm"]
    assert "sequence parallel" in str(plan)
    assert Plan.from_dict(plan.to_dict()).decisions() == plan.decisions()
    hf = td.auto_parallelize(tiny_llama(), 2, (), example_kwargs={"input_ids": tokens()},
                             device_spec="cpu", verify=False)
    assert hf.search["sequence_parallel"] == "possible, entered at model.layers.0"
    assert plan.sp_modules["entry"] is None  # the hand-written one: at the embedding
    # an op that mixes tokens between the blocks (shapes unchanged) is caught too
    with pytest.raises(ValueError, match=r"aten\.cumsum\.default runs on the stream"):
        plan_for(MixingTransformer(), 2, (x,), sequence_parallel=True, **kw)
    with pytest.raises(ValueError, match="does not start with an Embedding"):
        plan_for(MLP(), 2, (torch.randn(8, 4, 32),), dp=1, tp=2, sequence_parallel=True)


def test_block_inputs_saved_sharded_is_a_counted_plan_option():
    """Under SP each block's gathered input is saved whole per tp rank; saving it sharded on
    the sequence and gathering it again in backward (``sp_regather``, Megatron's SP) is an
    option the cost model counts (1 / tp of those bytes kept, one more all-gather per block)
    and the search takes where a budget needs it, and only with SP."""
    torch.manual_seed(0)
    m, x = Transformer(), tokens(1, 512)
    kw = dict(dp=1, tp=2, device_spec="cpu")
    sp = plan_for(m, 2, (x,), sequence_parallel=True, **kw)
    sg = plan_for(m, 2, (x,), sequence_parallel=True, sp_regather=True, **kw)
    assert sg.predicted["memory_bytes"] < sp.predicted["memory_bytes"]
    assert sg.predicted["tp_bytes"] > sp.predicted["tp_bytes"]
    assert sg.predicted["step_time_s"] > sp.predicted["step_time_s"]
    plan = td.auto_parallelize(m, 2, (x,), memory_budget=1.001 * sg.predicted["memory_bytes"],
                               device_spec="cpu", verify=False)
    assert plan.sequence_parallel and plan.sp_regather
    assert plan.predicted["memory_bytes"] == pytest.approx(sg.predicted["memory_bytes"])
    assert "gathered again in backward" in str(plan)
    back = Plan.from_dict(plan.to_dict())
    assert back.sp_regather and back.decisions() == plan.decisions()
    assert not plan.to_torchtitan()["exact"]  # TorchTitan's SP saves the gathered inputs
    roomy = td.auto_parallelize(m, 2, (x,), memory_budget=1.001 * sp.predicted["memory_bytes"],
                                device_spec="cpu", verify=False)
    assert roomy.sequence_parallel and not roomy.sp_regather  # not worth its gathers
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        plan_for(m, 2, (x,), sp_regather=True, **kw)


@pytest.mark.slow  # ~2 min
def test_mixed_hf_and_meta_plans_train_on_two_processes_like_one():
    """Mixed FSDP / replicated groups (AdamW, JSON round trip), HF Llama under TP and FSDP
    (its own loss averaged over dp), a model built on meta."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "mixed", "hf", "hf_fsdp", "meta", timeout=600))


@pytest.mark.slow  # ~1.5 min (2 processes) + ~2.5 min (4 processes)
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed")
def test_torchtitan_debug_model_tp_sp_under_fsdp_budget_trains_like_one():
    """TorchTitan's llama3 debug model, its loss computed outside (as TorchTitan's loss_fn),
    under 0.9 x pure FSDP's memory on 2 processes: the fused wqkv colwise with wo rowwise, the
    MLP, the head colwise, sequence parallelism entered at the first layer; 5 steps with
    losses, every step's gradients and the final parameters equal to one CPU process. On
    dp=2 x tp=2 (4 processes) under a budget pure FSDP exceeds: TP + SP with the blocks'
    inputs saved sharded."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "titan_sp", timeout=600))
    dl.ok(*dl.torchrun("auto_parallel_check.py", "2d_titan_sp", nproc=4, timeout=900))


@pytest.mark.slow  # ~3 min (2 processes) + ~3 min (4 processes)
def test_hf_models_written_elsewhere_train_like_one_under_tight_budgets():
    """HF Qwen2 (biased q/k/v, grouped KV heads) and a ViT image classifier, built from
    configs, each computing its own loss, under a budget pure FSDP exceeds (tp-only on 2
    processes; dp=2 x tp=2 on 4), and GPT-2 (Conv1D layers, head tied to the embedding)
    under pure FSDP's memory (dp-only) and its smallest tp-only plan: 5 steps with losses,
    gradients and final parameters equal to one CPU process."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "ext_qwen2", "ext_gpt2", "ext_gpt2_tp",
                       "ext_vit", timeout=900))
    dl.ok(*dl.torchrun("auto_parallel_check.py", "2d_ext_qwen2", "2d_ext_vit", nproc=4,
                       timeout=900))


@pytest.mark.slow  # ~5 min (2 processes) + ~2.5 min (4 processes)
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed")
def test_torchtitan_debug_model_loss_parallel_for_its_loss_fn_trains_like_one():
    """TorchTitan's llama3 debug model with its loss given to the search (``loss_fn=``):
    TP + SP + loss parallelism for that loss (the module returns the logits sharded on the
    vocabulary, the loop computes ``plan.loss(loss_fn)``), under 0.9 x pure FSDP's memory on 2
    processes (eager; with PyTorch's own ``loss_parallel()`` context instead of ``plan.loss``;
    the applied module under torch.compile(backend="tpu")) and as the
    smallest 2 x 2 plan on 4; 5 steps with losses, every step's gradients and the final
    parameters equal to one CPU process."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "titan_lp", "titan_lp_torch", "titan_lp_compile",
                       timeout=1200))
    dl.ok(*dl.torchrun("auto_parallel_check.py", "2d_titan_lp", nproc=4, timeout=800))


@pytest.mark.slow  # ~3 min idle (~9 min at load 15), 2 processes; + ~2.5 min at load 12, 4
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is not installed")
def test_torchtitan_debug_model_block_inputs_saved_sharded_trains_like_one():
    """TorchTitan's llama3 debug model with its loss_fn on tp=2 and tp=4 under a budget that
    TP + SP + loss parallelism alone exceed: the blocks' inputs saved sharded on the sequence
    and gathered again in backward (``sp_regather``, counted in torch.tpu.metrics()); 5 steps
    with losses, every step's gradients and the final parameters equal to one CPU process."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "titan_sg", timeout=1200))
    dl.ok(*dl.torchrun("auto_parallel_check.py", "titan_sg", nproc=4, timeout=1200))


@pytest.mark.slow  # ~2 min, 4 processes
def test_two_dimensional_plan_trains_on_four_processes_like_one():
    dl.ok(*dl.torchrun("auto_parallel_check.py", "2d", "2d_fsdp", nproc=4, timeout=600))


def test_hf_llama_sequence_and_loss_parallel_fit_under_fsdp_budget():
    """A tiny HF Llama computing its own loss (``labels=``) on 4 devices, under 0.9 x pure
    FSDP's predicted memory: the smallest plan is TP with sequence parallelism entered at the
    first decoder layer (the prologue -- mask, positions, rotary tables -- replicated) and loss
    parallelism (vocab-sharded logits into HF's own cross-entropy); each saves what the cost
    model says. Without ``labels=`` and no ``loss_fn`` (the loss computed outside, unknown to
    the search) loss parallelism is never offered: the outputs stay the global logits."""
    torch.manual_seed(0)
    m = tiny_llama(512)
    x = tokens(4, 32)
    kw = {"input_ids": x, "labels": x}
    fsdp = plan_for(m, 4, (), dp=4, tp=1, tp_units=None, device_spec="cpu", example_kwargs=kw)
    budget = 0.9 * fsdp.predicted["memory_bytes"]
    plan = td.auto_parallelize(m, 4, (), example_kwargs=kw, memory_budget=budget,
                               device_spec="cpu", verify=False, objective="memory")
    assert plan.predicted["memory_bytes"] <= budget and plan.tp > 1
    assert plan.sequence_parallel and plan.loss_parallel and plan.loss_head == "lm_head"
    assert plan.sp_modules["entry"] == ["model.layers.0", 0, 1]
    assert plan.search["loss_parallel"] == "possible"
    assert "loss parallel" in str(plan) and "entered at model.layers.0" in str(plan)
    back = Plan.from_dict(plan.to_dict())
    assert back.decisions() == plan.decisions() and back.loss_head == "lm_head"
    assert not plan.to_torchtitan()["parallelism"]["disable_loss_parallel"]
    mem = {}
    for sp in (False, True):
        for lp in (False, True):
            mem[sp, lp] = plan_for(m, 4, (), dp=plan.dp, tp=plan.tp, sequence_parallel=sp,
                                   loss_parallel=lp, device_spec="cpu",
                                   example_kwargs=kw).predicted["memory_bytes"]
    assert mem[True, True] < mem[True, False] < mem[False, False]
    assert mem[True, True] < mem[False, True] < mem[False, False]
    # the smallest plan also saves the blocks' inputs sharded (gathered again in backward)
    regather = plan_for(m, 4, (), dp=plan.dp, tp=plan.tp, sequence_parallel=True,
                        loss_parallel=True, sp_regather=True, device_spec="cpu",
                        example_kwargs=kw).predicted["memory_bytes"]
    assert plan.sp_regather and regather < mem[True, True]
    assert plan.predicted["memory_bytes"] == pytest.approx(regather)
    assert mem[False, False] > budget  # TP alone does not fit
    no_labels = {"input_ids": x}
    outside = td.auto_parallelize(m, 4, (), example_kwargs=no_labels, device_spec="cpu",
                                  verify=False, mesh_shapes=[(1, 4)])
    assert not outside.loss_parallel
    assert "no cross-entropy on the head's output" in outside.search["loss_parallel"]
    with pytest.raises(ValueError, match="loss parallelism needs"):
        plan_for(m, 4, (), dp=1, tp=4, loss_parallel=True, device_spec="cpu",
                 example_kwargs=no_labels)


@pytest.mark.slow  # ~1.5 min (2 processes) + ~3 min (4 processes)
def test_hf_llama_sequence_and_loss_parallel_train_like_one():
    """The tiny HF Llama under 0.9 x pure FSDP's memory, SP entered at the first decoder
    layer + loss parallelism, 5 steps: losses (1e-5), every step's gradients and the final
    parameters equal one CPU process (tp=2; dp=2 x tp=2)."""
    dl.ok(*dl.torchrun("auto_parallel_check.py", "hf_sp", timeout=500))
    dl.ok(*dl.torchrun("auto_parallel_check.py", "2d_hf_sp", nproc=4, timeout=800))
