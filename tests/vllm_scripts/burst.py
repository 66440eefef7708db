"""vLLM's OpenAI server on "tpu" under a bounded burst (run by tests/test_vllm.py in the vLLM
virtualenv).

    python burst.py

Starts ``python -m vllm.entrypoints.openai.api_server`` (VLLM_TARGET_DEVICE=tpu, compiled) with
a tiny random-weight Llama and a KV cache too small for the burst (15 usable blocks of 16 tokens for
up to 16 running sequences: the scheduler preempts and recomputes), then sends at once 64
greedy completions (half streamed), 8 streams dropped after their second chunk and 8 malformed
requests. Every valid request's text must equal the same request served alone afterwards,
every malformed one must get a 4xx, the server must stay healthy, and once the burst is over
the KV cache usage gauge must be back to 0 (dropped streams and finished requests free their
blocks). Prints "ALL OK".
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
sys.path.insert(0, os.path.dirname(__file__))
from openai_server import openai_server  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

import requests  # noqa: E402

N_VALID, N_DROP, N_BAD, TOKENS = 64, 8, 8, 12
path = save_tiny_model(tempfile.mkdtemp(prefix="tiny-llama-burst-"), "llama")
FLAGS = ["--served-model-name", "tiny", "--max-model-len", "128", "--max-num-seqs", "16",
         "--max-num-batched-tokens", "128", "--num-gpu-blocks-override", "16",
         "--block-size", "16", "--no-enable-prefix-caching"]
base = ""


def complete(prompt, stream=False, drop_after=None):
    body = dict(model="tiny", prompt=prompt, max_tokens=TOKENS, temperature=0.0,
                ignore_eos=True, stream=stream)
    r = requests.post(base + "/v1/completions", json=body, stream=stream, timeout=600)
    r.raise_for_status()
    if not stream:
        return r.json()["choices"][0]["text"]
    text, chunks = [], 0
    for line in r.iter_lines():
        if not line or not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        text.append(json.loads(line[6:])["choices"][0]["text"])
        chunks += 1
        if drop_after is not None and chunks >= drop_after:
            r.close()  # the client goes away mid-stream
            return None
    return "".join(text)


def metric(name: str) -> float:
    """A gauge or counter of /metrics (summed over its label sets)."""
    vals = [float(line.rsplit(" ", 1)[1])
            for line in requests.get(base + "/metrics", timeout=30).text.splitlines()
            if line.startswith(name) and not line.startswith("#")
            and line[len(name)] in "{ _" and not line[len(name):].startswith("_created")]
    assert vals, f"no {name} in /metrics"
    return sum(vals)


def usage() -> float:
    return metric("vllm:kv_cache_usage_perc")


BAD = [dict(model="tiny", prompt="hello", max_tokens=-3),
       dict(model="tiny", prompt="hello", temperature=-1.0),
       dict(model="no-such-model", prompt="hello", max_tokens=4),
       dict(model="tiny", max_tokens=4),
       dict(model="tiny", prompt="hello", max_tokens=4, top_p=7.0),
       dict(model="tiny", prompt=[10 ** 9], max_tokens=4),
       dict(model="tiny", prompt="hello " * 400, max_tokens=4),
       "{not json"]


def bad(body):
    if isinstance(body, str):
        r = requests.post(base + "/v1/completions", data=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    else:
        r = requests.post(base + "/v1/completions", json=body, timeout=60)
    return r.status_code


with openai_server(path, *FLAGS) as srv:
    base = srv.base
    words = ["the cat sat on the mat", "hello world how are you", "red blue green",
             "one two three four", "my friend ran fast", "good day sun moon star"]
    prompts = [" ".join(words[i % 6:] + words[:i % 6])[: 20 + 3 * (i % 17)]
               for i in range(N_VALID)]
    with cf.ThreadPoolExecutor(N_VALID + N_DROP + N_BAD) as ex:
        valid = [ex.submit(complete, p, i % 2 == 1) for i, p in enumerate(prompts)]
        drops = [ex.submit(complete, prompts[i], True, 2) for i in range(N_DROP)]
        bads = [ex.submit(bad, b) for b in BAD[:N_BAD]]
        got = [f.result() for f in valid]
        [f.result() for f in drops]
        codes = [f.result() for f in bads]
    assert all(400 <= c < 500 for c in codes), f"malformed requests answered {codes}"
    print(f"burst answered: {len(got)} valid, malformed -> {codes}", flush=True)
    assert requests.get(base + "/health", timeout=10).status_code == 200
    alone = [complete(p) for p in prompts]
    diff = [i for i, (a, b) in enumerate(zip(got, alone)) if a != b]
    assert not diff, f"requests {diff} differ from the same request alone: " \
                     f"{[(got[i], alone[i]) for i in diff[:3]]}"
    print("burst outputs equal to each request alone OK", flush=True)
    pre = metric("vllm:num_preemptions")
    assert pre > 0, "the small KV cache never preempted: the burst did not test recompute"
    print(f"preemptions: {pre:.0f}", flush=True)
    for _ in range(60):
        u = usage()
        if u == 0.0:
            break
        time.sleep(0.5)
    assert u == 0.0, f"kv_cache_usage_perc {u} after every request finished"
    print("KV blocks freed OK", flush=True)
print("ALL OK", flush=True)
