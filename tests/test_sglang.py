"""SGLang on "tpu" (torchtpu.sglang): the engine and server checked against transformers on CPU.

SGLang lives in its own virtualenv (``make venv-sglang`` -> .venv-sglang; ``make test`` builds
it first); each check runs there as a subprocess (tests/sglang_check.py), bounded in time and
killed with its whole session if it overruns. Without that venv the tests skip, saying so.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from dist_launch import child_env, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SGLANG_PY = os.environ.get("TORCHTPU_SGLANG_PYTHON",
                           os.path.join(ROOT, ".venv-sglang", "bin", "python"))
CHECK = os.path.join(HERE, "sglang_check.py")

needs_sglang = pytest.mark.skipif(
    not os.path.exists(SGLANG_PY),
    reason=f"SGLang's virtualenv is absent ({SGLANG_PY}): build it with `make venv-sglang`")


def sglang_check(*args, timeout=900, env=None):
    """Run ``sglang_check.py args`` in the SGLang venv; its JSON result."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # prefill buckets warmed at start-up up to 64 tokens (the checks' prompts are shorter;
    # the default, SGLang's chunked-prefill size, compiles 14 programs)
    env = child_env(PYTHONPATH=path, **{"TORCHTPU_SGLANG_PREFILL_WARMUP_TOKENS": "64",
                                        **(env or {})})
    rc, out = run([SGLANG_PY, CHECK, *args], timeout, env)
    lines = [ln for ln in out.splitlines() if ln.startswith("SGLANG_CHECK ")]
    assert rc == 0 and lines, f"sglang_check {args} exited {rc}:\n{out[-6000:]}"
    return json.loads(lines[-1][len("SGLANG_CHECK "):])


# decode buckets 1, 2, 4 (the default, 1..16, compiles 5 programs at start-up). Without the
# overlap scheduler, which processes a step's results during the next step's forward: each
# step is then charged its own work (with it, the prefill's radix-cache bookkeeping lands in
# the first decode steps; docs/notes/sglang.md)
BUCKETS = json.dumps({"cuda_graph_max_bs_decode": 4, "disable_overlap_schedule": True})


def _check_engine(r, n=8, compiled=True, layers=2):
    assert r["platform"] == "TpuSRTPlatform"
    assert r["greedy"] == r["hf"]
    # the same prompts again: served from the radix cache (all but the last prompt token)
    assert r["greedy_again"] == r["hf"]
    assert r["greedy_third"] == r["hf"]
    assert all(c > 0 for c in r["cached_tokens"]), r["cached_tokens"]
    assert all(len(s) == n for s in r["sampled"]) and r["sampled"] != r["hf"]
    # attention over torch.tpu.ops' paged attention, on the pool in its page layout
    assert r["worker"]["attention"] == "TpuPagedAttnBackend", r["worker"]
    assert r["worker"]["kv_pool"] == "TpuPagedKVPool", r["worker"]
    if compiled:
        _check_compiled_decode(r, layers)
    else:
        assert r["worker"]["graph_runner"] in ("NoneType", "TpuGraphRunner"), r["worker"]
        assert r["worker"]["graph_bs"] == [], r["worker"]  # no bucket: decode runs eagerly
        assert r["third_round"]["forwards"].get("graph", 0) == 0, r["third_round"]


def _check_compiled_decode(r, layers):
    """Decode through the warmed buckets (graph_runner.py): in the third round every decode
    forward is a bucket's compiled program, and a decode step (from one decode forward to the
    next: sampling, bookkeeping, the forward) compiles nothing (XLA or Dynamo), syncs with
    the host once (the sampled ids) and donates each layer's KV pages to the program."""
    assert r["worker"]["graph_runner"] == "TpuGraphRunner", r["worker"]
    # each bucket's decode forward is ONE Dynamo graph, without a graph break inside the model
    # (SGLang's layer-boundary records: torchtpu/sglang/dynamo_compat.py), and a warmed
    # bucket called again traces nothing
    dyn = r["worker"]["graph_dynamo"]
    # a start from a filled compile cache leaves the buckets the last run did not serve to
    # the idle scheduler (torchtpu/sglang/working_set.py): those not warmed yet are pending
    pending = r["worker"]["deferred"]["pending"]
    assert sorted(k for k in dyn if k != "rerun") == sorted(
        str(b) for b in r["worker"]["graph_bs"] if f"decode {b}" not in pending), (dyn, pending)
    for bs, d in dyn.items():
        want = {"graph_breaks": 0, "graphs": 0 if bs == "rerun" else 1}
        assert {k: d[k] for k in want} == want, (bs, dyn)
    # prefill (extend) too: one graph per (tokens, requests) bucket, no break, and every
    # extend step of the third round ran through a bucket's program (prefill.py)
    pre = r["worker"]["prefill_dynamo"]
    assert pre, r["worker"]
    for key, d in pre.items():
        assert (d["graph_breaks"], d["graphs"]) == (0, 1), (key, pre)
    # every prefill program was compiled at start-up (prefill.warm_up): the requests' extend
    # steps, with and without a cached prefix, met no bucket of their own
    assert r["worker"]["prefill_warmed"] and sorted(pre) == sorted(
        r["worker"]["prefill_warmed"]), r["worker"]
    third = r["third_round"]
    assert third["forwards"]["extend"] > 0
    assert third["forwards"].get("prefill_graph", 0) == third["forwards"]["extend"], third
    assert third["forwards"]["decode"] > 0
    assert third["forwards"].get("graph", 0) == third["forwards"]["decode"], third
    n = third["intervals"].get("decode", 0)
    assert n > 0, third
    d = third["decode"]
    # compiles in the step's path (a program built on a worker while a bookkeeping call ran
    # on the host, eager/deferred.py, is not)
    xla = sum(v for k, v in d.items() if k.endswith("xla_compiles")) - sum(
        v for k, v in d.items() if k.endswith("xla_compiles_off_path"))
    assert xla == 0 and d.get("compile_graphs", 0) == 0, third
    assert d.get("host_syncs", 0) <= n, third
    assert d.get("compile_donated_buffers", 0) == layers * n, third


@needs_sglang
def test_engine_greedy_batch_radix_cache(tmp_path):
    """A tiny Llama: a batch of greedy prompts equals HF on CPU, then again from the radix
    prefix cache, and sampling runs (in the default suite)."""
    _check_engine(sglang_check("engine", "--arch", "llama", "--out", str(tmp_path),
                               "--engine-args", BUCKETS))


@pytest.mark.slow
@needs_sglang
def test_engine_bfloat16_pool_stored_float32(tmp_path):
    """A bf16 model: tokens equal HF's in bf16 on CPU, compiled decode as in float32, and on
    XLA:CPU the pool is stored as float32 (XLA:CPU would convert a bf16 pool whole, to float32
    and back, in every step: tests/test_vllm_paged_attention.py checks the step's HLO), with
    SGLang's KV byte budget halved for it (MLA pools and float32 models unchanged)."""
    r = sglang_check("engine", "--arch", "llama", "--out", str(tmp_path), "--engine-args",
                     json.dumps({**json.loads(BUCKETS), "dtype": "bfloat16"}))
    _check_engine(r)
    assert r["worker"]["kv_dtype"] == "torch.float32", r["worker"]
    assert r["worker"]["max_total_num_tokens"] == 4096, r["worker"]
    half = (1 << 20) // 2
    assert r["budget"] == {"float32": None, "float32-mla": None, "bfloat16": half,
                           "bfloat16-mla": None, "float16": half, "float16-mla": None}, r


@pytest.mark.slow
@needs_sglang
def test_engine_overlap_schedule_copies_results_on_a_thread(tmp_path):
    """SGLang's overlap scheduler (its default) with TORCHTPU_SGLANG_ASYNC_D2H=1: a step's
    sampled ids are read back on torchtpu.sglang.overlap's copy thread (SGLang's async device-to-host path), not on the
    scheduler's thread right after the launch; tokens equal HF in every round, every decode
    forward is a bucket's program, at most one host sync per decode step."""
    r = sglang_check("engine", "--arch", "llama", "--out", str(tmp_path), "--engine-args",
                     json.dumps({"cuda_graph_max_bs_decode": 4}),
                     env={"TORCHTPU_SGLANG_ASYNC_D2H": "1"})
    assert r["greedy"] == r["hf"] and r["greedy_again"] == r["hf"], r
    assert r["greedy_third"] == r["hf"], r
    third = r["third_round"]
    assert third["forwards"]["decode"] > 0
    assert third["forwards"].get("graph", 0) == third["forwards"]["decode"], third
    d = third["decode"]
    assert d.get("sglang_thread_result_copies", 0) > 0, third
    assert d.get("host_syncs", 0) <= third["intervals"]["decode"], third


@pytest.mark.slow
@needs_sglang
def test_engine_eager_paged_attention(tmp_path):
    """``--disable-cuda-graph``: decode runs eagerly, through the same paged attention."""
    _check_engine(sglang_check("engine", "--arch", "llama", "--out", str(tmp_path),
                               "--engine-args", json.dumps({"disable_cuda_graph": True})),
                  compiled=False)


@pytest.mark.slow
@needs_sglang
def test_engine_qwen_seeded_twice_from_compile_cache(tmp_path):
    """A tiny Qwen2 (qkv biases), twice in fresh processes sharing one compile cache folder:
    both equal HF greedy, and the seeded sampling (engine random_seed) is the same tokens; the
    second start compiles nothing and warms only the first run's working set before it is
    ready, the other buckets while idle."""
    cache = tmp_path / "cache"
    env = {"TORCHTPU_CACHE_DIR": str(cache)}
    first = sglang_check("engine", "--arch", "qwen2", "--out", str(tmp_path),
                         "--engine-args", BUCKETS, env=env)
    assert any(cache.iterdir()), "the first process wrote no compile cache entry"
    second = sglang_check("engine", "--arch", "qwen2", "--out", str(tmp_path),
                         "--engine-args", BUCKETS, env=env)
    _check_engine(first)
    _check_engine(second)
    assert first["sampled"] == second["sampled"]
    # the first start warmed every bucket; the second (the compile cache filled) compiled
    # nothing and warmed before it was ready only the buckets the first served, the others
    # deferred to the idle scheduler (torchtpu/sglang/working_set.py)
    assert first["worker"]["deferred"]["decode"] == [] == first["worker"]["deferred"]["prefill"]
    assert second["worker"]["xla_compiles"] == 0, second["worker"]
    deferred = second["worker"]["deferred"]
    assert deferred["decode"] and deferred["prefill"], deferred


@pytest.mark.slow
@needs_sglang
def test_server_openai_metrics_kv_events(tmp_path):
    """``launch_server --device tpu``: completions, chat and streaming equal HF greedy; the
    llm-d contract: /metrics scraped while 5 requests run with --max-running-requests 2 shows
    2 running and 3 queued, KV usage between what the running requests hold at least and at
    most, and 0/0 when idle; KV-cache events over ZMQ: the prompts' blocks stored, a flush
    clears them."""
    r = sglang_check("server", "--arch", "llama", "--out", str(tmp_path), timeout=1500)
    # one word a token (examples/tiny_models.py): equal words are equal token ids; SGLang's
    # incremental detokenizer puts a space before the first word
    assert [t.strip() for t in r["completions_text"]] == r["hf_text"]
    assert "".join(r["stream_chunks"]).strip() == r["hf_text"][0]
    assert r["chat_text"].strip() == r["hf_chat_text"]
    load = r["load"]
    assert all(load["done"])
    k, cap, total = load["k"], load["max_running"], load["max_total"]
    full = [s for s in load["scrapes"] if s["sglang:num_running_reqs"] == cap]
    assert full, load["scrapes"]
    assert any(s["sglang:num_queue_reqs"] == k - cap for s in full), load["scrapes"]
    for s in load["scrapes"]:  # never more running than allowed, never more than sent
        assert s["sglang:num_running_reqs"] <= cap
        assert s["sglang:num_running_reqs"] + s["sglang:num_queue_reqs"] <= k
    # KV tokens held while both run: at least their prompts, at most prompts + all new tokens
    # (+ what was held before the load, e.g. the radix cache's protected nodes)
    base = load["scrapes"][0]["sglang:num_used_tokens"]
    lo = cap * min(load["prompt_lens"])
    hi = base + sum(sorted(load["prompt_lens"])[-cap:]) + cap * load["max_tokens"]
    for s in full:
        assert lo <= s["sglang:num_used_tokens"] <= hi, (lo, hi, s)
        # token_usage is the same count over the pool, as SGLang rounds it (2 decimals)
        assert abs(s["sglang:token_usage"] - s["sglang:num_used_tokens"] / total) <= 0.005
    assert r["idle_metrics"] == {"sglang:num_running_reqs": 0, "sglang:num_queue_reqs": 0}
    assert r["kv_events"].get("BlockStored", 0) > 0, r["kv_events"]
    assert r["kv_events"].get("AllBlocksCleared", 0) > 0, r["kv_events"]
    stored = set(r["kv_stored_tokens"])
    assert all(set(p[:-1]) <= stored for p in r["prompts"])


def _check_burst(r):
    """tests/sglang_check.py ``burst`` (client: tests/burst_client.py, which already raised if
    a malformed request got no 4xx or a valid answer differed from the request alone)."""
    assert r["equal"] and r["healthy"], r
    assert all(r["lens"]), r  # every answer has text (greedy, not ignore_eos: see sglang_check)
    assert all(400 <= c < 500 for c in r["codes"]) and len(r["codes"]) == r["n"][2], r
    # the pool is too small for the burst: SGLang retracted running requests and recomputed them
    assert r["retracted"] > 0, r
    # dropped streams and finished requests gave their KV tokens back
    assert r["idle"] == {"sglang:token_usage": 0.0, "sglang:num_used_tokens": 0.0,
                         "sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0}, r


# decode buckets 1, 2, 4 (as BUCKETS), without the overlap scheduler
BURST_SERVER = json.dumps(["--cuda-graph-max-bs-decode", "4", "--disable-overlap-schedule"])


@needs_sglang
def test_server_small_burst_dropped_malformed(tmp_path):
    """``launch_server --device tpu`` under a small burst: 8 greedy completions at once (half
    streamed), 2 streams dropped mid-way, a prompt token id outside the vocabulary (it crashed
    the scheduler: torchtpu/sglang/input_check.py) and a body that is not JSON, over a KV pool
    of 64 tokens: each answer equals the request alone, both bad ones get a 4xx, the server
    stays healthy and its token usage gauges return to 0."""
    _check_burst(sglang_check("burst", "--out", str(tmp_path), "--n", "8", "--drop", "2",
                              "--bad", "2", "--max-tokens", "12", "--max-total", "64",
                              "--server-args", BURST_SERVER, timeout=1200))


@pytest.mark.slow
@needs_sglang
def test_server_survives_a_burst_with_dropped_and_malformed_requests(tmp_path):
    """The same check as vLLM's (tests/vllm_scripts/burst.py): 64 concurrent completions (half
    streamed), 8 streams dropped mid-way and 8 malformed requests against a KV pool of 192
    tokens: every valid answer equals the request alone (retracted ones recomputed), malformed
    ones get a 4xx, the server stays healthy and the token usage gauges return to 0."""
    _check_burst(sglang_check("burst", "--out", str(tmp_path), "--n", "64", "--drop", "8",
                              "--bad", "8", "--max-tokens", "12", "--max-total", "192",
                              "--server-args", BURST_SERVER, timeout=1800))


@needs_sglang
def test_dynamo_compat_twins_and_skip():
    """SGLang's layer-boundary records replaced by plain classes Dynamo traces (fullgraph: no
    break), same fields and results; a target that is not what is expected (not a
    msgspec.Struct, absent) is left alone with a warning naming it."""
    r = sglang_check("compat", "--out", "unused", timeout=300)
    assert r["replaced"] and r["fields"] == r["orig_fields"] == ["value", "update", "owed"], r
    assert r["compiled_ok"] and r["eager_ok"] and r["exit_rebound"], r
    assert "sglang.srt.layers.layer_boundary.residual.stream.Contribution" in \
        r["report"]["installed"], r
    skipped = r["report"]["skipped"]
    assert "not a msgspec.Struct" in skipped[
        "sglang.srt.layers.layer_boundary.residual.stream.ResidualStream"], r
    assert skipped["sglang.srt.layers.layer_boundary.residual.stream.Moved"] == \
        "class not found", r
    assert any("ResidualStream" in w and "left as is" in w for w in r["warnings"]), r


@needs_sglang
def test_kv_events_publisher_endpoint():
    """Why a subscriber received nothing: SGLang's ZMQ publisher *binds* only an endpoint with
    a wildcard host (``tcp://*:port``) and *connects* to any other, so with
    ``tcp://127.0.0.1:port`` on both sides nobody binds and every event is dropped. With the
    wildcard the subscriber (connecting to 127.0.0.1) receives the published batch."""
    r = sglang_check("kvpub", "--out", "unused", timeout=300)
    assert r["wildcard"] == ["BlockStored", "BlockRemoved"], r
    assert r["loopback"] == [], r


@pytest.mark.slow
@needs_sglang
def test_engine_tp2(tmp_path):
    """``tp_size=2``: two scheduler processes over "tpu_dist" (each joins the JAX job before
    its first device use: torchtpu.sglang.plugin), the same tokens as HF on CPU (so as with
    one rank). Decode and prefill are compiled there too: SGLang's all-reduce and all-gather
    custom ops are lowered (torchtpu/sglang/collectives.py), each bucket one SPMD program."""
    r = sglang_check("engine", "--arch", "llama", "--tp", "2", "--out", str(tmp_path),
                     "--engine-args", BUCKETS, timeout=1500)
    _check_engine(r)
    w = r["worker"]
    assert w["spmd_programs"] >= len(w["graph_bs"]) + len(w["prefill_dynamo"]), w


@pytest.mark.slow
@needs_sglang
def test_prefill_decode_disaggregation(tmp_path):
    """A prefill and a decode ``launch_server`` on one host exchanging the KV cache through the
    ``torchtpu`` transfer backend (host copies through a shared folder, no RDMA): each request
    sent to both with one bootstrap room; the decode instance, which never runs the prompt
    through the model (no extend forward), answers HF's greedy tokens, and no transfer file
    is left behind."""
    r = sglang_check("pd", "--arch", "llama", "--out", str(tmp_path), "--server-args",
                     json.dumps(["--cuda-graph-max-bs-decode", "4"]), timeout=1500)
    assert r["pd"] == r["hf"]
    assert [p[:1] for p in r["prefill_out"]] == [h[:1] for h in r["hf"]]
    assert r["left_in_kv_dir"] == []
    assert r["decode_forwards"].get("extend", 0) == 0, r["decode_forwards"]
    assert r["decode_forwards"]["decode"] > 0
    assert r["prefill_forwards"]["extend"] > 0
    for side in ("prefill", "decode"):
        assert r[f"{side}_worker"]["kv_pool"] == "TpuPagedKVPool", r
    assert r["decode_worker"]["graph_runner"] == "TpuGraphRunner", r


@needs_sglang
def test_server_args_without_device_resolve_on_tpu(tmp_path):
    """``sglang.launch_server`` / ``Engine`` without ``--device``: SGLang resolves the default
    device from the platform's ``get_device()`` and splits it on ":" -- a ``torch.device``
    there crashed every launch without ``--device tpu`` (AttributeError)."""
    code = ("import sys\n"
            f"sys.path.insert(0, {HERE!r})\n"
            "from sglang_check import _model\n"
            "from sglang.srt.server_args import ServerArgs\n"
            "from sglang.srt.arg_groups.serving_hook import handle_missing_default_values\n"
            "from sglang.srt.utils.common import get_device\n"
            f"a = ServerArgs(model_path=_model('llama', {str(tmp_path)!r}), dtype='float32')\n"
            "handle_missing_default_values(a)\n"
            "print('DEVICES', get_device(), get_device(1))\n")
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    rc, out = run([SGLANG_PY, "-c", code], 300, child_env(PYTHONPATH=path))
    assert rc == 0, out[-4000:]
    assert "DEVICES tpu tpu:1" in out, out[-2000:]


def test_is_available_creates_no_backend():
    """``torch.tpu.is_available()`` (and ``torch.accelerator.current_accelerator(
    check_available=True)``, which SGLang calls at import) must not create the JAX backend,
    as CUDA's creates no context: a rank of a multi-process job joins its job before that.
    It created it (rank 1 of SGLang --tp 2 then saw one device)."""
    code = ("import torch, torchtpu\n"
            "from jax._src import xla_bridge as xb\n"
            "from torchtpu.runtime import devices\n"
            "assert torch.tpu.is_available()\n"
            "assert torch.accelerator.current_accelerator(check_available=True).type == 'tpu'\n"
            "print('CREATED', devices.backend_created(), xb.backends_are_initialized())\n")
    env = child_env()
    env.pop("TORCHTPU_PLATFORM", None)
    rc, out = run([sys.executable, "-c", code], 300, env)
    assert rc == 0, out
    assert "CREATED False False" in out, out


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_without_keys_matches_cpu(causal):
    """SDPA over zero keys returns zeros on CPU; on "tpu" the lowering's max over the empty key
    axis raised (SGLang's startup extend of a tiny Qwen2 reached it through torch_native)."""
    import torch
    import torchtpu  # noqa: F401

    F = torch.nn.functional
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 0, 8)
    ref = F.scaled_dot_product_attention(q, k, k, is_causal=causal, enable_gqa=True)
    out = F.scaled_dot_product_attention(q.to("tpu"), k.to("tpu"), k.to("tpu"),
                                         is_causal=causal, enable_gqa=True)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("prefix,lens", [([0], [5]), ([0, 3, 7], [4, 1, 2]), ([2, 0], [0, 3]),
                                         ([], [])])
def test_extend_positions_from_the_host_match_sglangs(prefix, lens):
    """torchtpu.sglang.positions builds an extend step's positions and start rows with numpy:
    equal to SGLang's compute_position_torch (an arange per request, concatenated, and the
    cumulative lengths), computed here with torch on CPU."""
    import torch

    from torchtpu.sglang.positions import host_positions

    positions, starts = host_positions(prefix, lens)
    want = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, lens)]
                     + [torch.zeros(0, dtype=torch.int64)])
    want_starts = torch.zeros(len(lens), dtype=torch.int64)
    if lens:
        want_starts[1:] = torch.cumsum(torch.tensor(lens[:-1], dtype=torch.int64), 0)
    assert torch.equal(torch.from_numpy(positions), want)
    assert torch.equal(torch.from_numpy(starts), want_starts)


def test_extend_padding_on_the_host_compiles_nothing_per_length():
    """torchtpu.sglang.positions.pad_on_host (the compiled prefill's token and request
    padding): equal to a ``cat`` with the fill on CPU, built from the host copy noted on the
    device tensor (``remember_host``: no host read) or given, read back once a tensor was
    written in place; after the first call for a bucket's length, no other length compiles a
    program."""
    import numpy as np
    import torch

    from torchtpu.sglang.positions import pad_on_host, remember_host

    def grew(before):
        now = torch.tpu.metrics()["counters"]
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}

    pad_on_host(torch.zeros(2, dtype=torch.int64, device="tpu"), 16, 0, [0, 0])  # warm
    for n, fill in ((3, 0), (5, 1), (11, 0), (16, 7)):
        host = np.arange(10, 10 + n, dtype=np.int64)
        dev = torch.from_numpy(host).to("tpu")
        remember_host(dev, host)
        before = dict(torch.tpu.metrics()["counters"])
        out = pad_on_host(dev, 16, fill)
        g = grew(before)
        assert not any(k.endswith("compiles") for k in g) and "host_syncs" not in g, g
        want = torch.cat([torch.from_numpy(host), torch.full((16 - n,), fill)])
        assert out.dtype == torch.int64 and torch.equal(out.cpu(), want)
        # a host list given (SGLang's *_cpu copies), as int32 on the device
        out = pad_on_host(dev.to(torch.int32), 16, fill, host.tolist())
        assert torch.equal(out.cpu(), want)
    dev.add_(1)  # written in place: the noted copy is stale, the values are read back
    before = dict(torch.tpu.metrics()["counters"])
    out = pad_on_host(dev, 16, 0)
    assert grew(before).get("host_syncs") == 1
    assert torch.equal(out.cpu(), torch.from_numpy(host) + 1)


def test_deferred_buckets_wait_for_the_scheduler_to_stay_idle(monkeypatch):
    """working_set.warm_if_idle: nothing is warmed until the scheduler has been fully idle for
    IDLE_AFTER_S without a step in between (a request arriving right after the last ones must
    not find the scheduler inside a bucket's trace)."""
    from torchtpu.sglang import working_set as ws

    class Sched:
        idle = True

        def is_fully_idle(self):
            return self.idle

    warmed = []
    monkeypatch.setattr(ws, "_PENDING", __import__("collections").deque())
    monkeypatch.setattr(ws, "_IDLE", {"since": None, "last": 0.0})
    monkeypatch.setattr(ws, "IDLE_AFTER_S", 2.0)
    def run_one():
        warmed.append(ws._PENDING.popleft()[0])
        return True

    monkeypatch.setattr(ws, "run_one", run_one)
    ws.defer("a", None)
    ws.defer("b", None)
    s = Sched()
    t = 100.0
    for _ in range(19):  # polled every 0.1 s for 1.9 s: not yet
        assert not ws.warm_if_idle(s, now=t)
        t += 0.1
    s.idle = False  # a request: idle time starts again after it
    assert not ws.warm_if_idle(s, now=t)
    s.idle = True
    for _ in range(19):
        t += 0.1
        assert not ws.warm_if_idle(s, now=t)
    t += 1.0  # a gap between polls: a step ran in between, so idle time restarts
    for _ in range(19):
        assert not ws.warm_if_idle(s, now=t)
        t += 0.1
    assert ws.warm_if_idle(s, now=t + 0.2) and warmed == ["a"]
    assert ws.pending() == ["b"]


def test_held_eager_builds_run_once_the_scheduler_idles(monkeypatch):
    """The platform serves a bookkeeping op at a new shape on the host and holds its build
    (eager/deferred.py); working_set.warm_if_idle builds it, one per poll, once the scheduler
    has been fully idle for IDLE_AFTER_S, and the next call at that shape runs the program."""
    import collections

    import torch

    from torchtpu.eager import deferred
    from torchtpu.sglang import working_set as ws

    class Sched:
        def is_fully_idle(self):
            return True

    monkeypatch.setattr(ws, "_PENDING", collections.deque())
    monkeypatch.setattr(ws, "_IDLE", {"since": None, "last": 0.0})
    monkeypatch.setattr(ws, "IDLE_AFTER_S", 2.0)
    old = deferred.enabled()
    deferred.enable(True, hold=True)
    try:
        while deferred.held():
            deferred.build_held(1)
        x = torch.arange(43, device="tpu")
        calls = lambda: torch.tpu.metrics()["counters"].get("eager_deferred_calls", 0)  # noqa: E731
        c0 = calls()
        y = torch.cat([x, x[:5]])
        assert calls() == c0 + 1 and deferred.held() == 1
        assert torch.equal(y.cpu(), torch.cat([torch.arange(43), torch.arange(5)]))
        s, t = Sched(), 100.0
        for _ in range(20):  # idle for 1.9 s: nothing built yet
            assert not ws.warm_if_idle(s, now=t)
            t += 0.1
        assert deferred.held() == 1
        assert ws.warm_if_idle(s, now=t + 0.1) and deferred.held() == 0
        c1 = calls()
        assert torch.equal(torch.cat([x, x[:5]]).cpu(), y.cpu()) and calls() == c1
    finally:
        deferred.enable(old)


def test_serving_benchmark_compares_the_same_prompts_as_the_vllm_rows():
    """benchmarks/sglang_serving.py's offline SGLang rows and the vLLM rows it runs beside them
    (benchmarks/vllm_serving.py's offline child) serve the same prompts: same count, lengths
    and tokens (they once drew 16..400 vs 16..200 tokens, ~2.2x the prefill work for SGLang)."""
    bench = os.path.join(ROOT, "benchmarks")
    sys.path[:0] = [bench, os.path.join(ROOT, "examples")]
    try:
        import sglang_serving
        import vllm_serving
    finally:
        del sys.path[:2]
    for n in (16, 32):
        assert sglang_serving._requests(n) == vllm_serving._requests(n)


def test_program_capture_replays_the_graph_it_captured(tmp_path):
    """benchmarks/sglang_program_ab.py (program or process? the engines' decode programs timed
    side by side in one process): the executable it captures from a compiled graph's calls,
    reloaded with the captured inputs, computes what the graph computed, and its donated input
    (a buffer the graph writes, like a KV cache) is passed back from call to call."""
    import jax
    import numpy as np
    import torch

    import torchtpu  # noqa: F401

    bench = os.path.join(ROOT, "benchmarks")
    sys.path[:0] = [bench]
    try:
        import sglang_program_ab as ab
    finally:
        del sys.path[:1]
    ab._SEEN.clear()
    ab.install()
    try:
        _capture_and_replay(ab, tmp_path, jax, np, torch)
    finally:
        ab.uninstall()
        ab._SEEN.clear()


def _capture_and_replay(ab, tmp_path, jax, np, torch):

    def step(x, w, cache):
        cache.add_(1.0)  # written in place: donated to the program
        return torch.tanh(x @ w) + cache.sum()

    f = torch.compile(step, backend="tpu")
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    cache = torch.zeros(16, device="tpu")
    for _ in range(3):
        got = f(x.to("tpu"), w.to("tpu"), cache)
    ab.dump(str(tmp_path))
    prog = ab._Loaded(str(tmp_path))
    assert list(prog.d["donate"]) and prog.d["calls"] == 3
    prog.first()  # the donated cache starts as zeros: its sum is 16 after the first call
    for k in (1, 2):
        out = [leaf for leaf in jax.tree_util.tree_leaves(prog.call(prog.args()))
               if leaf.shape == (4, 3)]
        want = torch.tanh(x @ w) + 16.0 * k
        assert len(out) == 1
        torch.testing.assert_close(torch.from_numpy(np.array(out[0])), want)
    assert got.shape == (4, 3)
    r = ab.time_programs([str(tmp_path)], calls=2, repeats=1)
    assert r["programs"][0]["wall_s"] > 0
