"""The client side of the server burst checks, shared by vLLM's (tests/vllm_scripts/burst.py)
and SGLang's (tests/sglang_check.py ``burst``) OpenAI servers: greedy completions sent at once
(half streamed), streams dropped mid-way, malformed requests; then each valid request again
alone, one after the other. Only ``requests`` and the standard library: it runs in either venv.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import requests

_WORDS = ["the cat sat on the mat", "hello world how are you", "red blue green",
          "one two three four", "my friend ran fast", "good day sun moon star"]


def prompts(n: int) -> list[str]:
    """``n`` prompts of different lengths (20 .. 68 characters) and beginnings."""
    return [" ".join(_WORDS[i % 6:] + _WORDS[:i % 6])[: 20 + 3 * (i % 17)] for i in range(n)]


def malformed(model: str, checks_model: bool = True) -> list:
    """Requests every OpenAI server must answer with a 4xx: a token id outside the vocabulary,
    a body that is not JSON, bad sampling values, an unknown model, no prompt, a prompt longer
    than the context (the first two are what a smaller burst sends). A server that serves
    one model under any name (``checks_model=False``: SGLang ignores the request's ``model``)
    gets a ``max_tokens`` of the wrong type instead of the unknown model."""
    return [dict(model=model, prompt=[10 ** 9], max_tokens=4),
            "{not json",
            dict(model=model, prompt="hello", max_tokens=-3),
            dict(model=model, prompt="hello", temperature=-1.0),
            dict(model="no-such-model", prompt="hello", max_tokens=4) if checks_model else
            dict(model=model, prompt="hello", max_tokens="four"),
            dict(model=model, max_tokens=4),
            dict(model=model, prompt="hello", max_tokens=4, top_p=7.0),
            dict(model=model, prompt="hello " * 2000, max_tokens=4)]


def complete(base: str, model: str, prompt, tokens: int, stream: bool = False,
             drop_after: int | None = None, ignore_eos: bool = True):
    """The text of one greedy completion; with ``drop_after``, the client goes away after
    that many streamed chunks (returns None)."""
    body = dict(model=model, prompt=prompt, max_tokens=tokens, temperature=0.0,
                ignore_eos=ignore_eos, stream=stream)
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


def _post_bad(base: str, body) -> int:
    if isinstance(body, str):
        r = requests.post(base + "/v1/completions", data=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    else:
        r = requests.post(base + "/v1/completions", json=body, timeout=60)
    return r.status_code


def metric(base: str, name: str) -> float:
    """A gauge or counter of /metrics (summed over its label sets)."""
    vals = [float(line.rsplit(" ", 1)[1])
            for line in requests.get(base + "/metrics", timeout=30).text.splitlines()
            if line.startswith(name) and not line.startswith("#")
            and line[len(name)] in "{ _" and not line[len(name):].startswith("_created")]
    assert vals, f"no {name} in /metrics"
    return sum(vals)


def wait_for_zero(base: str, name: str, seconds: float = 30) -> float:
    """The metric ``name`` once it reads 0, or its last value after ``seconds``."""
    t = time.time()
    while True:
        v = metric(base, name)
        if v == 0.0 or time.time() - t > seconds:
            return v
        time.sleep(0.5)


def burst(base: str, model: str, n_valid: int, n_drop: int, n_bad: int, tokens: int,
          checks_model: bool = True, ignore_eos: bool = True) -> dict:
    """Everything at once, then each valid prompt alone. Raises (AssertionError) if a
    malformed request is not answered with a 4xx, the server is not healthy afterwards, or a
    valid answer differs from the same request alone; returns what was seen. ``ignore_eos``:
    every answer ``tokens`` long (else greedy stops at the end-of-sequence token, the same
    one alone)."""
    ps = prompts(n_valid)
    bad = malformed(model, checks_model)[:n_bad]
    t = time.time()
    with cf.ThreadPoolExecutor(n_valid + n_drop + n_bad) as ex:
        valid = [ex.submit(complete, base, model, p, tokens, i % 2 == 1, None, ignore_eos)
                 for i, p in enumerate(ps)]
        drops = [ex.submit(complete, base, model, ps[i], tokens, True, 2, ignore_eos)
                 for i in range(n_drop)]
        bads = [ex.submit(_post_bad, base, b) for b in bad]
        got = [f.result() for f in valid]
        [f.result() for f in drops]
        codes = [f.result() for f in bads]
    burst_s = time.time() - t
    wrong = [(b, c) for b, c in zip(bad, codes) if not 400 <= c < 500]
    assert not wrong, f"malformed requests not answered with a 4xx: {wrong}"
    print(f"burst answered: {len(got)} valid, malformed -> {codes}", flush=True)
    assert requests.get(base + "/health", timeout=10).status_code == 200
    alone = [complete(base, model, p, tokens, ignore_eos=ignore_eos) for p in ps]
    diff = [i for i, (a, b) in enumerate(zip(got, alone)) if a != b]
    assert not diff, f"requests {diff} differ from the same request alone: " \
                     f"{[(got[i], alone[i]) for i in diff[:3]]}"
    print("burst outputs equal to each request alone OK", flush=True)
    return {"got": got, "alone": alone, "codes": codes, "burst_s": burst_s}
