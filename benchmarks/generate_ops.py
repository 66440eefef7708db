"""Where a Strict HF ``generate`` token goes: per-op split and XLA:CPU's dispatch mode.

    python benchmarks/generate_ops.py [--tokens 32] [--repeats 5] [--rounds 2]

Each round runs two child processes, one per XLA:CPU dispatch mode (JAX's default async
dispatch, and ``TORCHTPU_CPU_SYNC_DISPATCH=1``: programs run inline on the calling thread;
the option is read once, when JAX's CPU client is made, hence a process each). Each child
builds the tiny Llama of benchmarks/generate.py and times, interleaved call by call, greedy
``generate`` of ``--tokens`` tokens on "tpu" (Strict) and on PyTorch CPU at 1 thread, every
"tpu" call ending with ``torch.tpu.synchronize()``; it reports medians in ms per token of the
wall time, of the main thread's CPU time and of the process's CPU time (XLA's worker threads
included). On a loaded host the CPU times are the steadier numbers: they leave out the time
the process waited for a core. It also times one op in a tight loop (``a + b`` and ``mm`` of
16x16, independent calls and a dependent chain; min and median of 30 batches, us per op).

Per token (one untimed call with a counting dispatch mode, default dispatch) it splits the
aten ops by what serves them on "tpu": programs served by the C++ fast path, programs run
through the Python executor, metadata-only ops bound in C++, ops with no PrivateUse1 kernel
(composite, run by PyTorch in C++), and other Python kernels; and it counts the torchtpu
Python functions that C++ entered (Python kernels, device-guard hooks). Tokens are checked
against CPU greedy's.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _per_op_us(fn, batch=50, batches=30):
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        fn(batch)
        out.append((time.perf_counter() - t0) / batch * 1e6)
    return min(out), statistics.median(out)


def tight_loops():
    import torch

    a = torch.randn(16, 16, device="tpu")
    b = torch.randn(16, 16, device="tpu")

    def add(n):
        for _ in range(n):
            c = a + b
        torch.tpu.synchronize()
        return c

    def add_chain(n):
        x = a
        for _ in range(n):
            x = x + b
        torch.tpu.synchronize()
        return x

    def mm(n):
        for _ in range(n):
            c = torch.mm(a, b)
        torch.tpu.synchronize()
        return c

    def mm_chain(n):
        x = a
        for _ in range(n):
            x = torch.mm(x, b)
        torch.tpu.synchronize()
        return x

    res = {}
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER):
        for name, fn in (("add", add), ("add chain", add_chain), ("mm", mm),
                         ("mm chain", mm_chain)):
            fn(20)
            res[name] = _per_op_us(fn)
    return res


def _kernel_kinds():
    """aten op name -> what serves it on "tpu" (see the module docstring)."""
    import torch

    from torchtpu.eager import fastpath

    kinds = {}
    # a functional op's boxed Kernel is registered from fastpath.cpp too (bind_boxed), like
    # the metadata ops' CPU redispatch: told apart by the list of boxed-bound ops
    boxed = set(fastpath.boxed_bound())  # "aten::mul.Tensor", as op_name below

    def kind(func):
        name = str(func)
        if name in kinds:
            return kinds[name]
        op_name = func._schema.name + ("" if func._overloadname == "default"
                                       else "." + func._overloadname)
        has = torch._C._dispatch_has_kernel_for_dispatch_key(op_name, "PrivateUse1")
        if not has:
            kinds[name] = "no PrivateUse1 kernel (composite, C++)"
        else:
            dump = torch._C._dispatch_dump(op_name)
            line = next((ln for ln in dump.splitlines() if ln.startswith("PrivateUse1")), "")
            if "fastpath.cpp" in line and op_name not in boxed:
                kinds[name] = "metadata op bound in C++"
            else:
                from torchtpu.lowering import registry

                low = registry.get(func)
                # a functional lowering's kernel is a C++ Kernel in front of the Python one
                # (eager/kernels.py), except where it restrides its outputs in a way the C++
                # path does not reproduce (eager_layout without eager_layout_like)
                layout_ok = (not low.meta.get("eager_layout")
                             or low.meta.get("eager_layout_like") is not None) if low else False
                kinds[name] = ("program op (C++ Kernel)" if low is not None and fastpath.enabled()
                               and low.op == func and layout_ok else "Python kernel")
        return kinds[name]

    return kind


def split(run, tokens):
    """Per token: aten ops by kind, fast-path counters, torchtpu Python entries from C++."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    kind = _kernel_kinds()
    ops = collections.Counter()
    kind_of = {}
    by_kind = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func)] += 1
            kind_of[str(func)] = kind(func)
            by_kind[kind(func)] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    torch.tpu.reset_metrics()
    entries = collections.Counter()
    frames = [0]
    import torchtpu

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(torchtpu.__file__)))

    def prof(frame, event, arg):
        if event != "call":
            return
        fn = frame.f_code.co_filename
        if "torchtpu" not in fn:
            return
        frames[0] += 1
        back = frame.f_back
        if back is None or "torchtpu" not in back.f_code.co_filename:
            entries[f"{os.path.relpath(fn, pkg)}:{frame.f_code.co_name}"] += 1

    sys.setprofile(prof)
    try:
        run()
    finally:
        sys.setprofile(None)
    c = torch.tpu.metrics()["counters"]
    per = lambda v: round(v / tokens, 2)  # noqa: E731
    return {"aten": per(sum(ops.values())),
            "by_kind": {k: per(v) for k, v in by_kind.most_common()},
            "top_ops": [(k, per(v)) for k, v in ops.most_common(12)],
            "ops_by_kind": [(k, kind_of[k], per(v)) for k, v in ops.most_common()],
            "counters": {k: per(v) for k, v in sorted(c.items())
                         if v and (k.startswith("eager_") or k in ("host_syncs",))},
            "torchtpu_frames": per(frames[0]),
            "python_entries": [(k, per(v)) for k, v in entries.most_common(10)]}


def time_split(run, tokens, repeats):
    """Per token, where a call's main-thread CPU time goes (medians of ``repeats`` timed calls;
    the fast path's Kernel timing, eager/fastpath.py ``timing``, in thread CPU time: on a
    loaded host the wall clock mostly measures the wait for a core): ops served by the C++ fast path (of
    which the executable's call: JAX's C++ call, and with synchronous dispatch XLA's run of the
    program; the rest is our C++: key, lookup, gathering arrays, output tensors), functional
    ops whose C++ Kernel ran the Python kernel (a miss, or a call it does not serve), and
    everything else: HF's and PyTorch's Python, the dispatcher, composite and metadata ops,
    the Python kernels no Kernel fronts (copies, SDPA's routing), and the final synchronize."""
    from torchtpu.eager import fastpath

    if not fastpath.available():
        return None
    rows = []
    for _ in range(repeats):
        fastpath.timing(True)
        t0 = time.thread_time()
        run()
        total = time.thread_time() - t0
        t = fastpath.timing(False)
        rows.append({"total": total * 1e3, "hits": t["hits"], "hit": t["hit_ns"] / 1e6,
                     "call": t["call_ns"] / 1e6, "python": t["python"],
                     "python_ms": t["python_ns"] / 1e6})
    med = {k: statistics.median(r[k] for r in rows) / tokens for k in rows[0]}
    med["ours"] = med["hit"] - med["call"]
    med["rest"] = med["total"] - med["hit"] - med["python_ms"]
    return med


def child(tokens, repeats, want_split):
    import torch

    sys.path.insert(0, HERE)
    import generate as G

    from torchtpu.runtime import devices

    models = G.models_on({"cpu", "tpu"})
    strict = G.Runner("strict", models, tokens)
    cpu = G.Runner("cpu_1thread", models, tokens)
    ref = cpu()
    for _ in range(2):
        strict()
    same = bool(torch.equal(strict().cpu(), ref))
    wall, main_cpu, proc_cpu, cpu_wall = [], [], [], []
    for _ in range(repeats):  # interleaved call by call
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        strict()  # ends with torch.tpu.synchronize()
        wall.append(time.perf_counter() - t0)
        main_cpu.append(time.thread_time() - c0)
        proc_cpu.append(time.process_time() - p0)
        t0 = time.perf_counter()
        cpu()
        cpu_wall.append(time.perf_counter() - t0)
    ms = lambda v: 1000 * statistics.median(v) / tokens  # noqa: E731
    out = {"dispatch": devices.cpu_dispatch(), "same": same, "wall": ms(wall),
           "main_cpu": ms(main_cpu), "proc_cpu": ms(proc_cpu), "cpu_1thread": ms(cpu_wall),
           "loops": tight_loops(), "time_split": time_split(strict, tokens, repeats),
           "load": os.getloadavg()[0]}
    if want_split:
        out["split"] = split(strict, tokens)
    print(json.dumps(out))


def _child(sync, args, want_split):
    env = dict(os.environ, TORCHTPU_CPU_SYNC_DISPATCH="1" if sync else "0")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tokens", str(args.tokens),
           "--repeats", str(args.repeats)] + (["--split"] if want_split else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"child ({'sync' if sync else 'async'}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.tokens, args.repeats, args.split)
        return
    sys.path.insert(0, HERE)
    from common import environment

    runs = {"async": [], "sync": []}
    for i in range(args.rounds):  # the two modes alternate, round by round
        for sync in (False, True):
            runs["sync" if sync else "async"].append(_child(sync, args, i == 0 and not sync))
    sp = runs["async"][0]["split"]
    print(f"Strict HF generate, tiny Llama, {args.tokens} tokens: per token "
          f"(default dispatch, one counted call)")
    print(f"  aten ops {sp['aten']}; torchtpu Python frames {sp['torchtpu_frames']}")
    for k, v in sp["by_kind"].items():
        print(f"  {v:>7.2f}  {k}")
    print("  counters: " + ", ".join(f"{k} {v}" for k, v in sp["counters"].items()))
    print("  torchtpu Python entered from C++: "
          + ", ".join(f"{k} {v}" for k, v in sp["python_entries"]))
    print("  most frequent ops: " + ", ".join(f"{k} {v}" for k, v in sp["top_ops"]))
    short = {"metadata op bound in C++": "meta", "no PrivateUse1 kernel (composite, C++)": "comp",
             "program op (C++ Kernel)": "prog", "Python kernel": "py"}
    print("  every op (meta: metadata op in C++, comp: composite, prog: program op, py: Python "
          "kernel): " + ", ".join(f"{k} {short.get(kd, kd)} {v}" for k, kd, v in sp["ops_by_kind"]))
    print()
    med = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    head = f"{'ms/token (median of rounds)':<34}{'async (JAX default)':>20}{'sync':>10}"
    print(head)
    print("-" * len(head))
    for key, label in (("wall", "Strict wall"), ("main_cpu", "Strict main-thread CPU"),
                       ("proc_cpu", "Strict process CPU"), ("cpu_1thread", "PyTorch CPU 1t wall")):
        print(f"{label:<34}{med('async', key):>20.2f}{med('sync', key):>10.2f}")
    for mode in ("async", "sync"):
        print(f"Strict / CPU(1t), {mode}: {med(mode, 'wall') / med(mode, 'cpu_1thread'):.2f}x "
              f"(target <= 2x); tokens = CPU greedy: "
              f"{'yes' if all(r['same'] for r in runs[mode]) else 'NO'}")
    print()
    ts = {m: [r["time_split"] for r in runs[m] if r.get("time_split")] for m in runs}
    if ts["async"] and ts["sync"]:
        tm = lambda mode, key: statistics.median(r[key] for r in ts[mode])  # noqa: E731
        print("Where a token's main-thread CPU time goes, ms/token (fast path's Kernel timing)")
        for key, label in (("total", "generate, main-thread CPU"),
                           ("hit", "C++ fast-path hits, total"),
                           ("call", "  of which the executable's call"),
                           ("ours", "  of which our C++"),
                           ("python_ms", "Kernels that ran the Python path"),
                           ("rest", "rest (HF/PyTorch Python, dispatcher,")):
            print(f"{label:<38}{tm('async', key):>16.3f}{tm('sync', key):>16.3f}")
        print(f"{'  composite/metadata ops, other kernels)':<38}")
        print(f"{'hits / Python-path Kernel calls per token':<38}"
              f"{tm('async', 'hits'):>8.1f} / {tm('async', 'python'):<5.1f}"
              f"{tm('sync', 'hits'):>8.1f} / {tm('sync', 'python'):<5.1f}")
        print(f"{'us per hit: call / our C++':<38}"
              + "".join(f"{1e3 * tm(m, 'call') / tm(m, 'hits'):>9.2f} / "
                        f"{1e3 * tm(m, 'ours') / tm(m, 'hits'):<4.2f}" for m in ("async", "sync")))
        print()
    print(f"{'us per op, tight loop (min / median)':<38}{'async':>16}{'sync':>16}")
    for name in runs["async"][0]["loops"]:
        cell = lambda mode: "%.1f / %.1f" % tuple(  # noqa: E731
            statistics.median(r["loops"][name][i] for r in runs[mode]) for i in (0, 1))
        print(f"{name:<38}{cell('async'):>16}{cell('sync'):>16}")
    print()
    print(environment())
    print("children's load averages: "
          + ", ".join(f"{r['dispatch']} {r['load']:.1f}" for m in runs for r in runs[m]))


if __name__ == "__main__":
    main()
