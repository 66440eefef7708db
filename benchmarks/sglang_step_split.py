"""Where an SGLang decode step's time goes on "tpu": the compiled decode program alone vs the
host work of SGLang's scheduler around it, on benchmarks/sglang_serving.py's tiny Llama and
offline workload (its ``compiled`` contender: paged attention, compiled decode and prefill,
SGLang's overlap scheduler).

    .venv-sglang/bin/python benchmarks/sglang_step_split.py [--requests 16] [--rounds 3]
        [--py-spy OUT]

Compare with ``.venv-vllm/bin/python benchmarks/vllm_step_split.py --model sglang --requests
16 --contenders tpu-compiled`` (vLLM on "tpu", same model and requests, its program replayed
the same way).

The scheduler runs in its own process (SGLang spawns it); this script's module is imported
there as ``__mp_main__``, where it registers timers through SGLang's plugin hook registry
(``HookRegistry``, applied when SGLang loads its plugins in that process). Per steady decode
step (every request of the batch decoding; the scheduler loop's iterations from one such
step's ``run_batch`` to the next), the wall and the scheduler thread's CPU time of SGLang's
parts of a step (``time.thread_time``). In the last timed round, the first decode step of the
full batch is replayed through the graph runner's compiled program alone (the bucket's padded
inputs, the program through ``torch.compile``'s guarded call, the logits brought to the host),
per call: wall, the calling thread's CPU (the host part of a call) and the CPU of every thread
of the process (XLA:CPU runs the program on its own threads; also per thread name from
/proc), and the wall until the call returns (its dispatch, the program still running).
Extend (prefill) steps: each compiled extend of the timed rounds (tokens, bucket, the step's
wall until its logits are on the host: the probe waits for them there, so a round's extend
does not overlap what follows it), and in the last round the first extend of a bucket of at
least 2,048 tokens replayed alone (the bucket's padded inputs, the program through the guarded
call, logits to the host; wall and CPU per thread name), then the whole step again (SGLang's
tensors padded on the host + the program + logits).
``--py-spy OUT`` records the scheduler's Python stacks (idle included) over the timed rounds.
Every step ends with data on the host.
The load average is printed with the table: compare runs taken on a quiet host.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))
sys.path.insert(0, HERE)
from common import thread_cpu  # noqa: E402

ENV = "TORCHTPU_SGLANG_STEP_SPLIT_DIR"  # the parent's folder: flags in, results out
SCHED = "sglang.srt.managers.scheduler.Scheduler."
PARTS = [  # (label, target); a label's time includes the parts nested under it
    ("scheduler: ingest requests", SCHED + "ingest_requests"),
    ("scheduler: next batch", SCHED + "get_next_batch_to_run"),
    ("scheduler: run batch (launch)", SCHED + "run_batch"),
    ("  worker: forward + sample", "sglang.srt.managers.tp_worker.TpModelWorker."
                                   "forward_batch_generation"),
    ("    model runner: forward", "sglang.srt.model_executor.model_runner.ModelRunner.forward"),
    ("      graph runner: pad + program call", "torchtpu.sglang.graph_runner.TpuGraphRunner."
                                               "execute"),
    ("    model runner: sample", "sglang.srt.model_executor.model_runner.ModelRunner.sample"),
    ("scheduler: result copy to host", SCHED + "_copy_result_to_cpu"),
    ("scheduler: process result", SCHED + "process_batch_result"),
]
LOOP = "scheduler loop iteration (all)"


# ---- in the scheduler process ----

class _Probe:
    def __init__(self, folder, batch):
        self.folder, self.batch = folder, batch
        self.wall = collections.defaultdict(float)
        self.cpu = collections.defaultdict(float)
        self.steps = 0  # steady decode steps launched
        self.loops = 0  # loop iterations from one such step's launch to the next's
        self.active = False  # timing on (the driver's flag, looked at once per step)
        self.decode = False  # the step launched last is a steady decode step
        self.last_launch = None
        self.replay = None
        self.extends = []  # timed rounds: (tokens, bucket name, wall s) per compiled extend
        self.extend_replay = None

    def timed(self, label):
        def around(original, *args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            t, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                if self.decode:
                    self.wall[label] += time.perf_counter() - t
                    self.cpu[label] += time.thread_time() - c
        return around

    def run_batch(self, original, scheduler, batch, *args, **kwargs):
        """Marks a steady decode step (every request of the batch decoding) and times the
        loop from one to the next."""
        self.active = os.path.exists(os.path.join(self.folder, "timed"))
        if not self.active:
            return original(scheduler, batch, *args, **kwargs)
        now, c = time.perf_counter(), time.thread_time()
        decode = batch.forward_mode.is_decode() and batch.batch_size() == self.batch
        if decode and self.decode and self.last_launch is not None:
            self.wall[LOOP] += now - self.last_launch[0]
            self.cpu[LOOP] += c - self.last_launch[1]
            self.loops += 1
        self.decode, self.last_launch = decode, (now, c)
        self.steps += decode
        return self.timed(PARTS[2][0])(original, scheduler, batch, *args, **kwargs)

    def execute(self, original, runner, forward_batch, *args, **kwargs):
        out = original(runner, forward_batch, *args, **kwargs)
        if (self.replay is None and forward_batch.batch_size == self.batch
                and os.path.exists(os.path.join(self.folder, "replay"))):
            cap = os.environ.get(ENV + "_CAPTURE")
            if cap:
                import sglang_program_ab
                sglang_program_ab.install()
            self.replay = _replay(runner, forward_batch)
            if cap:
                sglang_program_ab.dump(cap)
                # the same executable called directly here (no torch.compile path), beside
                # the captured ones named by _CAPTURE_AB: program or process?
                more = [f for f in os.environ.get(ENV + "_CAPTURE_AB", "").split(",") if f]
                self.replay["in_scheduler"] = sglang_program_ab.time_programs([cap] + more)
        return out

    def extend(self, original, runner, forward_batch, key, *args, **kwargs):
        t = time.perf_counter()
        out = original(runner, forward_batch, key, *args, **kwargs)
        if self.active:
            if not os.environ.get(ENV + "_NO_EXTEND_WAIT"):
                out.next_token_logits.cpu()  # wait for the program: the step's wall
            self.extends.append((int(forward_batch.input_ids.shape[0]),
                                 "x".join(str(k) for k in key), time.perf_counter() - t))
        if (self.extend_replay is None and key[0] >= 2048
                and os.path.exists(os.path.join(self.folder, "replay"))):
            self.extend_replay = _replay_extend(runner, key)
            # the whole step again (host padding + program + logits), as the scheduler ran it
            t = time.perf_counter()
            for _ in range(3):
                original(runner, forward_batch, key, *args, **kwargs).next_token_logits.cpu()
            self.extend_replay["step_wall_s"] = (time.perf_counter() - t) / 3
            self.extend_replay["load"] = os.getloadavg()[0]
        return out

    def after_idle(self, result, scheduler, *args, **kwargs):
        ask = os.path.join(self.folder, "dump")
        if os.path.exists(ask):
            n = max(1, self.steps)
            wall = {k: v / n for k, v in self.wall.items()}
            cpu = {k: v / n for k, v in self.cpu.items()}
            if self.loops:
                wall[LOOP], cpu[LOOP] = self.wall[LOOP] / self.loops, self.cpu[LOOP] / self.loops
            res = dict(steps=self.steps, loops=self.loops, wall=wall, cpu=cpu,
                       replay=self.replay, extends=self.extends,
                       extend_replay=self.extend_replay)
            self.extends = []
            tmp = os.path.join(self.folder, "result.tmp")
            with open(tmp, "w") as f:
                json.dump(res, f)
            os.replace(tmp, os.path.join(self.folder, "result.json"))
            os.unlink(ask)
            self.wall.clear()
            self.cpu.clear()
            self.steps = self.loops = 0
            self.last_launch, self.decode = None, False
        return result


def _replay(runner, forward_batch, calls=20, repeats=10):
    """The decode program alone, with the step's padded inputs (the bucket's batch, as
    ``execute`` left it): the same KV slots are rewritten with the same values."""
    import torch
    from sglang.srt.utils.common import DynamicGradMode

    from torchtpu.sglang.attention import kv_width

    key = (runner.bs, kv_width(forward_batch, runner.page_size, runner.kv_full))
    fb = runner.batches[key]
    wall, cpu, pcpu, launch = [], [], [], []
    threads0, m0 = thread_cpu(), torch.tpu.metrics()["counters"]
    with DynamicGradMode():
        for _ in range(repeats):
            t, c, pc = time.perf_counter(), time.thread_time(), time.process_time()
            lt = 0.0
            for _ in range(calls):
                t1 = time.perf_counter()
                out = runner._run(fb)
                lt += time.perf_counter() - t1
                out.next_token_logits.cpu()
            wall.append((time.perf_counter() - t) / calls)
            cpu.append((time.thread_time() - c) / calls)
            pcpu.append((time.process_time() - pc) / calls)
            launch.append(lt / calls)
    threads1, m1 = thread_cpu(), torch.tpu.metrics()["counters"]
    n = calls * repeats
    per_thread = collections.Counter()
    for tid, (name, t1) in threads1.items():
        per_thread[name] += (t1 - threads0.get(tid, (name, 0.0))[1]) / n
    return dict(bucket=key[0], kv_width=key[1], wall_s=statistics.median(wall),
                threads_cpu_s={k: v for k, v in per_thread.most_common(6) if v > 0},
                # per call: torchtpu's counters (KV buffers donated to the program, syncs...)
                counters={k: (m1[k] - m0.get(k, 0)) / n for k in m1
                          if isinstance(m1[k], (int, float)) and m1[k] != m0.get(k, 0)},
                thread_cpu_s=statistics.median(cpu), process_cpu_s=statistics.median(pcpu),
                launch_s=statistics.median(launch))


def _replay_extend(runner, key, calls=3, repeats=3):
    """The extend program of bucket ``key`` alone, with the step's padded inputs (the
    bucket's batch as ``execute`` left it; the same KV slots rewritten with the same values),
    logits to the host: wall and CPU per call."""
    from sglang.srt.model_executor.forward_context import ForwardContext
    from sglang.srt.utils.common import DynamicGradMode

    fb = runner.batches[key]
    ctx = ForwardContext(attn_backend=runner.model_runner.attn_backend)
    wall, pcpu = [], []
    threads0 = thread_cpu()
    with DynamicGradMode():
        for _ in range(repeats):
            t, pc = time.perf_counter(), time.process_time()
            for _ in range(calls):
                runner._call(fb, key, ctx).next_token_logits.cpu()
            wall.append((time.perf_counter() - t) / calls)
            pcpu.append((time.process_time() - pc) / calls)
    threads1 = thread_cpu()
    per_thread = collections.Counter()
    for tid, (name, t1) in threads1.items():
        per_thread[name] += (t1 - threads0.get(tid, (name, 0.0))[1]) / (calls * repeats)
    return dict(bucket="x".join(str(k) for k in key), wall_s=statistics.median(wall),
                process_cpu_s=statistics.median(pcpu),
                threads_cpu_s={k: v for k, v in per_thread.most_common(6) if v > 0})


def _install_probe(folder, batch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    probe = _Probe(folder, batch)
    for label, target in PARTS:
        if target != SCHED + "run_batch":
            HookRegistry.register(target, probe.timed(label), HookType.AROUND)
    HookRegistry.register(SCHED + "run_batch", probe.run_batch, HookType.AROUND)
    HookRegistry.register("torchtpu.sglang.graph_runner.TpuGraphRunner.execute",
                          probe.execute, HookType.AROUND)
    HookRegistry.register("torchtpu.sglang.prefill.TpuPrefillRunner.execute",
                          probe.extend, HookType.AROUND)
    HookRegistry.register(SCHED + "on_idle", probe.after_idle, HookType.AFTER)


if __name__ == "__mp_main__" and os.environ.get(ENV):
    _install_probe(os.environ[ENV], int(os.environ[ENV + "_BATCH"]))


# ---- the driver ----

def _ask(folder, timeout=120):
    res = os.path.join(folder, "result.json")
    if os.path.exists(res):
        os.unlink(res)
    open(os.path.join(folder, "dump"), "w").close()
    t = time.perf_counter()
    while not os.path.exists(res):
        if time.perf_counter() - t > timeout:
            raise RuntimeError("the scheduler did not answer (is it idle?)")
        time.sleep(0.05)
    with open(res) as f:
        return json.load(f)


def _py_spy(out):
    import psutil

    sched = [p for p in psutil.Process().children(recursive=True)
             if "scheduler" in " ".join(p.cmdline() or [p.name()])]
    if not sched:
        raise RuntimeError("no SGLang scheduler process found to record")
    exe = os.environ.get("PY_SPY", "py-spy")
    return subprocess.Popen([exe, "record", "--idle", "-r", "200", "-f", "raw", "-o", out,
                             "-p", str(sched[0].pid)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _plain_ab(folders):
    """sglang_program_ab.py ab on ``folders`` in a plain process of this venv (the engine
    idle meanwhile): its report."""
    p = subprocess.run([sys.executable, os.path.join(HERE, "sglang_program_ab.py"), "ab",
                        *folders], capture_output=True, text=True, timeout=600)
    out = p.stdout
    return out[out.index("## "):] if "## " in out else p.stderr[-2000:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-tokens", type=int, default=32)
    ap.add_argument("--py-spy", metavar="OUT", help="also record the scheduler process with "
                    "py-spy (on PATH, or $PY_SPY) during the timed rounds: raw stacks, idle "
                    "included, to OUT")
    ap.add_argument("--no-extend-wait", action="store_true",
                    help="time the rounds' extends to their launch only (no wait for their "
                    "logits: SGLang's overlap as it runs unprobed)")
    ap.add_argument("--engine-args", default="{}",
                    help="JSON: more sgl.Engine arguments (e.g. {\"page_size\": 16})")
    ap.add_argument("--capture", metavar="OUT",
                    help="also write the replayed decode program's executable and inputs to "
                    "the folder OUT (for sglang_program_ab.py ab), and time it called directly "
                    "in the scheduler process")
    ap.add_argument("--capture-ab", nargs="*", default=[], metavar="DIR",
                    help="with --capture: other captured programs (sglang_program_ab.py) timed "
                    "alternately with it in the scheduler process")
    a = ap.parse_args()
    import sglang as sgl
    import sglang_serving as bench
    from tiny_models import save_tiny_model

    folder = tempfile.mkdtemp(prefix="sglang-step-split-")
    os.environ[ENV], os.environ[ENV + "_BATCH"] = folder, str(a.requests)
    if a.capture:
        os.environ[ENV + "_CAPTURE"] = os.path.abspath(a.capture)
        os.environ[ENV + "_CAPTURE_AB"] = ",".join(os.path.abspath(f) for f in a.capture_ab)
    if a.no_extend_wait:
        os.environ[ENV + "_NO_EXTEND_WAIT"] = "1"
    os.environ.setdefault("TORCHTPU_CACHE_DIR", tempfile.mkdtemp(prefix="bench-cache-"))
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench-llama-"), **bench.MODEL)
    print(f"load: {os.getloadavg()}", flush=True)
    t0 = time.perf_counter()
    llm = sgl.Engine(model_path=path, device="tpu", dtype="float32", max_total_tokens=32768,
                     disable_radix_cache=True, random_seed=0, log_level="error",
                     **dict(bench._engine_args("compiled", a.requests),
                            **json.loads(a.engine_args)))
    start_s = time.perf_counter() - t0
    sp = {"temperature": 0, "max_new_tokens": a.out_tokens, "ignore_eos": True}
    reqs = bench._requests(a.requests)
    runs = []
    try:
        llm.generate(input_ids=reqs, sampling_params=sp)  # warm-up round
        open(os.path.join(folder, "timed"), "w").close()
        spy = _py_spy(a.py_spy) if a.py_spy else None
        for i in range(a.rounds):
            _ask(folder)  # counters from zero
            t = time.perf_counter()
            outs = llm.generate(input_ids=reqs, sampling_params=sp)
            dt = time.perf_counter() - t
            r = _ask(folder)
            r.update(s=dt, tok_s=sum(len(o["output_ids"]) for o in outs) / dt)
            runs.append(r)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
            spy.wait(timeout=120)
        plain = []  # the captured programs timed in a plain process just before and after
        if a.capture_ab:
            plain.append(_plain_ab(a.capture_ab))
        open(os.path.join(folder, "replay"), "w").close()
        llm.generate(input_ids=reqs, sampling_params=sp)
        last = _ask(folder)
        if a.capture_ab:
            plain.append(_plain_ab(a.capture_ab))
        replay, extend_replay = last["replay"], last["extend_replay"]
    finally:
        llm.shutdown()
    res = sorted(runs, key=lambda r: r["s"])[len(runs) // 2]
    print(f"\n## SGLang decode step split on \"tpu\" (compiled contender), {a.requests} "
          f"requests x {a.out_tokens} tokens, greedy, engine start {start_s:.0f} s, load "
          f"{os.getloadavg()}: ms per steady decode step ({res['steps']} in the median "
          "round), wall / scheduler-thread CPU\n")
    print("| part | ms |")
    print("|---|---|")
    for label, _ in PARTS + [(LOOP, None)]:
        print(f"| {label} | {res['wall'].get(label, 0) * 1e3:.2f} / "
              f"{res['cpu'].get(label, 0) * 1e3:.2f} |")
    print(f"| output tok/s (round) | {res['tok_s']:.0f} |")
    if replay:
        print(f"\nthe decode program alone (bucket {replay['bucket']}, KV width "
              f"{replay['kv_width']}; padded inputs, guarded call, logits to the host): "
              f"{replay['wall_s'] * 1e3:.2f} ms wall / {replay['thread_cpu_s'] * 1e3:.2f} ms "
              f"calling-thread CPU / {replay['process_cpu_s'] * 1e3:.2f} ms CPU of every "
              f"thread per call; the call returns after {replay['launch_s'] * 1e3:.2f} ms")
        print("  torchtpu counters per call: " + ", ".join(
            f"{k} {v:g}" for k, v in sorted(replay.get("counters", {}).items())))
        print("  CPU ms per call by thread name: " + ", ".join(
            f"{k} {v * 1e3:.2f}" for k, v in replay.get("threads_cpu_s", {}).items()))
    if replay and replay.get("in_scheduler"):
        import sglang_program_ab

        if plain:
            print("\n" + plain[0])
        sglang_program_ab.report(replay["in_scheduler"], "the captured programs called "
                                 "directly in the scheduler process, alternately")
        if len(plain) > 1:
            print("\n" + plain[1])
    for i, r in enumerate(runs):
        print(f"  round {i}: compiled extends (tokens, bucket, ms to logits on the host, or to the launch with "
              "--no-extend-wait): "
              + ", ".join(f"({n}, {b}, {w * 1e3:.0f})" for n, b, w in r.get("extends", [])))
    if extend_replay:
        print(f"\nthe extend program alone (bucket {extend_replay['bucket']}; padded inputs, "
              f"guarded call, logits to the host): {extend_replay['wall_s'] * 1e3:.1f} ms wall / "
              f"{extend_replay['process_cpu_s'] * 1e3:.1f} ms CPU of every thread per call; by "
              "thread name: " + ", ".join(f"{k} {v * 1e3:.1f}"
                                          for k, v in extend_replay["threads_cpu_s"].items()))
        print(f"  the whole extend step again (host padding + program + logits): "
              f"{extend_replay['step_wall_s'] * 1e3:.1f} ms wall (load {extend_replay['load']:.1f})")
    print("RESULT " + json.dumps(dict(start_s=start_s, runs=runs, replay=replay,
                                      extend_replay=extend_replay)))


if __name__ == "__main__":
    main()
