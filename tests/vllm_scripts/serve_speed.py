"""A served stream's per-token time against the offline engine's decode step, measured in one run
(run by tests/test_vllm.py in the vLLM virtualenv).

    python serve_speed.py

1. Offline (``LLM``, engine in this process): a tiny float32 Llama (2 layers, head dim 64) with
   vLLM's default dtype ("auto"), 8 sequences decoding, the median ``engine.step()`` time; the
   same with ``dtype="bfloat16"`` (a 16-bit checkpoint), whose step must stay within a few times
   the float32 one (XLA:CPU converted the whole bf16 KV cache at every step: ~130x).
2. Served: ``python -m vllm.entrypoints.openai.api_server`` on "tpu" with the flags of the
   issue's report and vLLM's defaults otherwise (dtype, KV cache size, token budget), 8
   concurrent streamed greedy completions of 32 tokens, two rounds; in the second round a
   stream's time per token (its span after the first token / 31) must stay within a few times
   the offline step (it was ~100x: the
   default dtype turned the float32 checkpoint into bf16).
Ratios of times taken in this run, not absolute times: a loaded machine slows both. Prints
"ALL OK".
"""
from __future__ import annotations

import concurrent.futures as cf
import gc
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "tpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
sys.path.insert(0, os.path.dirname(__file__))
from openai_server import openai_server  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

SERVE_RATIO = 5.0  # served ITL p50 / offline decode step, at most
BF16_RATIO = 10.0  # bf16 decode step / float32 decode step, at most (XLA:CPU converts bf16
# operands to float32 around every op: weights included, a few times the float32 step)
STREAMS, TOKENS = 8, 32
BUDGET = 2048  # the API server's default max_num_batched_tokens (same buckets, same programs)
path = save_tiny_model(tempfile.mkdtemp(prefix="tiny-llama-speed-"), "llama", layers=2,
                       hidden=256, heads=4, kv_heads=2, intermediate=512)
PROMPTS = [" ".join(["the cat sat on the mat"] * k) for k in range(1, 1 + STREAMS)]


def offline_step(dtype: str) -> float:
    """Median seconds of an engine step while STREAMS sequences decode."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=BUDGET, kv_cache_memory_bytes=64 << 20, seed=0)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0)
    llm.generate(PROMPTS, sp, use_tqdm=False)  # warm-up round
    medians = []
    for r in range(2):
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{r}-{i}", p, sp)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times[2:]))  # past the prefill
    model_dtype = str(llm.llm_engine.vllm_config.model_config.dtype)
    del llm, engine
    gc.collect()
    return min(medians), model_dtype


f32, auto_dtype = offline_step("auto")
assert auto_dtype == "torch.float32", f"dtype=auto made the float32 checkpoint {auto_dtype}"
print(f"offline step (dtype auto -> {auto_dtype}): {f32 * 1e3:.2f} ms", flush=True)
bf16, _ = offline_step("bfloat16")
print(f"offline step bfloat16: {bf16 * 1e3:.2f} ms ({bf16 / f32:.1f}x float32), "
      f"load {os.getloadavg()}", flush=True)
assert bf16 <= BF16_RATIO * f32, f"a bf16 step costs {bf16 / f32:.1f}x a float32 step"
print("bf16 step OK", flush=True)

# the server as a user starts it (engine core in its own process), the flags
with openai_server(path, "--served-model-name", "tiny", "--max-model-len", "256",
                   "--max-num-seqs", "16") as srv:
    import openai

    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", timeout=300)

    def stream(p):
        t = time.perf_counter()
        marks = []
        for c in client.completions.create(model="tiny", prompt=p, max_tokens=TOKENS,
                                           temperature=0.0, stream=True,
                                           extra_body={"min_tokens": TOKENS}):
            if c.choices and c.choices[0].text:
                marks.append(time.perf_counter() - t)
        return marks

    for _ in range(2):  # the first round warms the server's own paths
        with cf.ThreadPoolExecutor(STREAMS) as ex:
            res = list(ex.map(stream, PROMPTS))
    # per-token time of a stream: its span after the first token over the tokens that
    # followed (a gap between chunks is ~0 where the server sends several at once)
    assert all(len(m) > 1 for m in res), [len(m) for m in res]
    itl = statistics.median((m[-1] - m[0]) / (TOKENS - 1) for m in res)
    gap = statistics.median(b - a for m in res for a, b in zip(m, m[1:]))
    ttft = statistics.median(m[0] for m in res)
    print(f"served: TTFT {ttft * 1e3:.0f} ms, per token {itl * 1e3:.2f} ms = "
          f"{itl / f32:.1f}x the offline step (median chunk gap {gap * 1e3:.2f} ms), "
          f"load {os.getloadavg()}", flush=True)
    assert itl <= SERVE_RATIO * f32, \
        f"a served token costs {itl / f32:.1f}x the offline step ({itl * 1e3:.1f} ms)"
    print("served ITL OK", flush=True)
print("ALL OK", flush=True)
