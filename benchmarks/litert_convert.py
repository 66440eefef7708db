"""LiteRT conversion at model scale: seconds and peak memory of ``torch.tpu.export.to_litert``
(float and dynamic int8, from a saved export, in a process without torch) next to
``litert_torch.convert`` of the same model on CPU, for a Llama built from a config (random
weights) of about ``--params`` parameters.

    .venv-litert/bin/python benchmarks/litert_convert.py --params 250e6

Each conversion runs in its own process (peak RSS = that process's ru_maxrss); the export to
StableHLO is timed too. Needs the LiteRT environment (``make venv-litert``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TO_LITERT = r"""
import sys, time, resource, json
sys.path.insert(0, sys.argv[1])
import litert
t = time.perf_counter()
litert.to_litert(sys.argv[2], sys.argv[3], quantize=(sys.argv[4] or None))
dt = time.perf_counter() - t
assert "torch" not in sys.modules
print(json.dumps({"s": dt, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""

_LITERT_TORCH = r"""
import sys, time, resource, json, torch
sys.path.insert(0, sys.argv[1])
import litert_convert as b
model, ids = b.build(float(sys.argv[2]))
import litert_torch
t = time.perf_counter()
edge = litert_torch.convert(model, (ids,))
edge.export(sys.argv[3])
dt = time.perf_counter() - t
print(json.dumps({"s": dt, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def build(params):
    """A Llama of ~``params`` parameters (hidden 1024, as many layers as fit), CPU, eval."""
    import torch
    import transformers

    hidden, inter, vocab = 1024, 2816, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden,
                                   num_attention_heads=16, num_key_value_heads=16,
                                   intermediate_size=inter, vocab_size=vocab,
                                   max_position_embeddings=256, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, vocab, (1, 32))
    return model, ids


def _child(code, *args, timeout=1800):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, timeout=timeout)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout)[-800:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=250e6)
    a = p.parse_args()
    import torch

    import torchtpu  # noqa: F401
    from torchtpu.export import exported_program_to_stablehlo

    model, ids = build(a.params)
    n = sum(t.numel() for t in model.parameters())
    print(f"Llama, {n / 1e6:.0f}M parameters ({n * 4 / 2**30:.2f} GiB float32), "
          f"{model.config.num_hidden_layers} layers; load: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        prog = exported_program_to_stablehlo(torch.export.export(model, (ids,)))
        prog.save(os.path.join(d, "artifact"))
        t_export = time.perf_counter() - t
        del prog
        rss_export = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"{'step':44s} {'s':>8s} {'peak RSS GiB':>13s} {'file MiB':>9s}")
        print(f"{'export + save (this process, with the model)':44s} {t_export:8.1f} "
              f"{rss_export:13.2f}")
        rows = []
        for q in ("", "dynamic_int8"):
            out = os.path.join(d, f"m{q}.tflite")
            r = _child(_TO_LITERT, os.path.join(ROOT, "torchtpu", "export"),
                       os.path.join(d, "artifact"), out, q)
            rows.append((f"to_litert {q or 'float'} (saved dir, no torch)", r, out))
        out = os.path.join(d, "lt.tflite")
        rows.append(("litert_torch.convert (CPU model)", _child(
            _LITERT_TORCH, os.path.join(ROOT, "benchmarks"), str(a.params), out), out))
        for name, r, out in rows:
            if "error" in r:
                print(f"{name:44s} FAILED: {r['error']}")
                continue
            print(f"{name:44s} {r['s']:8.1f} {r['rss_gib']:13.2f} "
                  f"{os.path.getsize(out) / 2**20:9.0f}")


if __name__ == "__main__":
    main()
