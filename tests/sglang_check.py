"""SGLang on "tpu" checked against transformers on CPU; run by tests/test_sglang*.py in the
SGLang virtualenv (``make venv-sglang``), one JSON line of results on stdout.

    .venv-sglang/bin/python tests/sglang_check.py engine --arch llama --out /tmp/x

Tiny random-weight models built from configs (examples/tiny_models.py), no download.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

PROMPTS = ["the cat sat on the mat", "hello world how are you today", "red blue green",
           "one two three four five six seven eight nine ten up down left right"]


def _model(arch: str, root: str) -> str:
    from tiny_models import save_tiny_model

    path = os.path.join(root, f"tiny-{arch}")
    if not os.path.exists(os.path.join(path, "config.json")):
        save_tiny_model(path, arch)
    return path


def _ids(path):
    # the tokenizer saved with the model (AutoTokenizer of transformers 5.19 picks
    # Qwen2Tokenizer for a qwen2 config, which does not know the tiny word vocabulary)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path)
    return [tok(p)["input_ids"] for p in PROMPTS]


def engine(args) -> dict:
    """Offline engine: greedy batch, radix prefix cache, seeded sampling."""
    import sglang as sgl
    from tiny_models import hf_greedy

    path = _model(args.arch, args.out)
    ids = _ids(path)
    n = args.max_tokens
    greedy = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    res = {"arch": args.arch}
    # the scheduler's torch.tpu.metrics() per forward, read when asked (torchtpu.sglang)
    os.environ.setdefault("TORCHTPU_SGLANG_METRICS_FILE", os.path.join(args.out, "metrics"))
    t = time.time()
    kw = {"dtype": "float32", **json.loads(args.engine_args)}
    llm = sgl.Engine(model_path=path, device="tpu", max_total_tokens=4096, random_seed=0,
                     log_level="warning", tp_size=args.tp, **kw)
    res["startup_s"] = time.time() - t
    try:
        from sglang.srt.platforms import current_platform

        res["platform"] = type(current_platform).__name__
        t = time.time()
        out = llm.generate(input_ids=ids, sampling_params=greedy)
        res["batch_s"] = time.time() - t
        res["greedy"] = [o["output_ids"] for o in out]
        # the radix cache: the same prompts again share their whole prefix with the first call
        out = llm.generate(input_ids=ids, sampling_params=greedy)
        res["greedy_again"] = [o["output_ids"] for o in out]
        res["cached_tokens"] = [o["meta_info"].get("cached_tokens", 0) for o in out]
        # a third round, the second's batch shapes again: what a step costs after warm-up
        m0 = _worker_metrics()
        out = llm.generate(input_ids=ids, sampling_params=greedy)
        res["greedy_third"] = [o["output_ids"] for o in out]
        m1 = _worker_metrics()
        res["worker"] = {k: m1.get(k) for k in ("attention", "kv_pool", "kv_dtype",
                                                "max_total_num_tokens", "graph_runner",
                                                "graph_bs", "graph_dynamo", "prefill_dynamo",
                                                "prefill_warmed", "deferred",
                                                "decode_warm_up_s", "prefill_warm_up_s")}
        # XLA compiles of the process so far (0 on a start from a filled compile cache)
        res["worker"]["xla_compiles"] = sum(v for k, v in m1["counters"].items()
                                            if k.endswith("xla_compiles"))
        res["worker"]["spmd_programs"] = m1["counters"].get("compile_spmd_programs", 0)
        d0 = m0["per_kind"].get("decode", {})
        res["third_round"] = {
            "forwards": {k: m1["forwards"].get(k, 0) - m0["forwards"].get(k, 0)
                         for k in m1["forwards"]},
            "intervals": {k: m1["intervals"].get(k, 0) - m0["intervals"].get(k, 0)
                          for k in m1["intervals"]},
            "decode": {k: v - d0.get(k, 0)
                       for k, v in m1["per_kind"].get("decode", {}).items() if v != d0.get(k, 0)},
            "decode_eager_compiles": {
                op: n - m0["per_kind_eager_compiles"].get("decode", {}).get(op, 0)
                for op, n in m1["per_kind_eager_compiles"].get("decode", {}).items()
                if n != m0["per_kind_eager_compiles"].get("decode", {}).get(op, 0)}}
        # sampling draws from the device generator, seeded by the engine's random_seed: the
        # same seed in another process gives the same tokens (tests/test_sglang.py compares)
        sample = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": n,
                  "ignore_eos": True}
        out = llm.generate(input_ids=ids, sampling_params=sample)
        res["sampled"] = [o["output_ids"] for o in out]
    finally:
        llm.shutdown()
    import torch

    res["hf"] = hf_greedy(path, ids, n, getattr(torch, kw["dtype"]))
    res["budget"] = _kv_budget()
    return res


def _kv_budget() -> dict:
    """The KV byte budget SGLang's configurator profiled (1 MiB here), as the plugin's hook
    after ``_profile_available_bytes`` hands it on, per KV dtype (None: unchanged)."""
    import torch
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    from torchtpu.sglang.kv_pool import budget_bytes

    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for mla in (False, True):
            cfg = object.__new__(KVCacheConfigurator)
            cfg.kv_cache_dtype, cfg.use_mla_backend = dtype, mla
            out[f"{str(dtype)[6:]}{'-mla' if mla else ''}"] = budget_bytes(1 << 20, cfg, 0)
    return out


def _worker_metrics(base=None) -> dict:
    """Rank 0's counters, written when asked (torchtpu/sglang/metrics_file.py)."""
    from torchtpu.sglang import metrics_file

    return metrics_file.read(base)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(base) -> dict:
    import requests

    out = {}
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("sglang:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def _launch(cmd: list, log_path: str):
    """``cmd`` (a server) in its own session, its output in ``log_path``: (process, log)."""
    import subprocess

    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True), log


def _wait_healthy(proc, base: str, timeout: float) -> float:
    """Seconds until ``base``/health answers 200; raises if the server exits or times out."""
    import requests

    t = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            if requests.get(base + "/health", timeout=5).status_code == 200:
                return time.time() - t
        except requests.RequestException:
            pass
        if time.time() - t > timeout:
            raise TimeoutError("server did not come up")
        time.sleep(1)


def _stop(proc, log) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    import signal
    import subprocess

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def server(args) -> dict:
    """``launch_server --device tpu``: completions, chat, streaming against HF greedy; the
    llm-d contract: /metrics gauges scraped while requests run, KV-cache events over ZMQ."""
    import threading

    import msgspec
    import requests
    import zmq
    from sglang.srt.disaggregation.kv_events import KVEventBatch
    from tiny_models import hf_greedy
    from transformers import AutoTokenizer

    path = _model(args.arch, args.out)
    tok = AutoTokenizer.from_pretrained(path)
    ids = _ids(path)
    n = args.max_tokens
    port, kv_port = _free_port(), _free_port()
    base = f"http://127.0.0.1:{port}"
    max_running, max_total = 2, 4096
    # the publisher binds a wildcard endpoint and the subscriber connects to it (an endpoint
    # without a wildcard makes SGLang's publisher *connect*, and then nobody binds)
    kv_cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{kv_port}", "topic": "kv"}
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", path, "--device",
           "tpu", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-total-tokens", str(max_total), "--max-running-requests", str(max_running),
           "--enable-metrics", "--kv-events-config", json.dumps(kv_cfg), "--random-seed", "0",
           "--log-level", "warning", *json.loads(args.server_args)]
    proc, log = _launch(cmd, os.path.join(args.out, "server.log"))
    res = {"arch": args.arch}
    events, stop = [], threading.Event()

    def subscribe():
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{kv_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not stop.is_set():
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                events.extend(dec.decode(payload).events)
        sub.close(linger=0)

    th = threading.Thread(target=subscribe, daemon=True)
    th.start()
    try:
        res["startup_s"] = _wait_healthy(proc, base, args.timeout)
        comp = lambda prompt, **kw: requests.post(base + "/v1/completions", json=dict(
            model=path, prompt=prompt, max_tokens=n, temperature=0, **kw), timeout=600)
        out = [comp(p).json() for p in ids]
        res["completions_text"] = [o["choices"][0]["text"] for o in out]
        hf = hf_greedy(path, ids, n)
        res["hf_text"] = [tok.decode(h, skip_special_tokens=True) for h in hf]
        # streaming: the chunks make up the same text
        r = requests.post(base + "/v1/completions", json=dict(
            model=path, prompt=ids[0], max_tokens=n, temperature=0, stream=True),
            stream=True, timeout=600)
        chunks = []
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
        res["stream_chunks"] = chunks
        msgs = [{"role": "user", "content": "hello how are you"}]
        chat = requests.post(base + "/v1/chat/completions", json=dict(
            model=path, messages=msgs, max_tokens=n, temperature=0), timeout=600).json()
        res["chat_text"] = chat["choices"][0]["message"]["content"]
        chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
        res["hf_chat_text"] = tok.decode(hf_greedy(path, [chat_ids], n)[0],
                                         skip_special_tokens=True)
        # /metrics while requests run: k requests, at most max_running run, the rest queue
        k, long = 5, args.load_tokens
        load_prompts = [ids[3] + ids[i % 3] for i in range(k)]
        results = [None] * k

        def send(i):
            results[i] = requests.post(base + "/v1/completions", json=dict(
                model=path, prompt=load_prompts[i], max_tokens=long, temperature=0,
                ignore_eos=True), timeout=900).json()

        threads = [threading.Thread(target=send, args=(i,)) for i in range(k)]
        for th_ in threads:
            th_.start()
        scrapes, t = [], time.time()
        while any(th_.is_alive() for th_ in threads) and time.time() - t < args.timeout:
            m = _metrics(base)
            scrapes.append({key: m.get(key) for key in (
                "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                "sglang:num_used_tokens")})
            time.sleep(0.2)
        for th_ in threads:
            th_.join(timeout=args.timeout)
        res["load"] = {"k": k, "max_running": max_running, "max_total": max_total,
                       "prompt_lens": [len(p) for p in load_prompts], "max_tokens": long,
                       "scrapes": scrapes,
                       "done": [r is not None and "choices" in r for r in results]}
        time.sleep(2)
        m = _metrics(base)
        res["idle_metrics"] = {key: m.get(key) for key in (
            "sglang:num_running_reqs", "sglang:num_queue_reqs")}
        # KV events: the prefix cache's stores, then a flush clears it
        requests.post(base + "/flush_cache", timeout=60)
        time.sleep(3)
    finally:
        stop.set()
        th.join(timeout=10)
        _stop(proc, log)
    kinds = {}
    stored = []
    for e in events:
        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        if type(e).__name__ == "BlockStored":
            stored.extend(e.token_ids)
    res["kv_events"] = kinds
    res["kv_stored_tokens"] = stored
    res["prompts"] = ids
    return res


def burst(args) -> dict:
    """``launch_server --device tpu`` under a bounded burst (tests/burst_client.py): greedy
    completions at once (half streamed), streams dropped after their second chunk, malformed
    requests, with a KV pool too small for them (SGLang retracts running requests and
    recomputes them). Every valid answer must equal the same request alone, the malformed
    ones get a 4xx, the server stays healthy; afterwards SGLang's token usage gauges
    (``sglang:token_usage``, ``sglang:num_used_tokens``) read 0 once idle."""
    import requests
    from burst_client import burst as send_burst
    from burst_client import metric, wait_for_zero

    path = _model(args.arch, args.out)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # no radix cache: a finished request's tokens would stay in the pool as cached prefixes.
    # --schedule-conservativeness 0.05: the scheduler admits requests reserving almost none of
    # their future tokens (0.7 of them by default, which a burst this small never outgrew), so
    # decode runs out of the pool and must retract running requests
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", path, "--device",
           "tpu", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--served-model-name", "tiny", "--max-total-tokens", str(args.max_total),
           "--max-running-requests", "16", "--schedule-conservativeness", "0.05",
           "--disable-radix-cache", "--enable-metrics",
           "--random-seed", "0", "--log-level", "warning", *json.loads(args.server_args)]
    proc, log = _launch(cmd, os.path.join(args.out, "server.log"))
    res = {"arch": args.arch, "n": [args.n, args.drop, args.bad]}
    try:
        res["startup_s"] = _wait_healthy(proc, base, args.timeout)
        # SGLang serves its one model whatever the request's "model" says (by design)
        # SGLang serves its one model whatever the request's "model" says (by design). Without
        # ignore_eos: SGLang admits an ignore_eos request only with room for all its tokens
        # (so it never retracts one), but sizes the others by a ratio of their max_tokens
        out = send_burst(base, "tiny", args.n, args.drop, args.bad, args.max_tokens,
                         checks_model=False, ignore_eos=False)
        res.update(codes=out["codes"], burst_s=out["burst_s"], equal=out["got"] == out["alone"],
                   lens=[len(t) for t in out["got"]])
        res["retracted"] = metric(base, "sglang:num_retracted_requests_total")
        res["idle"] = {name: wait_for_zero(base, name) for name in (
            "sglang:token_usage", "sglang:num_used_tokens", "sglang:num_running_reqs",
            "sglang:num_queue_reqs")}
        res["healthy"] = proc.poll() is None and \
            requests.get(base + "/health", timeout=10).status_code == 200
    finally:
        _stop(proc, log)
    return res


def kvpub(args) -> dict:
    """SGLang's own ZMQ KV-event publisher and a subscriber connecting to 127.0.0.1, with the
    publisher's endpoint spelled with a wildcard host and with the loopback address."""
    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import (BlockRemoved, BlockStored, KVEventBatch,
                                                    ZmqEventPublisher)

    res = {}
    for name, host in (("wildcard", "*"), ("loopback", "127.0.0.1")):
        port = _free_port()
        pub = ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://{host}:{port}", topic="kv")
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        got, t = [], time.time()
        while not got and time.time() - t < 5:  # PUB drops what it sends before SUB joined
            pub.publish(KVEventBatch(ts=time.time(), events=[
                BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5, 6],
                            block_size=2, lora_id=None),
                BlockRemoved(block_hashes=[1])]))
            if sub.poll(500):
                _t, _s, payload = sub.recv_multipart()
                got = [type(e).__name__ for e in
                       msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events]
        res[name] = got
        pub.shutdown()
        sub.close(linger=0)
    return res


def pd(args) -> dict:
    """Prefill/decode disaggregation on one host: a prefill and a decode ``launch_server``
    exchanging the KV cache through the ``torchtpu`` transfer backend (host copies and a
    shared folder, no RDMA). Each request goes to both with the same bootstrap room (what
    SGLang's router does); the decode instance's tokens against HF greedy."""
    import concurrent.futures as cf
    import signal
    import subprocess

    import requests
    from tiny_models import hf_greedy

    path = _model(args.arch, args.out)
    ids = _ids(path)
    n = args.max_tokens
    kv_dir = os.path.join(args.out, "kv")
    os.makedirs(kv_dir, exist_ok=True)
    env = dict(os.environ, TORCHTPU_SGLANG_KV_DIR=kv_dir)
    bport = _free_port()
    procs, logs, bases = [], [], {}
    try:
        for mode in ("prefill", "decode"):
            port = _free_port()
            bases[mode] = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", path,
                   "--device", "tpu", "--host", "127.0.0.1", "--port", str(port), "--dtype",
                   "float32", "--max-total-tokens", "4096", "--random-seed", "0",
                   "--log-level", "warning", "--disaggregation-mode", mode,
                   "--disaggregation-transfer-backend", "torchtpu",
                   "--disaggregation-bootstrap-port", str(bport), *json.loads(args.server_args)]
            log = open(os.path.join(args.out, f"{mode}.log"), "w")
            logs.append(log)
            menv = dict(env, TORCHTPU_SGLANG_METRICS_FILE=os.path.join(args.out, f"{mode}.m"))
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=menv,
                                          start_new_session=True))
        t = time.time()
        for mode, proc in zip(("prefill", "decode"), procs):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{mode} server exited {proc.returncode}")
                try:
                    if requests.get(bases[mode] + "/health", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.time() - t > args.timeout:
                    raise TimeoutError(f"{mode} server did not come up")
                time.sleep(1)
        res = {"arch": args.arch, "startup_s": time.time() - t}

        def generate(i_ids):
            i, prompt = i_ids
            body = dict(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n,
                                                           "ignore_eos": True},
                        bootstrap_host="127.0.0.1", bootstrap_port=bport,
                        bootstrap_room=1000 + i)
            with cf.ThreadPoolExecutor(2) as ex:
                fp = ex.submit(requests.post, bases["prefill"] + "/generate", json=body,
                               timeout=600)
                fd = ex.submit(requests.post, bases["decode"] + "/generate", json=body,
                               timeout=600)
                rp, rd = fp.result(), fd.result()
            if rd.status_code != 200:
                raise RuntimeError(f"decode answered {rd.status_code}: {rd.text[:500]}")
            return rd.json()["output_ids"], rp.json().get("output_ids")

        t = time.time()
        out = [generate(x) for x in enumerate(ids)]
        res["pd_s"] = time.time() - t
        res["pd"] = [o[0] for o in out]
        res["prefill_out"] = [o[1] for o in out]
        res["left_in_kv_dir"] = sorted(os.listdir(kv_dir))
        # what each instance ran: the decode instance never runs a prompt through the model
        for mode in ("prefill", "decode"):
            m = _worker_metrics(os.path.join(args.out, f"{mode}.m"))
            res[f"{mode}_forwards"] = m["forwards"]
            res[f"{mode}_worker"] = {k: m[k] for k in ("attention", "kv_pool", "graph_runner")}
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    res["hf"] = hf_greedy(path, ids, n)
    return res


def compat(args) -> dict:
    """torchtpu/sglang/dynamo_compat.py on SGLang's own classes: the twins keep the fields,
    defaults and methods; Dynamo traces their construction and writes without a graph break
    (fullgraph); a target that is not what the module expects is skipped, saying why."""
    import logging

    import torch
    from sglang.srt.layers.layer_boundary.residual import stream

    from torchtpu.sglang import dynamo_compat as dc

    orig = stream.Contribution
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    dc.logger.addHandler(handler)
    dc.TARGETS = dc.TARGETS + (
        ("sglang.srt.layers.layer_boundary.residual.stream", "ResidualStream",
         ("residual",)),  # not a msgspec.Struct: skipped
        ("sglang.srt.layers.layer_boundary.residual.stream", "Moved", ("value",)),  # absent
    )
    dc._installed.clear()
    dc._skipped.clear()
    rep = dc.install()
    twin = stream.Contribution
    res = {"report": rep, "warnings": records, "replaced": twin is not orig,
           "fields": list(twin.__struct_fields__), "orig_fields": list(orig.__struct_fields__)}

    def f(x):
        c = stream.Contribution(x * 2, None)  # owed defaults to None
        y = c.complete() + 1
        c.release()
        return y, c.value is None and c.owed is None

    x = torch.arange(4.0)
    torch._dynamo.reset()
    y, released = torch.compile(f, backend="eager", fullgraph=True)(x)
    res["compiled_ok"] = bool(torch.equal(y, x * 2 + 1)) and bool(released)
    res["eager_ok"] = bool(torch.equal(f(x)[0], x * 2 + 1))
    # the exit module now builds the twin too
    from sglang.srt.layers.layer_boundary import exit as exit_mod

    res["exit_rebound"] = exit_mod.ExitDecision is not None and \
        getattr(exit_mod.ExitDecision, "__torchtpu_twin_of__", None) is not None
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["engine", "server", "burst", "kvpub", "pd", "compat"])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--server-args", default="[]")
    ap.add_argument("--load-tokens", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=600)
    # burst: valid, dropped and malformed requests; the KV pool's size in tokens
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--drop", type=int, default=8)
    ap.add_argument("--bad", type=int, default=8)
    ap.add_argument("--max-total", type=int, default=192)
    args = ap.parse_args()
    res = {"engine": engine, "server": server, "burst": burst, "kvpub": kvpub, "pd": pd,
           "compat": compat}[args.what](args)
    print("SGLANG_CHECK " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
