"""Hugging Face ``generate`` on "tpu" vs PyTorch CPU: greedy decoding of a tiny Llama.

    python benchmarks/generate.py [--tokens 32] [--repeats 5] [--second-runs 2]
                                  [--no-second-process] [--only strict,fused,static]

A tiny random-weight Llama built from a config (no downloads), greedy ``generate`` of
``--tokens`` new tokens from one 16-token prompt, in one run side by side:

- PyTorch CPU at its default thread count and at 1 thread (dynamic cache; static cache at 1);
- "tpu" Strict (``EagerMode.DEFER_NEVER``), dynamic cache;
- "tpu" Fused (``EagerMode.DEFER_AND_FUSE``), dynamic cache;
- "tpu" static cache, whose decode step transformers compiles (``torch.compile``, backend "tpu").

In-process: warm calls, the cases interleaved call by call, each call ending with
``torch.tpu.synchronize()``; medians of ``--repeats``, in ms per new token. Then the first
``generate`` of a second process sharing this run's compile cache (``TORCHTPU_CACHE_DIR``, a
fresh folder the first process filled), and of later processes of the same command line (which
load the working set the one before recorded ahead, runtime/working_set.py; and with that off),
against a fresh CPU process's first call; the children report what they compiled and loaded
(``torch.tpu.metrics()``) and their main thread's CPU time in their first and second calls (on
a loaded host the wall times swing several-fold; that CPU time much less). Every "tpu" case's tokens are compared
with CPU greedy's. Per token it also prints the aten ops dispatched (a counting dispatch mode,
Strict, outside the timed calls), the eager ops that ran as programs or were recorded
(``eager_cache_hits/misses``, ``fused_ops_recorded``) and the XLA programs run (Programs called,
plus compiled-graph calls).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = 16


def build_cpu_model():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def prompt():
    import torch

    return torch.randint(3, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))


# case -> (device, cache implementation, eager mode name or None, torch threads or None)
CASES = {
    "cpu": ("cpu", "dynamic", None, None),
    "cpu_1thread": ("cpu", "dynamic", None, 1),
    "cpu_static_1thread": ("cpu", "static", None, 1),
    "strict": ("tpu", "dynamic", "DEFER_NEVER", None),
    "fused": ("tpu", "dynamic", "DEFER_AND_FUSE", None),
    "static": ("tpu", "static", "DEFER_NEVER", None),
}


class Runner:
    """One case's generate call, ready to time."""

    def __init__(self, case, models, tokens):
        import torch

        self.case = case
        self.device, self.cache, mode, self.threads = CASES[case]
        self.model = models[self.device]
        self.mode = None if mode is None else getattr(torch.tpu.EagerMode, mode)
        self.ids = prompt().to(self.device)
        self.kw = dict(max_new_tokens=tokens, min_new_tokens=0, do_sample=False,
                       cache_implementation=self.cache, pad_token_id=0)

    def __call__(self):
        import torch

        default_threads = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            with torch.no_grad():
                if self.mode is None:
                    out = self.model.generate(self.ids, **self.kw)
                else:
                    with torch.tpu.set_eager_mode(self.mode):
                        out = self.model.generate(self.ids, **self.kw)
                        torch.tpu.synchronize()
        finally:
            torch.set_num_threads(default_threads)
        return out


def models_on(devices):
    import copy

    cpu = build_cpu_model()
    out = {"cpu": cpu}
    if "tpu" in devices:
        out["tpu"] = copy.deepcopy(cpu).to("tpu")
    return out


def count_per_token(run, tokens):
    """(aten ops, eager ops, programs) per new token of one untimed call."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtpu.runtime import program_cache

    calls = [0]
    orig = program_cache.Program.__call__

    def counted(self, *flat):
        calls[0] += 1
        return orig(self, *flat)

    aten = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            aten[0] += 1
            return func(*args, **(kwargs or {}))

    torch.tpu.reset_metrics()
    program_cache.Program.__call__ = counted
    try:
        if run.cache == "static":
            run()  # compiled: a dispatch mode would retrace it; eager ops come from metrics
            n_aten = None
        else:
            with Count():
                run()
            n_aten = aten[0]
    finally:
        program_cache.Program.__call__ = orig
    c = torch.tpu.metrics()["counters"]
    eager = (c.get("eager_cache_hits", 0) + c.get("eager_cache_misses", 0)
             + c.get("fused_ops_recorded", 0))
    graphs = c.get("compile_cache_hits", 0) + c.get("compile_cache_misses", 0)
    return (None if n_aten is None else n_aten / tokens, eager / tokens,
            (calls[0] + graphs) / tokens)


def in_process(cases, tokens, repeats, cache_dir):
    import torch

    sys.path.insert(0, HERE)
    from common import Table, environment

    devices = {CASES[c][0] for c in cases}
    models = models_on(devices)
    runners = {c: Runner(c, models, tokens) for c in cases}
    expect = {}
    first = {}
    for c, r in runners.items():  # the first process's first calls fill the compile cache
        t0 = time.perf_counter()
        out = r()
        first[c] = time.perf_counter() - t0
        got = out.cpu()
        if r.device == "cpu":
            expect[r.cache] = got
    for c, r in runners.items():
        r()  # a second warm-up call (Fused: graphs keyed by their op sequence)
    times = {c: [] for c in cases}
    for _ in range(repeats):  # interleaved call by call
        for c, r in runners.items():
            t0 = time.perf_counter()
            r()
            times[c].append(time.perf_counter() - t0)
    counts = {}
    same = {}
    for c, r in runners.items():
        if r.device == "tpu":
            counts[c] = count_per_token(r, tokens)
            got = r().cpu()
            ref = expect.get(r.cache, expect.get("dynamic"))
            same[c] = ref is not None and got.shape == ref.shape and bool((got == ref).all())
            n_new = got.shape[1] - PROMPT
            if n_new != tokens:
                print(f"note: {c} generated {n_new} tokens, not {tokens} (an eos)")
    ms = {c: 1000 * statistics.median(t) / tokens for c, t in times.items()}
    cpu1 = ms.get("cpu_1thread")
    t = Table(f"generate(): greedy, {tokens} new tokens, tiny Llama (ms per token, warm, "
              f"median of {repeats})", ["ms/token"], unit="ms")
    for c in cases:
        v = {"ms/token": ms[c]}
        t.add(c, v)
    t.notes.append(environment())
    print(t.render())
    print()
    head = (f"{'case':<20}{'ms/token':>10}{'x cpu(1t)':>11}{'x cpu':>8}{'first call s':>14}"
            f"{'aten ops/tok':>14}{'eager ops/tok':>15}{'programs/tok':>14}{'tokens=CPU':>12}")
    print(head)
    print("-" * len(head))
    for c in cases:
        aten, eager, progs = counts.get(c, (None, None, None))
        f = lambda v, w, p=1: f"{v:>{w}.{p}f}" if v is not None else f"{'-':>{w}}"
        print(f"{c:<20}{ms[c]:>10.2f}{f(ms[c] / cpu1 if cpu1 else None, 10, 2)}x"
              f"{f(ms[c] / ms['cpu'] if 'cpu' in ms else None, 7, 2)}x{first[c]:>14.2f}"
              f"{f(aten, 14)}{f(eager, 15)}{f(progs, 14)}"
              f"{('yes' if same[c] else 'NO') if c in same else '-':>12}")
    if "strict" in ms and "fused" in ms:
        print(f"\nFused is {ms['strict'] / ms['fused']:.2f}x faster than Strict "
              f"(target >= 1.5x)")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"(cache folder {'fresh' if cache_dir else 'default'})")
    return {"ms": ms, "same": same, "expect": expect}


def child(case, tokens):
    """The first generate() of a fresh process: prints one JSON line."""
    t0 = time.perf_counter()
    import torch

    devices = {CASES[case][0]}
    models = models_on(devices)
    r = Runner(case, models, tokens)
    if r.device == "tpu":
        torch.tpu.synchronize()
        torch.tpu.reset_metrics()
    setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    c1 = time.thread_time()
    out = r()
    first = time.perf_counter() - t1
    first_cpu = time.thread_time() - c1  # this thread's CPU: what a loaded host shares least
    c2 = time.thread_time()
    t2 = time.perf_counter()
    r()
    second = time.perf_counter() - t2
    second_cpu = time.thread_time() - c2
    c = torch.tpu.metrics()["counters"] if r.device == "tpu" else {}
    keep = {k: v for k, v in c.items() if "compile" in k or "disk_cache" in k or "traces" in k
            or "working_set" in k or k.endswith("_loads")}
    print(json.dumps({"setup_s": setup, "first_s": first, "second_s": second,
                      "first_cpu_s": first_cpu, "second_cpu_s": second_cpu,
                      "tokens": out.cpu().tolist(), "counters": keep}))


def _child_run(case, tokens, env):
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", case, "--tokens",
                        str(tokens)], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{case}: the child failed:\n{p.stderr[-3000:]}")
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def second_process(cases, tokens, runs, cache_dir, expect):
    """Each case: the second process (its programs in the compile cache, loaded on demand),
    then ``runs`` later processes of the same command line (which load the working set the
    process before them recorded ahead, runtime/working_set.py), and as many with that off
    (``TORCHTPU_WORKING_SET=0``), alternating."""
    env = dict(os.environ)
    if cache_dir:
        env["TORCHTPU_CACHE_DIR"] = cache_dir
    off = dict(env, TORCHTPU_WORKING_SET="0")
    rows = {}
    for c in cases:
        second = _child_run(c, tokens, env)
        later, later_off = [], []
        for _ in range(runs if second else 0):
            for out, e in ((later, env), (later_off, off)):
                r = _child_run(c, tokens, e)
                if r is not None:
                    out.append(r)
        if second:
            rows[c] = (second, later, later_off)
    print(f"\nFirst generate() of a new process sharing the compile cache filled above (s; later:"
          f" median of {runs}; x: ratio to the CPU process's first call at 1 thread)")
    head = (f"{'case':<20}{'setup':>7}{'2nd proc':>10}{'x':>7}{'later':>8}{'x':>7}"
            f"{'later, no ws':>14}{'x':>7}{'warm call':>11}{'tok=CPU':>9}  what the later process"
            " loaded or compiled in its first two calls")
    print(head)
    print("-" * len(head))
    med = lambda rs, k: statistics.median(r[k] for r in rs) if rs else None
    cpu1 = rows.get("cpu_1thread", (None,))[0]
    cpu1 = cpu1["first_s"] if cpu1 else None
    for c, (second, later, later_off) in rows.items():
        cells = [f"{c:<20}", f"{second['setup_s']:>7.2f}"]
        for v in (second["first_s"], med(later, "first_s"), med(later_off, "first_s")):
            w = 10 if len(cells) == 2 else (8 if len(cells) == 4 else 14)
            cells.append(f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}")
            cells.append(f"{v / cpu1:>6.1f}x" if v is not None and cpu1 else f"{'-':>7}")
        warm = med(later, "second_s")
        cells.append(f"{warm:>11.3f}" if warm is not None else f"{'-':>11}")
        ref = expect.get(CASES[c][1], expect.get("dynamic"))
        ok = all(r["tokens"] == ref for r in [second] + later + later_off)
        cells.append(f"{'yes' if ok else 'NO':>9}")
        cnt = (later or [second])[-1]["counters"]
        cells.append("  " + ", ".join(f"{k}={v}" for k, v in sorted(cnt.items())))
        print("".join(cells))
    for c, (second, later, later_off) in rows.items():
        if later:
            print(f"{c}: main thread's CPU in the later process's first call "
                  f"{med(later, 'first_cpu_s'):.3f} s, in its second (warm) call "
                  f"{med(later, 'second_cpu_s'):.3f} s (medians of {len(later)})")
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--second-runs", type=int, default=2,
                    help="later processes per case (with and without the working set each)")
    ap.add_argument("--no-second-process", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated tpu cases: strict,fused,static")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.tokens)
    tpu_cases = [c for c in ("strict", "fused", "static") if not a.only or c in a.only.split(",")]
    cases = ["cpu", "cpu_1thread", "cpu_static_1thread"] + tpu_cases
    cache_dir = tempfile.mkdtemp(prefix="torchtpu-generate-bench-")
    os.environ["TORCHTPU_CACHE_DIR"] = cache_dir  # before the first program: a cold folder
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        res = in_process(cases, a.tokens, a.repeats, cache_dir)
        if not a.no_second_process:
            second_process(cases[:2] + tpu_cases, a.tokens, a.second_runs, cache_dir,
                           {k: v.tolist() for k, v in res["expect"].items()})
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
