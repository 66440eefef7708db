"""vLLM with tensor_parallel_size=2 on "tpu" (run by tests/test_vllm.py in the vLLM venv).

    python tp.py [compiled|eager]

Two worker processes (vLLM's multiprocessing executor) each own one XLA device and join the
"tpu_dist" process group; greedy ids of a batch must equal transformers' on CPU (and so one
process's). Prints "ALL OK".
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "tpu")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(function)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

from tiny_models import hf_greedy, save_tiny_model  # noqa: E402


def _counters(worker):
    import torch

    return torch.tpu.metrics()["counters"]


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "compiled"
    path = save_tiny_model(tempfile.mkdtemp(prefix="tiny-llama-tp-"), "llama", heads=4,
                           kv_heads=2)
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, dtype="float32", enforce_eager=(mode == "eager"),
              tensor_parallel_size=2, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20, seed=0)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    prompts = [[1, 10, 11, 12, 13], [1, 20, 21], [1] + list(range(7, 47))]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    ref = hf_greedy(path, prompts, 10)
    assert got == ref, f"TP=2 greedy ids differ from transformers on CPU:\n{got}\n{ref}"
    print("tp=2 greedy OK", flush=True)
    for rank, c in enumerate(llm.collective_rpc(_counters)):
        print(f"rank {rank} counters:", {k: v for k, v in c.items() if "compile" in k
                                         or "fallback" in k or "dist" in k}, flush=True)
        assert not c.get("compile_cpu_fallbacks") and not c.get("cpu_fallbacks"), c
        if mode == "compiled":
            # the forward's all-reduces are inside its program (one SPMD program per bucket)
            assert c.get("compile_spmd_programs", 0) > 0 and c.get("compile_collectives"), c
    del llm
    print("ALL OK", flush=True)


if __name__ == "__main__":
    main()
