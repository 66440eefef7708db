"""A later process's static-cache ``generate()``: what a warm start reuses and what it redoes.

transformers compiles a static-cache decode step (``torch.compile``, backend "tpu"), and on
"tpu" the prefill is compiled too (integrations/transformers.py). A second process sharing the
compile cache folder must return the same tokens as the first (and as PyTorch on CPU), load both
graphs from AOTAutogradCache and their executables from the XLA cache, and trace (JAX) or
compile (XLA, eager or compiled) nothing. Dynamo still traces each frame once per process (see
docs/ARCHITECTURE.md, "Warm starts of compiled graphs": PyTorch's precompile cache cannot serve
this model safely); the test pins that it traces no more frames than the cold process did.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

CODE = r"""
import json, logging, copy
import torch, transformers
logging.getLogger("transformers").setLevel(logging.ERROR)
torch.manual_seed(0)
cpu = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=64, max_position_embeddings=64, bos_token_id=1,
    eos_token_id=2, pad_token_id=0)).eval()
tpu = copy.deepcopy(cpu).to("tpu")
ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(5))
kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, cache_implementation="static",
          pad_token_id=0)
with torch.no_grad():
    expect = cpu.generate(ids, **kw)
    torch.tpu.reset_metrics()
    got = tpu.generate(ids.to("tpu"), **kw).cpu()
from torch._dynamo.utils import counters
c = torch.tpu.metrics()["counters"]
print(json.dumps({"tokens": got.tolist(), "cpu": expect.tolist(),
                  "frames": counters["stats"]["unique_graphs"],
                  "counters": {k: v for k, v in c.items()
                               if k.startswith(("compile_", "aot_cache", "xla_", "eager_xla"))}}))
"""


def _run(env):
    p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_later_process_loads_both_graphs_and_compiles_nothing(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    cold = _run(env)
    warm = _run(env)
    for r in (cold, warm):
        assert r["tokens"] == r["cpu"]
    cc, wc = cold["counters"], warm["counters"]
    # the cold process compiled the prefill and the decode step (two graphs)
    assert cc.get("compile_traces", 0) >= 2 and cc.get("aot_cache_hits", 0) == 0
    assert cold["frames"] == 2
    # the warm one: Dynamo traced the same two frames, nothing more; aot_autograd's results
    # and the executables came from the caches: no JAX trace, no XLA compile anywhere
    assert warm["frames"] == cold["frames"]
    assert wc.get("aot_cache_hits", 0) == 2 and wc.get("aot_cache_misses", 0) == 0
    assert wc.get("compile_disk_cache_hits", 0) == 2
    assert wc.get("compile_traces", 0) == 0
    assert wc.get("xla_compiles", 0) == 0 and wc.get("eager_xla_compiles", 0) == 0
