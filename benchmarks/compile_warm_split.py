"""Where a later process's first static-cache ``generate()`` spends its time (main-thread CPU).

    python benchmarks/compile_warm_split.py [--tokens 32]

Runs generate.py's static case (tiny Llama from a config, ``torch.compile`` decode and bucketed
prefill, backend "tpu") in a first process to fill a fresh compile cache folder, then in a second
process sharing it, and prints the second one's first call split by thread CPU time: Dynamo's
frame compiles (all of ``convert_frame._compile``), within them the backend (aot_autograd's cache
lookup and our ``GraphCode.post_compile``) and guard building, our compiled graphs' calls
(``CompiledGraph.__call__``, with the executables' loads), and the rest (transformers' Python and
the eager programs around the steps). Wall time is printed too; with other work on the machine
it exceeds the CPU time. See docs/ARCHITECTURE.md ("Warm starts of compiled graphs").
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ["dynamo (frame compiles, all)", "  backend (aot_autograd + ours)",
         "    AOTAutogradCache lookup + load", "      ours: GraphCode.post_compile",
         "  guard building", "ours: CompiledGraph calls", "  ours: executable loads"]


def child(tokens: int, measure: bool) -> None:
    sys.path.insert(0, HERE)
    import generate as g
    import torch

    cpu = collections.defaultdict(float)
    calls = collections.Counter()

    def timed(owner, name, label):
        orig = getattr(owner, name)

        @functools.wraps(orig)
        def f(*a, **k):
            t = time.thread_time()
            try:
                return orig(*a, **k)
            finally:
                cpu[label] += time.thread_time() - t
                calls[label] += 1

        setattr(owner, name, f)

    if measure:
        import torch._dynamo.convert_frame as cf
        import torch._dynamo.guards as guards
        import torch._dynamo.output_graph as og
        import torch._functorch._aot_autograd.autograd_cache as agc

        from torchtpu.compile import aot_cache, backend

        timed(cf, "_compile", "dynamo (frame compiles, all)")
        timed(og.OutputGraph, "call_user_compiler", "  backend (aot_autograd + ours)")
        timed(agc.AOTAutogradCache, "try_load", "    AOTAutogradCache lookup + load")
        timed(aot_cache.GraphCode, "post_compile", "      ours: GraphCode.post_compile")
        timed(guards.CheckFunctionManager, "__init__", "  guard building")
        timed(backend.CompiledGraph, "__call__", "ours: CompiledGraph calls")
        timed(backend.CompiledGraph, "_compile", "  ours: executable loads")
    models = g.models_on({"tpu"})
    r = g.Runner("static", models, tokens)
    torch.tpu.synchronize()
    t0, c0 = time.perf_counter(), time.thread_time()
    out = r()
    wall, total = time.perf_counter() - t0, time.thread_time() - c0
    print(json.dumps({"wall": wall, "cpu": total, "parts": dict(cpu), "calls": dict(calls),
                      "tokens": out.cpu().tolist()}))


def run(tokens: int, cache: str, measure: bool) -> dict:
    env = dict(os.environ, TORCHTPU_CACHE_DIR=cache)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(int(measure)),
                        "--tokens", str(tokens)], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"the child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child is not None:
        child(a.tokens, a.child == "1")
        return
    with tempfile.TemporaryDirectory() as cache:
        cold = run(a.tokens, cache, False)
        warm = run(a.tokens, cache, True)
    print(f"first generate() of a later process, {a.tokens} tokens: wall {warm['wall']:.3f} s, "
          f"main-thread CPU {warm['cpu']:.3f} s (cold process: wall {cold['wall']:.3f} s); "
          f"tokens equal: {'yes' if warm['tokens'] == cold['tokens'] else 'NO'}")
    parts = warm["parts"]
    for k in ORDER:
        if k not in parts:
            continue
        v = parts[k]
        print(f"  {k:<44}{v:8.3f} s  ({v / warm['cpu']:5.1%})  calls {warm['calls'][k]}")
    rest = warm["cpu"] - parts.get("dynamo (frame compiles, all)", 0) \
        - parts.get("ours: CompiledGraph calls", 0)
    label = "rest (transformers, eager programs)"
    print(f"  {label:<44}{rest:8.3f} s  ({rest / warm['cpu']:5.1%})")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")


if __name__ == "__main__":
    main()
