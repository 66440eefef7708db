"""The llm-d model-server contract for vLLM's OpenAI server on "tpu" (issue #27's vLLM part).

llm-d (an inference scheduler in front of vLLM pods) asks of a model server: Prometheus gauges
of queued and running requests and KV-cache use, KV-cache events over ZMQ, and KV transfer
between a prefill and a decode instance. Each check runs tests/vllm_scripts/llmd.py in the vLLM
virtualenv (``make venv-vllm``), bounded in time, its process group killed at the end (see
test_vllm.run_script).

Default run: vLLM's ZMQ event publisher and a subscriber on 127.0.0.1 (no model, ~20 s).
Slow (``--runslow``, a few minutes each): a server under a bounded request loop (gauges exact,
KV events matching the prefix cache), and a prefill/decode pair through vLLM's shared-storage
connector (tokens equal to one instance).
"""
from __future__ import annotations

import json

import pytest

from test_vllm import needs_venv, run_script


def _result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@needs_venv
def test_kv_event_publisher_binds_only_a_wildcard_endpoint():
    """vLLM's ZmqEventPublisher binds ``tcp://*:P`` (its default spelling) and connects to
    ``tcp://127.0.0.1:P``: a subscriber connecting to 127.0.0.1 gets events only from the
    first. A publisher config without ``enable_kv_cache_events`` publishes nothing at all."""
    res = _result(run_script("llmd.py", "kvpub", timeout=300))
    assert res["wildcard"] > 0 and res["loopback"] == 0, res
    assert res["publisher_only_enables_events"] is False, res


@needs_venv
@pytest.mark.slow
def test_server_metrics_exact_under_load_and_kv_events():
    """`/metrics` scraped while a bounded request loop runs (max_num_seqs 2, 5 requests):
    running / waiting / kv_cache_usage_perc are exactly 2/0/2 blocks, then 2/3/2 blocks, and
    every scrape is a state the scheduler can be in; 0/0/0 when idle. KV events over ZMQ:
    BlockStored with the prompt's tokens, nothing for prefix hits, BlockRemoved when the block
    is evicted (the prompt then misses), AllBlocksCleared on /reset_prefix_cache."""
    out = run_script("llmd.py", "server", timeout=1200)
    res = _result(out)
    m = res["metrics"]
    assert m["after_5_sent"][:2] == [2, 3] and m["idle"] == [0, 0, 0.0], m
    k = res["kv_events"]["kinds"]
    assert k.get("BlockStored", 0) >= 18 and k.get("BlockRemoved", 0) >= 1, k
    assert k.get("AllBlocksCleared", 0) >= 1, k


@needs_venv
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_prefill_decode_disaggregation_shared_storage(mode):
    """A prefill and a decode server on "tpu" with vLLM's shared-storage connector
    (ExampleConnector, no RDMA): the decode server loads each prompt's whole blocks from the
    prefill server's files and its greedy tokens equal one instance's (and transformers' on
    CPU); zeroed files change them (the transfer is used)."""
    res = _result(run_script("llmd.py", "pd", *(["eager"] if mode == "eager" else []),
                             timeout=1500))
    assert res["decode_loaded_tokens"] == [32, 48, 16], res
    assert res["control_differs"] is True, res
