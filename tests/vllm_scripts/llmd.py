"""The llm-d model-server contract of vLLM's OpenAI server on "tpu" (run by
tests/test_llmd_vllm.py in the vLLM virtualenv).

    python llmd.py server     # /metrics gauges under load + KV-cache events over ZMQ
    python llmd.py kvpub      # vLLM's ZMQ publisher: which endpoint binds (no model)
    python llmd.py pd [eager] # prefill/decode disaggregation, shared-storage connector

``server`` starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with a tiny
random-weight Llama (VLLM_TARGET_DEVICE=tpu, compiled), a block size of 256 and a KV cache of
a few blocks, so that what the scheduler holds is known exactly from what the client sent:

- metrics: ``--max-num-seqs 2``; short prompts whose prompt + output stay inside one block, so
  a running request holds exactly one block and a waiting one none. Two requests are sent and
  the scrape must show running 2 / waiting 0 / usage 2 blocks; three more, and it must show
  running 2 / waiting 3 / usage 2 blocks. Every scrape while they run must be a state the
  scheduler can be in (running <= 2, running + waiting <= requests not yet answered, usage ==
  running blocks exactly), and after the last answer 0 / 0 / 0.
- KV events (``--kv-events-config``, publisher bound to ``tcp://*:P``, a SUB socket connected
  to 127.0.0.1:P): a 300-token prompt stores one full block (BlockStored, its 256 token ids);
  the same prompt again and a prompt sharing its first block are prefix-cache hits (256 cached
  tokens, nothing stored); distinct prompts then cycle the pool until that block is evicted
  (BlockRemoved with its hash), after which the prompt is a miss and is stored again;
  ``/reset_prefix_cache`` publishes AllBlocksCleared.

Prints one JSON line "RESULT {...}" with what was measured, and "ALL OK" when every check
passed. The server is stopped (its process group killed) at the end.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
from tiny_models import WORDS, save_tiny_model  # noqa: E402

BLOCK = 256
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32
NUM_BLOCKS = 16  # the KV cache: 16 blocks of 256 tokens (one is vLLM's null block)
MAX_RUNNING = 2
LOAD_TOKENS = 200  # prompt (<= 16 tokens) + 200 generated < one block of 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, path: str, args: list[str], env: dict | None = None, name="server"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.logf = open(os.path.join(tempfile.mkdtemp(), f"{name}.log"), "w+")
        e = dict(os.environ, VLLM_TARGET_DEVICE="tpu", **(env or {}))
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--served-model-name", "tiny", "--seed", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    def tail(self, n=60) -> str:
        self.logf.flush()
        self.logf.seek(0)
        return "\n".join(self.logf.read().splitlines()[-n:])

    def wait_ready(self, timeout=900) -> float:
        import requests

        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except requests.RequestException:
                pass
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"server not ready in {timeout} s:\n{self.tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def complete(self, prompt_ids, max_tokens, **kw) -> dict:
        import requests

        r = requests.post(self.base + "/v1/completions", json=dict(
            model="tiny", prompt=prompt_ids, max_tokens=max_tokens, temperature=0.0,
            ignore_eos=True, **kw), timeout=600)
        r.raise_for_status()
        return r.json()


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def scrape(base: str) -> dict:
    """The three llm-d gauges (summed over their labels: one engine here) and the KV cache's
    block count from ``vllm:cache_config_info``."""
    import requests

    out = {}
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{")[0]
        if name in GAUGES:
            out[name] = out.get(name, 0.0) + float(value)
        elif name == "vllm:cache_config_info" and 'num_gpu_blocks="' in name_labels:
            out["num_gpu_blocks"] = int(name_labels.split('num_gpu_blocks="')[1].split('"')[0])
    return out


def check(cond, what) -> None:
    if not cond:
        raise AssertionError(what)


def metrics_under_load(srv: Server, prompts: list[list[int]], res: dict) -> None:
    m0 = scrape(srv.base)
    total = m0["num_gpu_blocks"] - 1  # vLLM's usage leaves its null block out
    check(m0["num_gpu_blocks"] == NUM_BLOCKS, f"KV cache has {m0['num_gpu_blocks']} blocks")
    check((m0[GAUGES[0]], m0[GAUGES[1]], m0[GAUGES[2]]) == (0, 0, 0), f"idle at start: {m0}")
    results: list = [None] * len(prompts)
    answered = [0]
    lock = threading.Lock()

    def send(i):
        try:
            results[i] = srv.complete(prompts[i], LOAD_TOKENS)
        finally:
            with lock:
                answered[0] += 1

    def state(m):
        return (int(m[GAUGES[0]]), int(m[GAUGES[1]]), m[GAUGES[2]])

    def usage_of(running):  # each running request holds one block, a waiting one none
        return running / total

    scrapes = []

    def poll_until(pred, sent, timeout=120):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            m = scrape(srv.base)
            s = state(m)
            scrapes.append(s)
            r, w, u = s
            with lock:
                outstanding = sent - answered[0]
            # a state the scheduler can be in, given what was sent and not yet answered
            # (the server finishes a request before its answer arrives: <=)
            check(r <= MAX_RUNNING and r + w <= sent and w >= 0, f"impossible state {s}")
            check(abs(u - usage_of(r)) < 1e-9, f"usage {u} != {r} running blocks of {total}")
            if pred(s, outstanding):
                return s
            time.sleep(0.05)
        raise AssertionError(f"state not reached in {timeout} s; last scrapes {scrapes[-5:]}")

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads[:2]:
        t.start()
    s2 = poll_until(lambda s, o: s[0] == 2, 2)
    check(s2[:2] == (2, 0) and abs(s2[2] - 2 / total) < 1e-9, f"2 sent: {s2}")
    for t in threads[2:]:
        t.start()
    s5 = poll_until(lambda s, o: s[1] == 3, 5)
    check(s5[:2] == (2, 3) and abs(s5[2] - 2 / total) < 1e-9, f"5 sent: {s5}")
    # the next batch of two: running 2, waiting 1
    s3 = poll_until(lambda s, o: s[1] == 1 and s[0] == 2, 5, timeout=300)
    poll_until(lambda s, o: o == 0, 5, timeout=600)
    for t in threads:
        t.join(timeout=60)
    check(all(r is not None and len(r["choices"][0]["text"]) > 0 for r in results),
          "a request failed")
    check(all(r["usage"]["completion_tokens"] == LOAD_TOKENS for r in results),
          "a request stopped early")
    time.sleep(1.0)
    idle = state(scrape(srv.base))
    check(idle == (0, 0, 0.0), f"idle after the load: {idle}")
    res["metrics"] = {"num_gpu_blocks": m0["num_gpu_blocks"], "after_2_sent": s2,
                      "after_5_sent": s5, "second_batch": s3, "idle": idle,
                      "scrapes": len(scrapes), "states_seen": sorted({s[:2] for s in scrapes})}
    print("metrics OK", json.dumps(res["metrics"]), flush=True)


class Subscriber:
    def __init__(self, port: int, topic: bytes = b"kv"):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.events: list = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.connect(f"tcp://127.0.0.1:{port}")
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self):
        while not self._stop.is_set():
            if self._sub.poll(50):
                _topic, _seq, payload = self._sub.recv_multipart()
                with self.lock:
                    self.events.extend(self._dec.decode(payload).events)

    def since(self, n: int) -> list:
        with self.lock:
            return list(self.events[n:])

    def count(self) -> int:
        with self.lock:
            return len(self.events)

    def settle(self, quiet=1.5, timeout=30) -> None:
        """Wait until no event arrived for ``quiet`` seconds (the publisher sends from a
        thread after the engine step)."""
        t0, last, n = time.perf_counter(), time.perf_counter(), self.count()
        while time.perf_counter() - t0 < timeout:
            time.sleep(0.1)
            if self.count() != n:
                n, last = self.count(), time.perf_counter()
            elif time.perf_counter() - last > quiet:
                return

    def close(self):
        self._stop.set()
        self._th.join(timeout=5)
        self._sub.close(linger=0)


def kv_events(srv: Server, sub: Subscriber, res: dict) -> None:
    rng = random.Random(0)
    vocab_ids = list(range(7, 7 + len(WORDS)))  # the tiny tokenizer's word ids

    def prompt(n):
        return [rng.choice(vocab_ids) for _ in range(n)]

    def names(evs):
        return [type(e).__name__ for e in evs]

    def cached(r):
        return ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens") or 0

    sub.settle()
    n0 = sub.count()
    check(not [e for e in sub.since(0) if type(e).__name__ == "BlockStored"],
          "blocks stored by the metrics phase (its requests fill no block)")
    a = prompt(300)
    r = srv.complete(a, 2)
    sub.settle()
    evs = sub.since(n0)
    stored = [e for e in evs if type(e).__name__ == "BlockStored"]
    check(len(stored) == 1 and stored[0].token_ids == a[:BLOCK] and
          stored[0].block_size == BLOCK and len(stored[0].block_hashes) == 1 and
          stored[0].parent_block_hash is None, f"first prompt: {evs}")
    h_a = stored[0].block_hashes[0]
    check(cached(r) == 0, f"first prompt had {cached(r)} cached tokens")
    # the same prompt, and another sharing its first block: hits, nothing stored
    n1 = sub.count()
    r_again = srv.complete(a, 2)
    r_shared = srv.complete(a[:BLOCK] + prompt(40), 2)
    sub.settle()
    check(cached(r_again) == BLOCK and cached(r_shared) == BLOCK,
          f"prefix hits: {cached(r_again)}, {cached(r_shared)}")
    check(not sub.since(n1), f"events for prefix hits: {names(sub.since(n1))}")
    # distinct prompts fill the pool with cached blocks until the oldest goes: vLLM frees a
    # request's uncached (partial) block to the front of the free queue and its cached one to
    # the back, so each request adds one cached block; 15 usable blocks, 16 prompts
    n2 = sub.count()
    others = [prompt(300) for _ in range(NUM_BLOCKS)]
    for p in others:
        srv.complete(p, 2)
    sub.settle()
    evs = sub.since(n2)
    stored_h = {h for e in sub.since(0) if type(e).__name__ == "BlockStored"
                for h in e.block_hashes}
    removed = [h for e in evs if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    new_stored = [e for e in evs if type(e).__name__ == "BlockStored"]
    check(len(new_stored) == len(others) and
          [e.token_ids for e in new_stored] == [p[:BLOCK] for p in others],
          f"stores of the distinct prompts: {names(evs)}")
    check(h_a in removed, f"the first prompt's block {h_a!r} was not reported removed: "
          f"removed {removed[:20]!r}; events {names(evs)}")
    check(set(removed) <= stored_h, "a removed block was never reported stored")
    check(len(removed) == len(set(removed)), "a block reported removed twice")
    # the prefix cache agrees: the first prompt misses now and is stored again
    n3 = sub.count()
    r_miss = srv.complete(a, 2)
    sub.settle()
    restored = [e for e in sub.since(n3) if type(e).__name__ == "BlockStored"]
    check(cached(r_miss) == 0, f"evicted prompt still had {cached(r_miss)} cached tokens")
    check(len(restored) == 1 and restored[0].block_hashes == [h_a] and
          restored[0].token_ids == a[:BLOCK], f"re-store: {names(sub.since(n3))}")
    # /reset_prefix_cache: AllBlocksCleared
    import requests

    # (vLLM queues the event in the block pool and publishes it with the next engine step's
    # events: it arrives with the next request, before that request's stores)
    n4 = sub.count()
    requests.post(srv.base + "/reset_prefix_cache", timeout=60).raise_for_status()
    sub.settle()
    res["clear_published_at_reset"] = "AllBlocksCleared" in names(sub.since(n4))
    r_reset = srv.complete(a, 2)
    sub.settle()
    after = names(sub.since(n4))
    check(after[:2] == ["AllBlocksCleared", "BlockStored"], f"reset: {after}")
    check(cached(r_reset) == 0, "a hit after /reset_prefix_cache")
    kinds = {}
    for e in sub.since(0):
        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    res["kv_events"] = {"kinds": kinds, "removed": len(removed)}
    print("kv events OK", json.dumps(res["kv_events"]), flush=True)


def server_mode() -> dict:
    path = save_tiny_model(tempfile.mkdtemp(prefix="tiny-llama-llmd-"), "llama")
    kv_port = free_port()
    kv_cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{kv_port}", "topic": "kv"}
    srv = Server(path, [
        "--max-model-len", "512", "--max-num-seqs", str(MAX_RUNNING),
        "--max-num-batched-tokens", "64", "--block-size", str(BLOCK),
        "--kv-cache-memory-bytes", str(NUM_BLOCKS * BLOCK * BYTES_PER_TOKEN),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(kv_cfg)], env={"VLLM_SERVER_DEV_MODE": "1"})
    sub = Subscriber(kv_port)
    res: dict = {}
    try:
        res["startup_s"] = round(srv.wait_ready(), 1)
        print(f"server ready in {res['startup_s']} s", flush=True)
        rng = random.Random(1)
        prompts = [[rng.randrange(7, 7 + len(WORDS)) for _ in range(8 + i)] for i in range(5)]
        metrics_under_load(srv, prompts, res)
        kv_events(srv, sub, res)
    except BaseException:
        print(srv.tail(), flush=True)
        raise
    finally:
        sub.close()
        srv.stop()
    return res


def kvpub_mode() -> dict:
    """vLLM's ZmqEventPublisher binds an endpoint with a wildcard host (the default,
    ``tcp://*:5557``) and *connects* to any other: a subscriber connecting to 127.0.0.1
    receives events only from the wildcard spelling."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVEventBatch

    res = {}
    for spelling in ("wildcard", "loopback"):
        port = free_port()
        host = "*" if spelling == "wildcard" else "127.0.0.1"
        cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                             endpoint=f"tcp://{host}:{port}", topic="kv")
        pub = EventPublisherFactory.create(cfg)
        sub = Subscriber(port)
        try:
            time.sleep(0.5)  # a SUB socket misses what is published before it joins
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 3 and not sub.count():
                pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                    block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None)]))
                time.sleep(0.2)
            res[spelling] = sub.count()
        finally:
            sub.close()
            pub.shutdown()
    check(res["wildcard"] > 0, f"nothing received from a bound publisher: {res}")
    check(res["loopback"] == 0, f"a connecting publisher reached a connecting subscriber: {res}")
    # publisher "zmq" alone does not turn events on: the engine emits them only with
    # enable_kv_cache_events (a publisher bound with nothing to send)
    only_pub = KVEventsConfig(publisher="zmq")
    res["publisher_only_enables_events"] = bool(only_pub.enable_kv_cache_events)
    print("kvpub OK", flush=True)
    return res


def pd_mode() -> dict:
    """Prefill/decode disaggregation on one host: a prefill and a decode server on "tpu",
    both with vLLM's shared-storage connector (``ExampleConnector``) on one folder. A request
    goes to the prefill server with max_tokens=1 (its prompt's KV is written to the folder),
    then to the decode server, which loads the prompt's whole blocks from there instead of
    computing them. The decode server's tokens must equal one instance's (the prefill server
    asked for the whole continuation, and transformers on CPU); a control with the stored KV
    overwritten by zeros must change them (the decode server really used the files)."""
    import glob

    import safetensors.torch
    import torch
    from tiny_models import hf_greedy

    path = save_tiny_model(tempfile.mkdtemp(prefix="tiny-llama-pd-"), "llama")
    store = tempfile.mkdtemp(prefix="kv-store-")
    common = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
              "--kv-cache-memory-bytes", str(8 << 20), "--enable-prefix-caching"]
    if "eager" in sys.argv[2:]:
        common.append("--enforce-eager")

    def kv_cfg(role):
        return json.dumps({"kv_connector": "ExampleConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shared_storage_path": store}})

    prefill = Server(path, [*common, "--kv-transfer-config", kv_cfg("kv_producer")],
                     name="prefill")
    decode = Server(path, [*common, "--kv-transfer-config", kv_cfg("kv_consumer")],
                    name="decode")
    rng = random.Random(2)
    N = 12
    prompts = [[rng.randrange(7, 7 + len(WORDS)) for _ in range(n)] for n in (40, 57, 23)]
    control = [rng.randrange(7, 7 + len(WORDS)) for _ in range(45)]
    res: dict = {}
    try:
        res["startup_s"] = [round(prefill.wait_ready(), 1), round(decode.wait_ready(), 1)]
        print(f"servers ready in {res['startup_s']} s", flush=True)
        hf = hf_greedy(path, prompts + [control], N)
        toks = lambda r: r["choices"][0]["token_ids"]  # noqa: E731
        want = [list(h) for h in hf]

        def by_source(srv):
            import requests

            out = {}
            for line in requests.get(srv.base + "/metrics", timeout=30).text.splitlines():
                if line.startswith("vllm:prompt_tokens_by_source_total{"):
                    src = line.split('source="')[1].split('"')[0]
                    out[src] = out.get(src, 0.0) + float(line.rsplit(" ", 1)[1])
            return out

        loaded, prefill_ext = [], []
        for i, p in enumerate(prompts):
            # the prefill server computes the prompt (one instance: nothing loaded) and, as
            # the KV producer, writes its KV; a PD proxy would ask it for 1 token
            s0 = by_source(prefill)
            single = prefill.complete(p, N, return_token_ids=True)
            prefill_ext.append(by_source(prefill).get("external_kv_transfer", 0)
                               - s0.get("external_kv_transfer", 0))
            check(glob.glob(os.path.join(store, "*", "*.safetensors")),
                  "the prefill server stored nothing")
            d0 = by_source(decode)
            got = decode.complete(p, N, return_token_ids=True)
            loaded.append(int(by_source(decode).get("external_kv_transfer", 0)
                              - d0.get("external_kv_transfer", 0)))
            check(toks(single) == want[i], f"prompt {i}: one instance {toks(single)} != HF")
            check(toks(got) == toks(single), f"prompt {i}: decode {toks(got)} != {toks(single)}")
        # ExampleConnector loads the prompt's whole blocks short of its last token
        expect = [(len(p) - 2) // 16 * 16 for p in prompts]
        check(prefill_ext == [0] * len(prompts), f"the prefill server loaded {prefill_ext}")
        check(loaded == expect, f"tokens loaded by the decode server {loaded} != {expect}")
        res["decode_loaded_tokens"] = loaded
        print("pd OK", json.dumps(res), flush=True)
        # control: the stored KV zeroed, the decode server's continuation changes
        before = set(glob.glob(os.path.join(store, "*")))
        prefill.complete(control, 1)
        new = set(glob.glob(os.path.join(store, "*"))) - before
        check(len(new) == 1, f"control stored {len(new)} folders")
        for f in glob.glob(os.path.join(new.pop(), "*.safetensors")):
            t = safetensors.torch.load_file(f)["kv_cache"]
            safetensors.torch.save_file({"kv_cache": torch.zeros_like(t)}, f)
        got = toks(decode.complete(control, N, return_token_ids=True))
        res["control_differs"] = got != want[-1]
        check(res["control_differs"], "zeroed KV files gave the same tokens: not used?")
        print("pd control OK", flush=True)
    except BaseException:
        print(prefill.tail(), "\n----\n", decode.tail(), flush=True)
        raise
    finally:
        prefill.stop()
        decode.stop()
    return res


if __name__ == "__main__":
    mode = sys.argv[1]
    out = {"server": server_mode, "kvpub": kvpub_mode, "pd": pd_mode}[mode]()
    print("RESULT " + json.dumps(out), flush=True)
    print("ALL OK", flush=True)
