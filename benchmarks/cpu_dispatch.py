"""XLA:CPU's dispatch modes side by side: the GPT training step and HF ``generate`` under JAX's
asynchronous dispatch (the default: programs handed to XLA's worker pool) and synchronous
dispatch (``TORCHTPU_CPU_SYNC_DISPATCH=1``: programs run inline on the calling thread).

    python benchmarks/cpu_dispatch.py [--rounds 2] [--repeats 5] [--tokens 32]
                                      [--only train|generate]

The option is read once, when JAX's CPU client is made, so each mode runs in its own child
process; the rounds alternate the two modes (and which goes first) so that a changing host load
hits both alike. Per round and mode:

- ``train``: benchmarks/single_trace.py's GPT training step (Strict and Fused eager with
  torch.optim's AdamW, ``torch.compile(backend="tpu")`` of the step, ``SingleTraceTrainer``):
  median ms per step of ``--repeats`` interleaved repeats, wall and process CPU;
- ``generate``: benchmarks/generate_ops.py's Strict greedy ``generate`` of ``--tokens`` tokens of a
  tiny Llama (ms per token, wall and process CPU) and PyTorch CPU at 1 thread in the same child.

Prints medians over the rounds, sync / async ratios, Strict / Fused per mode (the host-path
target: Strict within 1.5x of Fused) and the load average. Every timed step ends with
``torch.tpu.synchronize()``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = ("strict", "fused", "compiled", "trainer")


def _train_child(repeats):
    sys.path.insert(0, HERE)
    import single_trace

    from torchtpu.runtime import devices

    skip = ",".join(n for n in single_trace.CONTENDERS if n not in TRAIN)
    res = single_trace.main(["--repeats", str(repeats), "--skip", skip])
    print(json.dumps({"dispatch": devices.cpu_dispatch(), "load": os.getloadavg()[0],
                      **{n: {k: res[n][k] for k in ("ms", "cpu_ms", "programs", "loss")}
                         for n in TRAIN}}))


def _run(cmd, sync):
    env = dict(os.environ, TORCHTPU_CPU_SYNC_DISPATCH="1" if sync else "0")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"child ({'sync' if sync else 'async'}) failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = "sync" if sync else "async"
    if out["dispatch"] != want:
        raise SystemExit(f"child ran with {out['dispatch']} dispatch, wanted {want}")
    return out


def _brief(kind, out) -> str:
    """One child's numbers, printed as they come (wall / process CPU ms)."""
    if kind == "train":
        return ", ".join(f"{n} {out[n]['ms']:.0f}/{out[n]['cpu_ms']:.0f} ms" for n in TRAIN)
    return (f"Strict {out['wall']:.2f}/{out['proc_cpu']:.2f} ms/token, "
            f"CPU 1t {out['cpu_1thread']:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--only", choices=("train", "generate"))
    ap.add_argument("--child-train", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_train:
        _train_child(args.repeats)
        return
    sys.path.insert(0, HERE)
    from common import environment

    print(environment(), flush=True)
    kinds = [k for k in ("train", "generate") if args.only in (None, k)]
    cmds = {"train": [sys.executable, os.path.abspath(__file__), "--child-train",
                      "--repeats", str(args.repeats)],
            "generate": [sys.executable, os.path.join(HERE, "generate_ops.py"), "--child",
                         "--tokens", str(args.tokens), "--repeats", str(args.repeats)]}
    runs = {(k, m): [] for k in kinds for m in ("async", "sync")}
    for i in range(args.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)  # alternate who goes first
        for kind in kinds:
            for sync in order:
                out = _run(cmds[kind], sync)
                runs[(kind, out["dispatch"])].append(out)
                print(f"  round {i + 1} {kind} {out['dispatch']}: {_brief(kind, out)}, "
                      f"load {out['load']:.1f}", flush=True)
    med = lambda kind, mode, f: statistics.median(f(r) for r in runs[(kind, mode)])  # noqa: E731
    head = (f"{'median of ' + str(args.rounds) + ' rounds':<40}{'async':>10}{'sync':>10}"
            f"{'sync/async':>12}")
    print()
    print(head)
    print("-" * len(head))

    def row(label, kind, f):
        a, s = med(kind, "async", f), med(kind, "sync", f)
        print(f"{label:<40}{a:>10.2f}{s:>10.2f}{s / a:>11.2f}x")

    if "train" in kinds:
        for n in TRAIN:
            row(f"GPT step {n}, wall ms", "train", lambda r, n=n: r[n]["ms"])
            row(f"GPT step {n}, process CPU ms", "train", lambda r, n=n: r[n]["cpu_ms"])
        for mode in ("async", "sync"):
            ratio = (med("train", mode, lambda r: r["strict"]["ms"])
                     / med("train", mode, lambda r: r["fused"]["ms"]))
            print(f"Strict / Fused step, {mode}: {ratio:.2f}x (target <= 1.5x)")
        same = all(r[n]["loss"] == runs[("train", "async")][0][n]["loss"]
                   for rs in (runs[("train", "async")], runs[("train", "sync")]) for r in rs
                   for n in TRAIN)
        print(f"losses equal across modes: {'yes' if same else 'NO'}")
    if "generate" in kinds:
        row("generate Strict, wall ms/token", "generate", lambda r: r["wall"])
        row("generate Strict, process CPU ms/token", "generate", lambda r: r["proc_cpu"])
        row("PyTorch CPU 1 thread, ms/token", "generate", lambda r: r["cpu_1thread"])
        print("tokens = CPU greedy: "
              + ("yes" if all(r["same"] for m in ("async", "sync")
                              for r in runs[("generate", m)]) else "NO"))
    print(environment())


if __name__ == "__main__":
    main()
