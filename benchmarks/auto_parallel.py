"""auto_parallelize against the hand-written plans, predicted and compiled.

For TorchTitan's llama3 debug model and a ~1B Llama (Llama-3.2-1B's shapes with an untied head,
1.5B parameters, as an HF
LlamaForCausalLM built on "meta": analysed and compiled, never run), on meshes of 4 and 8
devices: the auto plan (searched for TPU v6e, verified by compiling its top 3 for the mesh's
virtual XLA:CPU devices), TorchTitan's FSDP+TP (tp=2, every TP unit, with SP and loss
parallelism where the model admits them, as TorchTitan's defaults), pure FSDP and DDP. Per
plan: predicted per-device memory and collective bytes, predicted step time on v5e and v6e, XLA's compiled per-device memory and collective bytes (all four plans
compiled as SPMD programs), the compiled collectives the cost model did not predict; per model
and mesh: Kendall's tau between predicted and compiled step time over the plans, solver and
verification wall time. Then a budget of 0.9 x pure FSDP's compiled memory: the auto plan must
fit it by XLA's count (the 1B model computes its own loss, ``labels=``: sequence parallelism
entered at the first decoder layer and loss parallelism are in the search; the verification
compiles each plan as applied, its sequence-parallel, loss-parallel and regather layouts in the
program, and searches again while the compiled plans exceed the budget); its compiled memory is
printed next to pure FSDP's.
Measured step times (models in --measure, default the debug model): every plan's train step,
compiled as one SPMD program with XLA's full optimisation, run on the mesh's virtual XLA:CPU
devices in one subprocess (median of --reps runs after a warm-up, each ended by
``block_until_ready``: the JAX equivalent of ``torch.tpu.synchronize()``), printed with the
ratio to the auto plan's and the cost model's prediction for this host (``device_spec="cpu"``,
Kendall's tau against the measured times). Virtual devices share this host's cores, so these
are sanity figures, not TPU times; the 1B model's step (15 GB per device) is not run.

    python benchmarks/auto_parallel.py [--models debug,1b] [--meshes 4,8] [--measure debug]
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def kendall_tau(a, b) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x = (a[i] - a[j]) * (b[i] - b[j])
            s += (x > 0) - (x < 0)
    pairs = n * (n - 1) // 2
    return s / pairs if pairs else float("nan")


def titan_debug():
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        m = model_registry("debugmodel").model.build()
    b, s = 8, 512
    x = torch.randint(0, 2048, (b, s))
    pos = torch.arange(s).repeat(b, 1)
    mask = create_block_mask(lambda b_, h, q, k: q >= k, None, None, s, s, device="cpu")
    # its loss is computed outside the model, as TorchTitan's loss_fn does: given to the search
    # (loss parallelism for it: the module returns vocab-sharded logits, plan.loss(loss_fn))
    labels = torch.randint(0, 2048, (b, s))
    return ("llama3 debug (TorchTitan)", m, (x,), {"positions": pos, "attention_masks": mask},
            {"loss_fn": token_loss, "loss_args": (labels,)})


def token_loss(pred, labels):
    """TorchTitan's loss_fn (mean reduction): every token's cross-entropy."""
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def llama_1b():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    x = torch.randint(0, 128256, (8, 1024))
    # trained as HF models are: the model computes its own loss (labels=), which is what loss
    # parallelism can shard
    return "Llama-3.2-1B shapes, untied head (HF, 1.5B)", m, (), {"input_ids": x, "labels": x}, {}


def titan_plan(model, n, a, common):
    """TorchTitan's llama3 plan: FSDP x TP=2 over every unit, with sequence parallelism and
    loss parallelism (its defaults) where the model admits them."""
    from torchtpu.distributed.auto_parallel import plan_for

    for sp, lp in ((True, True), (True, False), (False, True), (False, False)):
        try:
            return plan_for(model, n, a, dp=n // 2, tp=2, sequence_parallel=sp,
                            loss_parallel=lp, **common)
        except ValueError:
            continue


def _spent(plan) -> str:
    sp = [r.get("spent", {}) for r in plan.search.get("verify_rounds", [])]
    return "; ".join(f"{x.get('traces', 0)} traces {x.get('trace_s', 0):.1f} s, exports "
                     f"{x.get('export_s', 0):.1f} s, XLA {x.get('xla_s', 0):.1f} s" for x in sp)


def mib(b):
    return f"{b / 2**20:9.1f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="debug,1b")
    ap.add_argument("--meshes", default="4,8")
    ap.add_argument("--measure", default="debug", help="models whose steps are run and timed")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from torchtpu.distributed.auto_parallel import (auto_parallelize, plan_for, predict)
    from torchtpu.distributed.auto_parallel.devices import device_spec
    from torchtpu.distributed.auto_parallel.verify import compile_plans, judge

    print(f"load average: {os.getloadavg()}")
    builders = {"debug": titan_debug, "1b": llama_1b}
    for key in args.models.split(","):
        name, model, a, kw, lkw = builders[key]()
        nparams = sum(p.numel() for p in model.parameters())
        print(f"\n=== {name}: {nparams / 1e6:.1f}M parameters, batch "
              f"{next(iter([*a, *kw.values()])).shape} ===")
        for n in [int(x) for x in args.meshes.split(",")]:
            t0 = time.perf_counter()
            auto = auto_parallelize(model, n, a, example_kwargs=kw, device_spec="v6e", top_k=3,
                                    **lkw)
            wall = time.perf_counter() - t0
            common = dict(example_kwargs=kw, device_spec="v6e", **lkw)
            plans = {"auto": auto,
                     "titan fsdp+tp": titan_plan(model, n, a, common),
                     "fsdp": plan_for(model, n, a, dp=n, tp=1, tp_units=None, **common),
                     "ddp": plan_for(model, n, a, dp=n, tp=1, tp_units=None,
                                     data_parallel="replicate", **common)}
            t1 = time.perf_counter()
            hand = list(plans.values())[1:]
            spec = device_spec("v6e")
            res = compile_plans(model, a, kw, hand, 2, next(iter([*a, *kw.values()])).shape[0],
                                **lkw)
            fp32 = any(p.dtype == torch.float32 for p in model.parameters())
            spf = (spec.fp32_slowdown if fp32 else 1.0) / (spec.peak_flops * spec.efficiency)
            for p, r in zip(hand, res):
                p.compiled = judge(p, r, spec, spf)
            t_hand = time.perf_counter() - t1
            search_s = auto.search["analyse_s"] + auto.search["solve_s"]
            print(f"\n-- mesh of {n} devices: auto search {search_s:.2f} s "
                  f"(analyse {auto.search['analyse_s']:.2f}, ILP {auto.search['solve_s']:.2f}, "
                  f"{auto.search['candidates']} candidates), verification of the top 3 "
                  f"{auto.search['verify_s']:.2f} s ({_spent(auto)}), auto_parallelize "
                  f"total {wall:.2f} s; "
                  f"compiling the 3 hand-written plans {t_hand:.2f} s")
            print(f"   auto plan: dp={auto.dp} x tp={auto.tp}, TP units "
                  f"{[u for u, d in auto.units.items() if d['choice'] != 'none']}, dp "
                  f"{sorted({d['dp'] for d in auto.groups.values()})}, sequence parallel "
                  f"{auto.sequence_parallel}, loss parallel {auto.loss_parallel}; search: "
                  f"SP {auto.search['sequence_parallel']}, LP {auto.search['loss_parallel']}")
            print(f"   {'plan':<15}{'mesh':>8}{'pred MiB':>10}{'XLA MiB':>10}"
                  f"{'pred coll MiB':>14}{'XLA coll MiB':>13}{'v5e ms':>9}{'v6e ms':>9}"
                  f"{'XLA v6e ms':>11}  unpredicted")
            pred_t, comp_t = [], []
            for label, p in plans.items():
                v5e = predict(model, p, a, device_spec="v5e", example_kwargs=kw, **lkw)
                c = p.compiled
                pr = p.predicted
                pred_t.append(pr["step_time_s"])
                comp_t.append(c["step_time_s"])
                print(f"   {label:<15}{f'{p.dp}x{p.tp}':>8}{mib(pr['memory_bytes']):>10}"
                      f"{mib(c['memory_bytes']):>10}"
                      f"{mib(pr['dp_bytes'] + pr['tp_bytes']):>14}"
                      f"{mib(c['collective_bytes']):>13}{v5e['step_time_s'] * 1e3:9.2f}"
                      f"{pr['step_time_s'] * 1e3:9.2f}{c['step_time_s'] * 1e3:11.2f}  "
                      f"{','.join(c['unpredicted']) or '-'}")
            ranking = auto.search.get("ranking", [])
            tau_c = kendall_tau([r["predicted"] for r in ranking], [r["compiled"] for r in ranking])
            print(f"   Kendall's tau, predicted vs compiled step time: over the 4 plans "
                  f"{kendall_tau(pred_t, comp_t):+.2f}; over auto's top {len(ranking)} "
                  f"{tau_c:+.2f}")
            titan = plans["titan fsdp+tp"].predicted
            print(f"   auto vs TorchTitan's plan (predicted, v6e): step "
                  f"{auto.predicted['step_time_s'] / titan['step_time_s']:.2f}x, memory "
                  f"{auto.predicted['memory_bytes'] / titan['memory_bytes']:.2f}x")
            same = auto_parallelize(model, n, a, example_kwargs=kw, device_spec="v6e",
                                    memory_budget=titan["memory_bytes"], verify=False, **lkw)
            print(f"   auto under TorchTitan's memory as budget: dp={same.dp} x tp={same.tp}, "
                  f"step {same.predicted['step_time_s'] / titan['step_time_s']:.2f}x, memory "
                  f"{same.predicted['memory_bytes'] / titan['memory_bytes']:.2f}x TorchTitan's")
            if key in args.measure.split(","):
                measure(model, a, kw, plans, args.reps, lkw)
            # a budget that pure FSDP exceeds by XLA's count: the search must return a plan
            # that fits it by compilation (verified; re-searched while the compiled plans
            # exceed it), compiled as applied (its SP / loss-parallel / regather layouts in
            # the program)
            fs = plans["fsdp"].compiled
            budget = 0.9 * fs["memory_bytes"]
            t2 = time.perf_counter()
            try:
                tight = auto_parallelize(model, n, a, example_kwargs=kw, device_spec="v6e",
                                         memory_budget=budget, top_k=3, **lkw)
                c = tight.compiled
                how = ", ".join(c["lowered"]) or "no activation layouts"
                rounds = tight.search["verify_rounds"]
                print(f"   budget 0.9 x FSDP's compiled memory ({mib(budget).strip()} MiB): "
                      f"dp={tight.dp} x tp={tight.tp}, TP units "
                      f"{[u for u, d in tight.units.items() if d['choice'] != 'none']}, "
                      f"sequence parallel {tight.sequence_parallel}, loss parallel "
                      f"{tight.loss_parallel}, block inputs saved sharded {tight.sp_regather}; "
                      f"predicted {mib(tight.predicted['memory_bytes']).strip()} MiB, compiled "
                      f"as applied ({how}) {mib(c['memory_bytes']).strip()} MiB vs pure FSDP's "
                      f"{mib(fs['memory_bytes']).strip()} MiB "
                      f"({c['memory_bytes'] / fs['memory_bytes']:.2f}x), "
                      f"{'FITS' if c['memory_bytes'] <= budget else 'OVER'}; collectives "
                      f"{mib(c['collective_bytes']).strip()} MiB {c['collectives']}"
                      f"{'; UNPREDICTED: ' + ','.join(c['unpredicted']) if c['unpredicted'] else ''}"
                      f" ({time.perf_counter() - t2:.2f} s: {len(rounds)} verification "
                      f"round(s), {sum(r['plans'] for r in rounds)} plans compiled)")
            except ValueError as e:
                print(f"   budget 0.9 x FSDP's compiled memory: {e}")
            print("   predicted vs compiled memory (compiled / predicted): " + ", ".join(
                f"{label} {p.compiled['memory_bytes'] / p.predicted['memory_bytes']:.2f}"
                for label, p in plans.items()))


def measure(model, a, kw, plans, reps, lkw):
    from torchtpu.distributed.auto_parallel import predict
    from torchtpu.distributed.auto_parallel.verify import compile_plans

    batch = next(iter([*a, *kw.values()])).shape[0]
    t0 = time.perf_counter()
    res = compile_plans(model, a, kw, list(plans.values()), 2, batch, measure=reps, **lkw)
    print(f"   measured on {plans['auto'].world_size} virtual XLA:CPU devices (median of {reps}, "
          f"compile + run {time.perf_counter() - t0:.1f} s, load {os.getloadavg()[0]:.1f}):")
    auto_t = res[0]["measured_step_s"]
    pred, meas = [], []
    for (label, p), r in zip(plans.items(), res):
        cpu = predict(model, p, a, device_spec="cpu", example_kwargs=kw, **lkw)["step_time_s"]
        pred.append(cpu)
        meas.append(r["measured_step_s"])
        print(f"   {label:<15}{f'{p.dp}x{p.tp}':>8}  measured {r['measured_step_s'] * 1e3:9.1f} ms"
              f"  ({r['measured_step_s'] / auto_t:5.2f}x auto's)   predicted for this host "
              f"{cpu * 1e3:9.1f} ms")
    print(f"   Kendall's tau, predicted (cpu) vs measured step time over the "
          f"{len(plans)} plans: {kendall_tau(pred, meas):+.2f}")


if __name__ == "__main__":
    main()
