"""vLLM offline on "tpu" (run by tests/test_vllm.py in the vLLM virtualenv).

    python offline.py ARCH MODE [features...]

ARCH: llama | qwen2 | mistral (a tiny random-weight model built from its config here);
MODE: compiled | eager. Checks greedy token ids of a batch of mixed prompt lengths (one longer
than a step's token budget: chunked prefill) against transformers on CPU, the compile and host
sync counters after warm-up, and with "features": prefix caching, seeded sampling, n > 1, stop
strings and logprobs. Prints "ALL OK" at the end.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

if os.environ.get("TORCHTPU_VLLM_BLOCK_C") == "1":
    # what a TPU host's vLLM wheel has: no usable vllm._C (every import of it fails)
    import importlib.abc

    class _NoVllmC(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.startswith(("vllm._C", "vllm._moe_C", "vllm._rocm_C", "vllm._flashmla")):
                raise ImportError(f"{name} refused (the plugin must not need it)")

    sys.meta_path.insert(0, _NoVllmC())

os.environ.setdefault("VLLM_TARGET_DEVICE", "tpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tiny_models import hf_greedy, save_tiny_model  # noqa: E402

arch, mode = sys.argv[1], sys.argv[2]
features = "features" in sys.argv[3:]
MAX_TOKENS = 10
BUDGET = 64  # max_num_batched_tokens: token buckets 16, 32, 64

path = save_tiny_model(tempfile.mkdtemp(prefix=f"tiny-{arch}-"), arch)

from vllm import LLM, SamplingParams  # noqa: E402

t0 = time.perf_counter()
llm = LLM(model=path, dtype="float32", enforce_eager=(mode == "eager"), max_model_len=256,
          max_num_seqs=8, max_num_batched_tokens=BUDGET, kv_cache_memory_bytes=8 << 20, seed=0,
          enable_prefix_caching=True, enable_chunked_prefill=True,
          # TORCHTPU_VLLM_ASYNC=1: vLLM's async scheduling (the platform's opt-in)
          additional_config={"torchtpu_async_scheduling":
                             os.environ.get("TORCHTPU_VLLM_ASYNC") == "1"})
print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
print("async scheduling:", llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
      flush=True)
if os.environ.get("TORCHTPU_VLLM_EXPECT_WARM") == "1":
    # a second process on the same TORCHTPU_CACHE_DIR: every program of the start-up (bucket
    # forwards, logits, gathers, transfers) comes from the compile cache
    c0 = torch.tpu.metrics()["counters"]
    built = {k: v for k, v in c0.items() if k.endswith("xla_compiles") or k == "compile_traces"}
    assert not any(built.values()), f"the warm start compiled: {built}"
    print("warm start compiled nothing", flush=True)

import transformers  # noqa: E402

vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
rng = np.random.default_rng(1)
lengths = [3, 17, 9, 90, 1, 33]  # 90 > BUDGET: its prefill is chunked
prompts = [[1] + [int(x) for x in rng.integers(7, vocab, n)] for n in lengths]
greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

torch.tpu.reset_metrics()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
c = torch.tpu.metrics()["counters"]
got = [list(o.outputs[0].token_ids) for o in outs]
ref = hf_greedy(path, prompts, MAX_TOKENS)
assert got == ref, f"greedy ids differ from transformers on CPU:\n{got}\n{ref}"
compiles = sum(v for k, v in c.items() if k.endswith("xla_compiles") or k == "compile_graphs")
steps = max(1, c.get("host_syncs", 0))
print("counters after warm-up:", json.dumps(c), flush=True)
if mode == "compiled":
    assert compiles == 0, f"compiled after warm-up: {c}"
    assert c.get("compile_donated_buffers", 0) > 0, "the KV cache buffers were not donated"
    # every step called its bucket's program directly, without Dynamo's guards (dispatch.py):
    # warm-up built and held every bucket once
    assert c.get("vllm_steps_direct", 0) >= MAX_TOKENS and not c.get("vllm_steps_guarded"), c
# one sync per step (the greedy ids); no more than the number of decode steps plus prefill
# chunks
assert c.get("host_syncs", 0) <= MAX_TOKENS + 3, c
# every step of a greedy batch took its tokens from the step's program (its argmax), none ran
# vLLM's sampler on the host
assert c.get("vllm_steps_sampled_in_program", 0) >= MAX_TOKENS, c
assert not c.get("vllm_steps_sampled_on_host", 0), c
print("greedy OK", flush=True)

if features:
    # prefix caching: the same prompts again hit the cache and give the same tokens
    outs2 = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs2] == ref
    cached = sum(o.num_cached_tokens or 0 for o in outs2)
    assert cached > 0, "no prefix-cache hit on repeated prompts"
    print("prefix caching OK", cached, "cached tokens", flush=True)

    # seeded sampling: reproducible, and another seed differs
    def sample(seed, n=1):
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, top_k=20,
                            seed=seed, n=n, ignore_eos=True)
        o = llm.generate([{"prompt_token_ids": prompts[1]}], sp, use_tqdm=False)[0]
        return [list(x.token_ids) for x in o.outputs]

    a, b, d = sample(7), sample(7), sample(8)
    assert a == b, (a, b)
    assert a != d, "two seeds sampled the same tokens"
    two = sample(7, n=2)
    assert len(two) == 2 and all(len(x) == MAX_TOKENS for x in two), two
    print("seeded sampling and n=2 OK", flush=True)

    # a batch mixing greedy and plain random requests (a temperature, nothing else) samples
    # in the step's program: the greedy requests still give transformers' ids, a seeded random
    # request gives the same tokens run to run and whatever it is batched with; top-p sends a
    # step to vLLM's sampler on the host, with the greedy ids unchanged
    torch.tpu.reset_metrics()
    rand = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True)
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                         [greedy, rand, greedy], use_tqdm=False)
    assert [list(mixed[i].outputs[0].token_ids) for i in (0, 2)] == [ref[0], ref[2]]
    c = torch.tpu.metrics()["counters"]
    assert c.get("vllm_steps_sampled_in_program", 0) >= MAX_TOKENS, c
    assert not c.get("vllm_steps_sampled_on_host", 0), c
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], rand, use_tqdm=False)[0]
    assert list(alone.outputs[0].token_ids) == list(mixed[1].outputs[0].token_ids)
    other = llm.generate([{"prompt_token_ids": prompts[1]}],
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=4,
                                        ignore_eos=True), use_tqdm=False)[0]
    assert list(other.outputs[0].token_ids) != list(alone.outputs[0].token_ids)
    torch.tpu.reset_metrics()
    top_p = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.8, seed=3,
                           ignore_eos=True)
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                         [greedy, top_p, greedy], use_tqdm=False)
    assert [list(mixed[i].outputs[0].token_ids) for i in (0, 2)] == [ref[0], ref[2]]
    c = torch.tpu.metrics()["counters"]
    assert c.get("vllm_steps_sampled_on_host", 0) >= MAX_TOKENS, c
    print("seeded in-program sampling OK", flush=True)

    # the in-program draw follows softmax(logits / temperature) of transformers' logits: the
    # first token of one prompt under 600 seeds, a chi-square test on bins of >= 5 expected
    # draws (seeded: the same counts every run; a threshold of p ~ 1e-6). The tiny model's
    # logits are nearly flat: at temperature 0.25 a draw that ignored the temperature fails
    # (chi2 ~270 against a limit of ~97), at 1.0 anything far from it does (a greedy draw)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        last = model(torch.tensor([prompts[4]])).logits[0, -1].double()
    for temp in (1.0, 0.25):
        N = 600
        sps = [SamplingParams(max_tokens=1, temperature=temp, seed=1000 + i, ignore_eos=True)
               for i in range(N)]
        torch.tpu.reset_metrics()
        outs = llm.generate([{"prompt_token_ids": prompts[4]}] * N, sps, use_tqdm=False)
        assert not torch.tpu.metrics()["counters"].get("vllm_steps_sampled_on_host", 0)
        counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=vocab)
        expect = torch.softmax(last / temp, -1).numpy() * N
        big = expect >= 5
        obs, exp = counts[big], expect[big]
        if (~big).any():
            obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expect[~big].sum())
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        df = len(obs) - 1
        # Wilson-Hilferty: chi2's p ~ 1e-6 quantile for df degrees of freedom
        limit = df * (1 - 2 / (9 * df) + 4.75 * (2 / (9 * df)) ** 0.5) ** 3
        assert df >= 3 and chi2 < limit, (temp, chi2, limit, df, obs, exp)
        print(f"distribution at temperature {temp}: chi2 {chi2:.1f} < {limit:.1f} "
              f"(df {df})", flush=True)
    print("in-program sampling distribution OK", flush=True)
    tok = 11
    biased = llm.generate([{"prompt_token_ids": prompts[0]}],
                          SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                         logit_bias={tok: 100.0}), use_tqdm=False)[0]
    assert list(biased.outputs[0].token_ids) == [tok] * 4, biased.outputs[0].token_ids
    print("mixed greedy/random batch and logit bias OK", flush=True)

    # stop strings: the text stops before the first occurrence of the stop string
    full = llm.generate([{"prompt_token_ids": prompts[2]}], greedy, use_tqdm=False)[0]
    words = full.outputs[0].text.split()
    assert len(words) >= 3, full.outputs[0].text
    stop = words[2]
    cut = llm.generate([{"prompt_token_ids": prompts[2]}],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                      stop=[stop]), use_tqdm=False)[0]
    text = cut.outputs[0].text
    assert stop not in text and full.outputs[0].text.startswith(text.rstrip()), (text, stop)
    assert cut.outputs[0].finish_reason == "stop", cut.outputs[0].finish_reason
    print("stop strings OK", flush=True)

    # logprobs: the greedy token's logprob is transformers' log-softmax at that step
    lp = llm.generate([{"prompt_token_ids": prompts[0]}],
                      SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                     logprobs=2), use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([prompts[0] + list(lp.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    n0 = len(prompts[0])
    for i, (tok, d) in enumerate(zip(lp.token_ids, lp.logprobs)):
        want = float(logp[n0 - 1 + i, tok])
        assert abs(d[tok].logprob - want) < 1e-3, (i, d[tok].logprob, want)
        assert len(d) >= 2
    print("logprobs OK", flush=True)

if os.environ.get("TORCHTPU_VLLM_BLOCK_C") == "1":
    loaded = [m for m in sys.modules if m.startswith("vllm._C")]
    assert not loaded, loaded
    print("ran without vllm._C", flush=True)
print("ALL OK", flush=True)
