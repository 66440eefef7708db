#!/usr/bin/env python
"""Where a Strict fast-path hit's time goes, from native stack samples (Linux ``perf``).

A child process runs ``a + b`` (16x16 float32, Strict mode, the C++ fast path: every call a
hit) in a loop; ``perf record --call-graph dwarf`` samples it for a few seconds once it is warm,
and each sample of its main thread is put in the first of these stages its stack is in, from
the leaf up:

  gc                 Python's cyclic collector (collections that the per-op objects trigger)
  JAX call           the executable's C++ call (PjitFunction::Call), of which
    execute          PJRT's Execute (with synchronous XLA:CPU dispatch, the program's run)
  ready check        ArrayImpl.is_ready on the result (inflight.note's first check, in C++)
  output             the output tensor, its storage and Buffer (fastpath.cpp ``wrap``)
  our code           the rest of ``Kernel_serve`` (or of the boxed kernel, ``Boxed``, keying
                     the IValue stack: ``key_ivalue``): the key (``key_of``), the table lookup, the
                     input storages' Buffers and arrays (``storage_buffer``, ``gather``: mostly
                     inlined), the entry match, the counters (``bump``)
  kernel holder      torch.library's PythonKernelHolder: the IValues to Python arguments and the
                     Python result back (the boxed kernel does not pay it on a hit;
                     TORCHTPU_FASTPATH_BOXED=0 binds the Kernels through it, as before)
  dispatcher         the rest of torch's call (Python argument parsing, autograd, dispatch)
  free result        deallocating the previous result (tensor, storage, Buffer, jax array)
  other              the Python loop itself and what no stage above holds

    python benchmarks/fastpath_split.py [--seconds 4] [--gc]

The shares are of the sampled CPU time; with ``per-op`` the split of the loop's CPU time per
op (measured in the child). Without perf (or its permission) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import collections
import os
import select
import shutil
import subprocess
import sys
import tempfile

STAGES = [  # (stage, frame substring), first match from the leaf up
    ("gc", "gc_collect_main"),
    ("execute", "ifrt::PjRtLoadedExecutable::Execute"),
    ("JAX call (dispatch)", "PjitFunction::Call"),
    ("ready check", "jax::PyArray::IsReady"),
    ("output", "(anonymous namespace)::wrap"),
    ("output", "(anonymous namespace)::tensor_on"),
    ("our code", "(anonymous namespace)::Kernel_serve"),
    ("our code", "(anonymous namespace)::Boxed::"),
    ("kernel holder", "PythonKernelHolder::operator()"),
    ("free result", "THPVariable_dealloc"),
    ("free result", "subtype_dealloc"),
    ("dispatcher", "THPVariable_add"),
]


def child(n_warm: int) -> None:
    import gc
    import time

    import torch

    torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to("tpu")
    b = torch.randn(16, 16, generator=g).to("tpu")
    for _ in range(n_warm):
        a + b
    torch.tpu.synchronize()
    if os.environ.get("SPLIT_NO_GC"):
        gc.disable()
    print("ready", flush=True)
    n = 0
    t0 = time.thread_time()
    while sys.stdin.readline().strip() != "stop":  # the parent sends a line per batch
        for _ in range(1000):
            a + b
        n += 1000
    torch.tpu.synchronize()
    print(f"{(time.thread_time() - t0) / max(n, 1) * 1e6:.3f}", flush=True)


def classify(script_text: str, pid: int) -> tuple[collections.Counter, int]:
    stages: collections.Counter = collections.Counter()
    total = 0
    for block in script_text.split("\n\n"):
        lines = [ln.strip() for ln in block.strip().split("\n") if ln.strip()]
        if not lines or lines[0].split()[0] != str(pid):  # the main thread only (tid == pid)
            continue
        total += 1
        frames = [ln.split(None, 1)[1] if len(ln.split(None, 1)) > 1 else "" for ln in lines[1:]]
        stage = "other"
        for f in frames:  # leaf first
            hit = next((s for s, pat in STAGES if pat in f), None)
            if hit is not None:
                stage = hit
                break
        stages[stage] += 1
    return stages, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=6.0, help="how long perf samples")
    p.add_argument("--gc", action="store_true", help="leave Python's collector on in the loop")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(300)
        return 0
    perf = shutil.which("perf")
    if perf is None:
        print("perf is not installed: no split")
        return 0
    env = dict(os.environ)
    if not args.gc:
        env["SPLIT_NO_GC"] = "1"
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        rec = None
        try:
            # (bounded: a child that does not get ready within 5 minutes is killed)
            if (not select.select([proc.stdout], [], [], 300)[0]
                    or proc.stdout.readline().strip() != "ready"):
                print("the child failed before its loop")
                return 1
            proc.stdin.write("go\n")
            proc.stdin.flush()
            rec = subprocess.Popen([perf, "record", "-q", "-F", "999", "--call-graph",
                                    "dwarf,16384", "-p", str(proc.pid), "-o", data],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            import time

            end = time.monotonic() + args.seconds
            while time.monotonic() < end:  # keep the child looping while perf samples
                proc.stdin.write("go\n")
                proc.stdin.flush()
                time.sleep(0.01)
            rec.send_signal(2)
            err = rec.communicate(timeout=120)[1]
            proc.stdin.write("go\n" * 50 + "stop\n")
            proc.stdin.flush()
            per_op = float(proc.stdout.readline().strip() or "nan")
        finally:
            if rec is not None and rec.poll() is None:
                rec.kill()
                rec.wait()
            proc.kill()
            proc.wait()
        if not os.path.exists(data):
            print(f"perf record failed (permissions?): {err.strip()[:300]}")
            return 0
        out = subprocess.run([perf, "script", "--no-inline", "-i", data, "-F", "tid,ip,sym"],
                             capture_output=True, text=True, timeout=600).stdout
        if os.environ.get("SPLIT_DEBUG"):
            print(err[-500:], out[:3000], sep="\n")
    stages, total = classify(out, proc.pid)
    if not total:
        print("no samples of the loop")
        return 0
    print(f"a + b (16x16 float32), Strict fast-path hits: {total} samples of the main thread; "
          f"{per_op:.2f} us CPU per op in the loop; gc {'on' if args.gc else 'off'}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  {'stage':22s} {'share':>7s} {'us/op':>7s}")
    order = ["dispatcher", "kernel holder", "our code", "JAX call (dispatch)",
             "execute", "ready check", "output", "free result", "gc", "other"]
    for s in order:
        if stages[s]:
            share = stages[s] / total
            print(f"  {s:22s} {share * 100:6.1f}% {share * per_op:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
