"""Changing shapes: greedy generate() with a growing KV cache, and variable-length training.

    python benchmarks/shape_changes.py [--repeats N] [--ablation] [--only generate|train]

Side by side in one run, each "tpu" case in fresh processes sharing one new compile cache
folder (TORCHTPU_CACHE_DIR), PyTorch CPU in its own process:
- generate, dynamic cache: tiny random-weight Llama (2 layers, hidden 64) from a transformers
  config, greedy ``generate(max_new_tokens=32)`` on an 8-token prompt: the first call of a fresh
  process with an empty cache folder (cold), then of a second process on the same folder (warm);
- generate, static cache (``cache_implementation="static"``: transformers compiles the decode
  step with backend "tpu"): the first call, and the median of later calls (warm);
- generate, static cache, a new prompt length each call within one bucket (9, 11, 13, 15
  tokens): calls 2-4 and the programs each compiles, with the prefill compiled per bucket (the
  default on "tpu") and run eagerly as transformers does (``TORCHTPU_PREFILL_BUCKETS=0``);
- training on batches of lengths 17..128 (``mark_dynamic`` on the sequence dim, compiled with
  backend "tpu"): time of 8 steps, and programs compiled; the model alone compiled (the
  cross-entropy eager), then the model and its loss in one compiled function (masked graphs:
  compile/masking.py);
- ``--ablation``: the cold generate with the cheap XLA options for small programs turned off
  (TORCHTPU_FAST_COMPILE_MAX_ELEMENTS=0), and with only the classic emitters turned off
  (TORCHTPU_CLASSIC_EMITTERS=0).
Times are medians over ``--repeats`` processes (default 1; each cold process compiles ~370
programs). Compile counts come from ``torch.tpu.metrics()``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NEW_TOKENS = 32


def _model(device):
    import logging

    import torch
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval().to(device)


def _generate(model, device, cache, length=8):
    import torch

    ids = torch.randint(3, 256, (1, length),
                        generator=torch.Generator().manual_seed(1 if length == 8 else length))
    ids = ids.to(device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, cache_implementation=cache)
    return out.cpu()


def _counters():
    import torch

    if not hasattr(torch, "tpu"):
        return {}
    c = torch.tpu.metrics()["counters"]
    keys = ("eager_xla_compiles", "eager_disk_cache_hits", "eager_prefetch_hits",
            "fused_xla_compiles", "xla_compiles",
            "compile_cache_misses", "compile_disk_cache_hits", "eager_xla_compile_ms",
            "compile_bucket_programs", "compile_masked_graphs", "aot_cache_hits")
    return {k: c.get(k, 0) for k in keys}


def child_generate(device, cache, calls):
    model = _model(device)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        toks = _generate(model, device, cache)
        times.append(time.perf_counter() - t0)
    return {"times": times, "counters": _counters(), "tokens": toks.tolist()}


PROMPTS = (9, 11, 13, 15)  # one prompt bucket (16); caches of 40..46 positions: bucket 64


def child_prompts(device):
    """Static-cache generate with a new prompt length each call, all in one bucket: per call,
    the time and the programs compiled."""
    model = _model(device)
    times, compiles, tokens = [], [], []
    for n in PROMPTS:
        before = _counters()
        t0 = time.perf_counter()
        tokens.append(_generate(model, device, "static", n).tolist())
        times.append(time.perf_counter() - t0)
        after = _counters()
        compiles.append({k: after.get(k, 0) - before.get(k, 0)
                         for k in ("eager_xla_compiles", "xla_compiles")})
    return {"times": times, "compiles": compiles, "tokens": tokens}


SAMPLE_CHARS, SAMPLE_BLOCK = 96, 64


def child_sample(device, calls):
    """minGPT's sampling loop (mingpt/model.py ``generate``), as chargpt runs it: no KV cache,
    the context grows by one token per step and is cropped to the block size, top-k and
    ``torch.multinomial``; a 2-layer GPT (examples/train_gpt.py) with random weights."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples"))
    from train_gpt import GPT

    torch.manual_seed(0)
    model = GPT(65, SAMPLE_BLOCK, n_layer=2, n_head=4, n_embd=64).eval().to(device)

    @torch.no_grad()
    def generate(idx, n, temperature=1.0, top_k=10):
        for _ in range(n):
            idx_cond = idx if idx.size(1) <= SAMPLE_BLOCK else idx[:, -SAMPLE_BLOCK:]
            logits = model(idx_cond)[:, -1, :] / temperature
            v, _ = torch.topk(logits, top_k)
            logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx

    times = []
    for _ in range(calls):
        torch.manual_seed(1)
        t0 = time.perf_counter()
        out = generate(torch.zeros((1, 1), dtype=torch.long, device=device), SAMPLE_CHARS)
        out = out.cpu()
        times.append(time.perf_counter() - t0)
    assert out.shape == (1, SAMPLE_CHARS + 1) and 0 <= int(out.min()) and int(out.max()) < 65
    return {"times": times, "counters": _counters()}


def child_train(device, steps, loss_in_graph=False):
    import torch

    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256)
    model = torch.nn.Sequential(emb, torch.nn.Tanh(), lin).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def with_loss(ids):
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 ids[:, 1:].flatten())

    fn = with_loss if loss_in_graph else model
    fn = fn if device == "cpu" else torch.compile(fn, backend="tpu")
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(17, 129, (steps,), generator=g)]
    import warnings

    losses = []
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in lengths:
            ids = torch.randint(0, 256, (4, n), generator=g).to(device)
            if device != "cpu":
                torch._dynamo.mark_dynamic(ids, 1)
            if loss_in_graph:
                loss = fn(ids)
            else:
                logits = fn(ids)
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                         ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    return {"time": time.perf_counter() - t0, "losses": losses, "lengths": lengths,
            "counters": _counters()}


def _spawn(args, env_extra):
    env = dict(os.environ, **env_extra)
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ablation", action="store_true")
    ap.add_argument("--only", choices=("generate", "sample", "train"),
                    help="run one part of the table")
    a = ap.parse_args()
    if a.child:
        spec = json.loads(a.child)
        if spec["case"] == "generate":
            res = child_generate(spec["device"], spec["cache"], spec["calls"])
        elif spec["case"] == "prompts":
            res = child_prompts(spec["device"])
        elif spec["case"] == "sample":
            res = child_sample(spec["device"], spec["calls"])
        else:
            res = child_train(spec["device"], spec["steps"], spec.get("loss_in_graph", False))
        print(json.dumps(res))
        return

    rows = []
    med = statistics.median

    def row(name, times, counters, cpu_s):
        t = med(times)
        rows.append((name, t, t / cpu_s if cpu_s else float("nan"), counters))

    if a.only in (None, "generate"):
        _generate_rows(a, row, rows)
    if a.only in (None, "sample"):
        _sample_rows(a, row)
    if a.only in (None, "train"):
        _train_rows(rows)

    print(f"{'case':68} {'s':>8} {'vs CPU':>7}  compiles / cache")
    for name, t, ratio, c in rows:
        cs = ", ".join(f"{k}={v}" for k, v in c.items() if v)
        print(f"{name:68} {t:8.2f} {ratio:7.2f}  {cs}")


def _generate_rows(a, row, rows):
    med = statistics.median
    cpu = _spawn({"case": "generate", "device": "cpu", "cache": "dynamic", "calls": 4}, {})
    cpu_s = med(cpu["times"][1:])
    cpu_static = _spawn({"case": "generate", "device": "cpu", "cache": "static", "calls": 4}, {})
    cpu_static_s = med(cpu_static["times"][1:])
    rows.append(("CPU dynamic cache (median of calls 2-4)", cpu_s, 1.0, {}))
    rows.append(("CPU static cache (median of calls 2-4)", cpu_static_s, 1.0, {}))
    cold, warm, static_first, static_warm = [], [], [], []
    for _ in range(a.repeats):
        with tempfile.TemporaryDirectory() as d:
            env = {"TORCHTPU_CACHE_DIR": d}
            c = _spawn({"case": "generate", "device": "tpu", "cache": "dynamic", "calls": 2},
                       env)
            w = _spawn({"case": "generate", "device": "tpu", "cache": "dynamic", "calls": 1},
                       env)
            s = _spawn({"case": "generate", "device": "tpu", "cache": "static", "calls": 4},
                       env)
            for r in (c, w, s):
                assert r["tokens"] == cpu["tokens"], "tpu tokens differ from CPU's"
            cold.append(c)
            warm.append(w)
            static_first.append(s)
            static_warm.append(med(s["times"][1:]))
    row("tpu dynamic, fresh process, empty cache (cold)", [r["times"][0] for r in cold],
        cold[-1]["counters"], cpu_s)
    row("tpu dynamic, same process, second call", [r["times"][1] for r in cold], {}, cpu_s)
    row("tpu dynamic, second process (warm cache)", [r["times"][0] for r in warm],
        warm[-1]["counters"], cpu_s)
    row("tpu static, second process, first call", [r["times"][0] for r in static_first],
        static_first[-1]["counters"], cpu_static_s)
    row("tpu static, warm (median of calls 2-4)", static_warm, {}, cpu_static_s)
    # static cache, a new prompt length within the bucket each call (the first call of the
    # process compiles the decode step and the bucket's prefill; calls 2-4 are new lengths):
    # with the prefill compiled per bucket, and as transformers runs it (eagerly)
    cpu_p = _spawn({"case": "prompts", "device": "cpu"}, {})
    cpu_p_s = med(cpu_p["times"][1:])
    rows.append((f"CPU static, prompts of {'/'.join(map(str, PROMPTS[1:]))} tokens "
                 "(median of calls 2-4)", cpu_p_s, 1.0, {}))
    for name, extra in (("prefill compiled per bucket", {}),
                        ("eager prefill (TORCHTPU_PREFILL_BUCKETS=0)",
                         {"TORCHTPU_PREFILL_BUCKETS": "0"})):
        with tempfile.TemporaryDirectory() as d:
            r = _spawn({"case": "prompts", "device": "tpu"}, dict(extra, TORCHTPU_CACHE_DIR=d))
        assert r["tokens"] == cpu_p["tokens"], "tpu tokens differ from CPU's"
        per_call = {k: max(c[k] for c in r["compiles"][1:]) for k in r["compiles"][1]}
        row(f"tpu static, new prompt length in the bucket, {name} (calls 2-4; compiles: "
            "most in one call)", r["times"][1:], per_call, cpu_p_s)
    if a.ablation:
        with tempfile.TemporaryDirectory() as d:
            r = _spawn({"case": "generate", "device": "tpu", "cache": "dynamic", "calls": 1},
                       {"TORCHTPU_CACHE_DIR": d, "TORCHTPU_FAST_COMPILE_MAX_ELEMENTS": "0"})
            row("tpu dynamic cold, cheap XLA options off", r["times"], r["counters"], cpu_s)
        with tempfile.TemporaryDirectory() as d:
            r = _spawn({"case": "generate", "device": "tpu", "cache": "dynamic", "calls": 1},
                       {"TORCHTPU_CACHE_DIR": d, "TORCHTPU_CLASSIC_EMITTERS": "0"})
            row("tpu dynamic cold, classic emitters off", r["times"], r["counters"], cpu_s)


def _sample_rows(a, row):
    med = statistics.median
    cpu = _spawn({"case": "sample", "device": "cpu", "calls": 3}, {})
    cpu_s = med(cpu["times"][1:])
    row(f"CPU minGPT-style sampling, {SAMPLE_CHARS} chars (median of calls 2-3)",
        cpu["times"][1:], {}, cpu_s)
    envs = [("", {})]
    if a.ablation:
        envs.append((", building ahead off", {"TORCHTPU_PREFETCH_THREADS": "0"}))
    for label, extra in envs:
        cold, warm = [], []
        for _ in range(a.repeats):
            with tempfile.TemporaryDirectory() as d:
                env = dict(extra, TORCHTPU_CACHE_DIR=d)
                cold.append(_spawn({"case": "sample", "device": "tpu", "calls": 2}, env))
                warm.append(_spawn({"case": "sample", "device": "tpu", "calls": 1}, env))
        row(f"tpu sampling, fresh process, empty cache (cold){label}",
            [r["times"][0] for r in cold], cold[-1]["counters"], cpu_s)
        row(f"tpu sampling, same process, second call{label}", [r["times"][1] for r in cold],
            {}, cpu_s)
        row(f"tpu sampling, second process (warm cache){label}", [r["times"][0] for r in warm],
            warm[-1]["counters"], cpu_s)


def _train_rows(rows):
    for in_graph in (False, True):
        spec = {"case": "train", "steps": 8, "loss_in_graph": in_graph}
        train_cpu = _spawn(dict(spec, device="cpu"), {})
        with tempfile.TemporaryDirectory() as d:
            train_tpu = _spawn(dict(spec, device="tpu"), {"TORCHTPU_CACHE_DIR": d})
        worst = max(abs(x - y) for x, y in zip(train_cpu["losses"], train_tpu["losses"]))
        what = "model and loss compiled" if in_graph else "model compiled, loss eager"
        rows.append((f"CPU training, 8 steps, lengths {sorted(set(train_cpu['lengths']))}",
                     train_cpu["time"], 1.0, {}))
        rows.append((f"tpu training, {what} (max |loss diff| {worst:.1e})", train_tpu["time"],
                     train_tpu["time"] / train_cpu["time"], train_tpu["counters"]))

if __name__ == "__main__":
    main()
