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

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, os.path.dirname(__file__))
from burst_client import burst, metric, wait_for_zero  # noqa: E402
from openai_server import openai_server  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

N_VALID, N_DROP, N_BAD, TOKENS = 64, 8, 8, 12
path = save_tiny_model(tempfile.mkdtemp(prefix="tiny-llama-burst-"), "llama")
FLAGS = ["--served-model-name", "tiny", "--max-model-len", "128", "--max-num-seqs", "16",
         "--max-num-batched-tokens", "128", "--num-gpu-blocks-override", "16",
         "--block-size", "16", "--no-enable-prefix-caching"]

with openai_server(path, *FLAGS) as srv:
    base = srv.base
    burst(base, "tiny", N_VALID, N_DROP, N_BAD, TOKENS)  # the client: tests/burst_client.py
    pre = metric(base, "vllm:num_preemptions")
    assert pre > 0, "the small KV cache never preempted: the burst did not test recompute"
    print(f"preemptions: {pre:.0f}", flush=True)
    u = wait_for_zero(base, "vllm:kv_cache_usage_perc")
    assert u == 0.0, f"kv_cache_usage_perc {u} after every request finished"
    print("KV blocks freed OK", flush=True)
print("ALL OK", flush=True)
