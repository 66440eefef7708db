"""Where an SGLang server's time to first token goes on "tpu", and what a warm start costs.

    .venv-sglang/bin/python benchmarks/sglang_ttft.py            # make venv-sglang first
    .venv-sglang/bin/python benchmarks/sglang_ttft.py --streams 8 --rounds 3

The tiny Llama of benchmarks/sglang_serving.py served as there (``launch_server --device
tpu``, decode and prefill through compiled buckets, ``--enable-metrics`` for SGLang's
per-request timestamps) twice on one fresh compile cache (``TORCHTPU_CACHE_DIR``): a first
start (every bucket compiled) and a second start (warm: the last run's working set,
torchtpu/sglang/working_set.py). Each start serves ``--rounds`` rounds of ``--streams``
concurrent streamed greedy requests (SGLang's ``/generate``); per round, medians over its
requests of:

- ``ttft``: the client's time to the first streamed token;
- ``http in``: request sent -> the tokenizer manager received it (SGLang's
  ``request_received_ts``);
- ``to forward``: received -> its extend step began (tokenization, hand-over to the
  scheduler, the scheduler's queue; ``queue`` is the waiting-queue part);
- ``extend``: the extend step began -> its result was processed (SGLang's
  ``prefill_finished_time``: the step's host work, the program, sampling);
- ``out``: -> the first token reached the client (detokenizer, HTTP);

and the scheduler's counters over the round (torchtpu.sglang.metrics_file): extend steps, XLA
compiles, eager programs compiled (per op), host syncs, Dynamo traces of deferred buckets
(``idle_warmed``). Timestamps are wall clocks of one host. The load average is printed.
On a loaded host a first start warming every prefill bucket up to SGLang's chunked-prefill
size takes very long: ``TORCHTPU_SGLANG_PREFILL_WARMUP_TOKENS=64`` warms fewer, the first
round then compiles the larger buckets the requests meet (and the warm start warms them:
they are in the first start's record).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from sglang_serving import MODEL, serve  # noqa: E402

PARTS = ("ttft", "http in", "to forward", "queue", "extend", "out")


def _stream(port, prompt, out_tokens):
    """One streamed request: (client seconds to the first token, its SGLang meta_info)."""
    body = json.dumps({"text": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": out_tokens, "temperature": 0.0, "ignore_eos": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    sent_wall, t = time.time(), time.perf_counter()
    first = meta = None
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("text"):
                first, first_wall, meta = time.perf_counter() - t, time.time(), chunk["meta_info"]
    if first is None:
        return None
    g = lambda k: meta.get(k) or float("nan")  # noqa: E731
    received, fwd, done = g("request_received_ts"), g("forward_entry_time"), g(
        "prefill_finished_time")
    return {"ttft": first, "http in": received - sent_wall, "to forward": fwd - received,
            "queue": g("queue_time"), "extend": done - fwd, "out": first_wall - done}


def _delta(m0, m1):
    c0, c1 = m0["counters"], m1["counters"]
    grow = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1}
    ops = {}
    for kind, per in m1["per_kind_eager_compiles"].items():
        for op, n in per.items():
            d = n - m0["per_kind_eager_compiles"].get(kind, {}).get(op, 0)
            if d:
                ops[f"{kind}:{op}"] = d
    f0, f1 = m0["forwards"], m1["forwards"]
    d0, d1 = m0.get("deferred") or {}, m1.get("deferred") or {}
    xla = sum(v for k, v in grow.items() if k.endswith("xla_compiles"))
    return {"extend steps": f1.get("extend", 0) - f0.get("extend", 0),
            "xla compiles": xla,
            "xla compiles in path": xla - sum(v for k, v in grow.items()
                                              if k.endswith("xla_compiles_off_path")),
            "served on host": grow.get("eager_deferred_calls", 0),
            "eager compiles": grow.get("eager_compiles", 0), "eager ops": ops,
            "host syncs": grow.get("host_syncs", 0),
            "idle warmed": d1.get("idle_warmed", 0) - d0.get("idle_warmed", 0)}


def run_start(path, streams, rounds, out_tokens):
    from torchtpu.sglang import metrics_file

    prompts = [" ".join(["the cat sat on the mat"] * k) for k in range(4, 4 + streams)]
    t0 = time.perf_counter()
    with serve(path, "compiled", streams, ["--enable-metrics"], 3600) as (port, metrics):
        start_s = time.perf_counter() - t0
        print(f"ready in {start_s:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        out = []
        for _ in range(rounds):
            m0 = metrics_file.read(metrics)
            with cf.ThreadPoolExecutor(streams) as ex:
                res = [r for r in ex.map(lambda p: _stream(port, p, out_tokens), prompts) if r]
            m1 = metrics_file.read(metrics)
            row = {k: statistics.median(r[k] for r in res) for k in PARTS}
            row["ttft max"] = max(r["ttft"] for r in res)
            row.update(_delta(m0, m1))
            out.append(row)
        return start_s, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-tokens", type=int, default=16)
    a = ap.parse_args()
    from tiny_models import save_tiny_model

    path = save_tiny_model(tempfile.mkdtemp(prefix="bench-llama-"), **MODEL)
    os.environ["TORCHTPU_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-cache-")
    os.environ.pop("XLA_FLAGS", None)
    print(f"model: tiny {MODEL}; {a.streams} streams x {a.out_tokens} tokens; load at start: "
          f"{os.getloadavg()}", flush=True)
    rows = []
    for start in ("first start", "warm start"):
        start_s, out = run_start(path, a.streams, a.rounds, a.out_tokens)
        print(f"{start}: ready in {start_s:.1f} s", flush=True)
        for i, row in enumerate(out, 1):
            rows.append((start, start_s, i, row))
            print(json.dumps({"start": start, "round": i, **row}), flush=True)
    print(f"\n## SGLang server TTFT split (compiled, {a.streams} streams), "
          f"load {os.getloadavg()[0]:.1f}\n")
    print("| start | ready s | round | " + " | ".join(f"{p} ms" for p in PARTS)
          + " | ttft max ms | extend steps | XLA compiles (in the path) | eager compiles "
          "| served on host | host syncs | idle-warmed buckets |")
    print("|---|---|---|" + "---|" * (len(PARTS) + 7))
    for start, start_s, i, r in rows:
        print(f"| {start} | {start_s:.1f} | {i} | "
              + " | ".join(f"{1000 * r[p]:.0f}" for p in PARTS)
              + f" | {1000 * r['ttft max']:.0f} | {r['extend steps']} | {r['xla compiles']} "
              f"({r['xla compiles in path']}) | {r['eager compiles']} | {r['served on host']} | "
              f"{r['host syncs']} | {r['idle warmed']} |")
    for start, _, i, r in rows:
        if r["eager ops"]:
            print(f"eager programs compiled, {start} round {i}: {r['eager ops']}")


if __name__ == "__main__":
    main()
