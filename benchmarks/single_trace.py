"""The GPT training step with ``torch.tpu.optimizers.SingleTraceTrainer`` vs
``torch.compile(backend="tpu")`` of the same step vs Fused eager vs Strict eager.

    python benchmarks/single_trace.py [--repeats N] [--skip strict,fused] [--one-core]

Model, data and AdamW (lr 1e-3) are benchmarks/compile_step.py's small GPT (6 layers, d_model
256, seq 128, vocab 4096, batch 8, float32). Contenders, all in one process:

- ``trainer``: ``SingleTraceTrainer(model, loss, torch.tpu.optimizers.AdamW)``: forward, loss,
  backward and the AdamW update as one XLA program, parameters and state donated;
- ``trainer+joint``: the same, its forward/backward lowered as ``aot_export_module`` gives the
  joint graph rather than partitioned as AOTAutograd's min-cut partitioner does (the A/B of
  optimizers/partition.py);
- ``trainer+rowmajor``: the same, with the saved transposed activations written out in their
  own shape (trainer.py's ``_materialized``, off by default: the backward's batched matmuls then
  read them row-major, on YNNPACK, as in the compiled step, where XLA otherwise folds the
  transposes into Eigen dots);
- ``trainer+savedout``: the same, with the values the backward reads from the forward
  returned as extra outputs of the one program and dropped (trainer.py's ``SAVED_AS_OUTPUTS``,
  the default on XLA:CPU; the other ``trainer`` contenders turn it off): each then has an output buffer of its own, which the heap reuses step after
  step, rather than room in the one temporary block XLA:CPU allocates, and glibc maps afresh,
  every run (the page faults and system CPU rows);
- ``trainer+savedview``: trainer+savedout with the saved values returned as the partition
  saves them (trainer.py's ``SAVED_ROOTS`` off: the A/B of that choice) rather than as the
  arrays the backward reads (a saved transpose's operand, a Linear's product without its bias);
- ``trainer+savedfwd``: trainer+savedout with only the forward's saved values returned
  (trainer.py's ``SAVED_BACKWARD`` off: the A/B of also returning the gradients and the
  loss's backward values on the logits);
- ``compiled``: ``torch.compile(step, backend="tpu")`` of zero_grad + loss + backward +
  ``torch.optim.AdamW(foreach=True).step()`` (compile_step.py's step);
- ``trainer+clip`` / ``compiled+clip``: the same with gradient clipping
  (``max_grad_norm=1.0`` inside the trainer's program; ``clip_grad_norm_(model.parameters(),
  1.0)`` between backward and step in the compiled step) and, for the trainer, ``p.grad``
  written (``write_grads=True``, what code that reads gradients needs);
- ``fused`` / ``strict``: the same step in the Fused / Strict eager modes, with torch.optim's
  AdamW, and ``fused+opt`` / ``strict+opt`` with ``torch.tpu.optimizers.AdamW`` (its step one
  program).

``--one-core`` pins the process to one CPU and turns XLA:CPU's multi-threaded Eigen off
(``--xla_cpu_multi_thread_eigen=false``): the CPU time is then the programs' work alone, with no
thread-level parallelism or idle spinning, to tell a difference in work from one in scheduling.

Prints the median ms per step, wall and process CPU time (split into the main thread's, the
host's Python and dispatch, and the other threads', XLA:CPU's execution), the system (kernel)
CPU and the minor page faults per step (fresh memory: a program's temporaries above glibc's mmap
threshold are mapped anew every run; see docs/ARCHITECTURE.md, Optimizers) (every timed repeat ends with
``torch.tpu.synchronize()``; the repeats go round the contenders so that a changing host load
hits them alike), the first-step time (trace + compile), and the device programs each step ran: Strict's per-op
programs, Fused's graphs, compiled graphs, and the optimizer's and trainer's programs (from
``torch.tpu.metrics()``). Target: trainer <= compiled, one program per step.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compile_step as cs  # noqa: E402  (the shared benchmark models)
from common import Table, environment  # noqa: E402

MODES = {"strict": torch.tpu.EagerMode.DEFER_NEVER, "fused": torch.tpu.EagerMode.DEFER_AND_FUSE}
CONTENDERS = ("trainer", "trainer+joint", "trainer+rowmajor", "trainer+savedout",
              "trainer+savedview", "trainer+savedfwd", "compiled",
              "trainer+clip", "compiled+clip", "fused", "fused+opt", "strict", "strict+opt")
MAX_NORM = 1.0


def programs() -> int:
    """Device programs run so far (each kind counts its calls)."""
    c = torch.tpu.metrics()["counters"]
    return sum(c.get(k, 0) for k in (
        "eager_cache_hits", "eager_cache_misses",  # Strict: one program per op
        "fused_graph_compiles", "fused_graph_cache_hits",  # Fused: one per graph run
        "compile_cache_hits", "compile_cache_misses",  # compiled graphs called
        "optim_programs", "trainer_programs"))


def build(name):
    torch.manual_seed(0)
    model = cs.TinyGPT(**cs.GPT).to("tpu")
    idx, tgt = cs.gpt_data("tpu")
    ours = name.startswith("trainer") or name.endswith("+opt")
    opt = (torch.tpu.optimizers.AdamW(model.parameters(), lr=cs.LR) if ours
           else torch.optim.AdamW(model.parameters(), lr=cs.LR, foreach=True))
    if name.startswith("trainer"):
        kw = dict(max_grad_norm=MAX_NORM, write_grads=True) if name.endswith("+clip") else {}
        trainer = torch.tpu.optimizers.SingleTraceTrainer(model, cs.gpt_loss, opt, **kw)
        trainer._partition = name != "trainer+joint"  # the A/B of the min-cut partition
        trainer._materialize = name == "trainer+rowmajor"  # the A/B of the saved transposes
        # the A/B of the saved values' buffers (on by default on XLA:CPU): trainer+savedout
        # returns them, the other trainers keep them in the temporary block
        trainer._saved_out = name in ("trainer+savedout", "trainer+savedview", "trainer+savedfwd")
        # the A/B of returning the arrays the backward reads (trainer+savedout: a transpose's
        # operand, a Linear's product) rather than the saved values as they are (savedview)
        trainer._capture_roots = name != "trainer+savedview"
        # the A/B of also returning the gradients and the loss's backward values (savedout)
        # rather than the forward's saved values alone (savedfwd)
        trainer._capture_backward = name != "trainer+savedfwd"
        return lambda: trainer.step(idx, tgt)
    step = cs.make_step(cs.gpt_loss)
    if name.endswith("+clip"):
        def step(model, opt, a, b):
            opt.zero_grad(set_to_none=True)
            loss = cs.gpt_loss(model, a, b)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            return loss
    if name.startswith("compiled"):
        torch._dynamo.reset()
        step = torch.compile(step, backend="tpu")
    return lambda: step(model, opt, idx, tgt)


def prepare(name):
    """Build ``name``'s step, run it three times (trace, compile, warm); count its programs."""
    mode = MODES.get(name.split("+")[0], torch.tpu.EagerMode.DEFER_NEVER)
    with torch.tpu.set_eager_mode(mode):
        fn = build(name)
        t0 = time.perf_counter()
        loss = fn()
        torch.tpu.synchronize()
        first = time.perf_counter() - t0
        for _ in range(2):
            fn()
        torch.tpu.synchronize()
        before = programs()
        fn()
        torch.tpu.synchronize()
    return fn, mode, {"first_s": first, "programs": programs() - before,
                      "loss": float(loss.detach())}


def timed(fn, mode, steps):
    """(wall, process CPU, main-thread CPU, system CPU) seconds and minor page faults per step
    over ``steps`` steps ending with a synchronize. The main thread runs the host's Python and
    dispatch; XLA:CPU executes programs on its own threads (process CPU minus main-thread CPU).
    The page faults count fresh memory touched: XLA:CPU allocates a program's temporaries as
    one block per run, which glibc maps anew (and the kernel zeroes) each time when it is
    larger than its mmap threshold (32 MB at most)."""
    with torch.tpu.set_eager_mode(mode):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0, c0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        for _ in range(steps):
            fn()
        torch.tpu.synchronize()
        w1, c1, t1 = time.perf_counter(), time.process_time(), time.thread_time()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        return ((w1 - w0) / steps, (c1 - c0) / steps, (t1 - t0) / steps,
                (r1.ru_stime - r0.ru_stime) / steps, (r1.ru_minflt - r0.ru_minflt) / steps)


def one_core() -> None:
    """Pin this process to one CPU and make XLA:CPU's dots single-threaded. Must run before the
    XLA backend starts (it reads XLA_FLAGS once)."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {cpu})
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_multi_thread_eigen=false").strip()
    torch.set_num_threads(1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed repeat")
    ap.add_argument("--skip", default="", help="comma-separated contenders to leave out")
    ap.add_argument("--one-core", action="store_true",
                    help="one CPU, single-threaded XLA dots: compare work, not scheduling")
    args = ap.parse_args(argv)
    if args.one_core:
        one_core()
    skip = set(filter(None, args.skip.split(",")))
    names = [n for n in CONTENDERS if n not in skip]
    print(environment(), flush=True)
    prepared, res = {}, {}
    for n in names:
        prepared[n] = prepare(n)
        res[n] = prepared[n][2]
        print(f"  {n}: {res[n]['programs']} programs/step, first step {res[n]['first_s']:.1f} s,"
              f" loss {res[n]['loss']:.4f}", flush=True)
    # the repeats go round the contenders, so a change in the host's load hits them alike
    times = {n: [] for n in names}
    gc.disable()
    try:
        for _ in range(args.repeats):
            for n in names:
                fn, mode, _ = prepared[n]
                times[n].append(timed(fn, mode, args.steps))
    finally:
        gc.enable()
    for n in names:
        res[n]["ms"] = 1e3 * statistics.median(t[0] for t in times[n])
        res[n]["cpu_ms"] = 1e3 * statistics.median(t[1] for t in times[n])
        res[n]["host_ms"] = 1e3 * statistics.median(t[2] for t in times[n])
        res[n]["xla_ms"] = 1e3 * statistics.median(t[1] - t[2] for t in times[n])
        res[n]["sys_ms"] = 1e3 * statistics.median(t[3] for t in times[n])
        res[n]["faults"] = statistics.median(t[4] for t in times[n])
        walls = [t[0] for t in times[n]]
        res[n]["spread"] = (max(walls) - min(walls)) / statistics.median(walls)
    table = Table(f"GPT training step (median of {args.repeats} interleaved repeats of "
                  f"{args.steps} steps{', one core' if args.one_core else ''})", names, unit="ms")
    table.add("step, wall", {n: res[n]["ms"] for n in names})
    table.add("step, process CPU", {n: res[n]["cpu_ms"] for n in names})
    table.add("  main thread (host) CPU", {n: res[n]["host_ms"] for n in names})
    table.add("  other threads (XLA) CPU", {n: res[n]["xla_ms"] for n in names})
    table.add("  process CPU in the kernel (system)", {n: res[n]["sys_ms"] for n in names})
    table.add("minor page faults/step", {n: res[n]["faults"] for n in names})
    table.add("programs/step", {n: res[n]["programs"] for n in names})
    table.add("first step (s)", {n: res[n]["first_s"] for n in names})
    worst = max(res[n]["spread"] for n in names)
    table.notes.append(f"noise: (max-min)/median of the wall times up to {100 * worst:.0f}%"
                       + ("  (a loaded machine: the CPU-time row is the steadier one)"
                          if worst > 0.3 else ""))
    table.notes.append(environment())
    table.print([(a, b) for a, b in [("trainer", "compiled"), ("trainer", "trainer+joint"),
                                     ("trainer+rowmajor", "trainer"),
                                     ("trainer+savedout", "trainer"),
                                     ("trainer+savedout", "compiled"),
                                     ("trainer+savedout", "trainer+savedview"),
                                     ("trainer+savedout", "trainer+savedfwd"),
                                     ("trainer+savedfwd", "compiled"),
                                     ("trainer+joint", "compiled"), ("trainer+clip", "compiled+clip"),
                                     ("trainer", "fused"),
                                     ("fused+opt", "fused"), ("strict+opt", "strict")]
                 if a in names and b in names])
    return res


if __name__ == "__main__":
    main()
