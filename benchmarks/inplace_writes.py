"""In-place writes cost what they write (issue #25): time and peak memory per write, by executor.

    python benchmarks/inplace_writes.py [--only writes|generate|adamw] [--sizes 16,512]
                                        [--ops copy_,index_copy_] [--executors strict,fused]

writes    Each op writes 8 MiB (2 rows of 4 MiB) into a float32 tensor of 16 MiB .. 1 GiB:
          ``copy_`` into a slice, ``index_copy_``, ``index_put_``, slice assignment,
          ``masked_fill_`` of a slice, ``scatter_``, ``scatter_add_``, ``index_add_``,
          ``fill_``/``zero_``/``add_``/``mul_`` on a slice. Per executor (tpu Strict, Fused, compiled;
          PyTorch CPU eager side by side, in the same process): median ms per write (each timed
          repeat ends with ``torch.tpu.synchronize()``), and the extra peak memory a write
          needs: the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs)
          during 3 writes, less the resident memory before them. The target: every write into
          512 MiB within 3x of the same write into 16 MiB.
generate  Hugging Face greedy ``generate()`` with a static cache of max length 256 .. 8192 on a
          tiny random Llama (2 layers): time per decode token, from warm calls of 16 and 144
          new tokens (the difference over 128 tokens; medians of the calls after the first),
          tpu (the decode step compiled by transformers, and eager) and PyTorch CPU. Target:
          length 8192 within 1.2x of length 256.
adamw     Peak resident memory of one AdamW step (foreach and fused) over 1 GiB of parameters
          (8 x 128 MiB) in a fresh process per case, against CUDA's budget: parameters + gradients
          + 2 states + one parameter's worth of temporaries. The step after the first (states
          exist, programs compiled): the rise of VmHWM over the resident memory before it.

Numbers only compare within a run (benchmarks/common.py); the machine is shared, so the load
average is printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, Timer, environment, proc_status, reset_peak, settle_rss  # noqa: E402

MiB = 1 << 20
ROW = 1 << 20  # float32 elements in a row: 4 MiB
SIZES = (16, 64, 256, 512, 1024)  # MiB


# ---- writes ----

def _ops(dev):
    """name -> (setup(x) -> state, write(x, state)); each write puts 8 MiB into rows 2-3."""
    def src():
        return torch.full((2, ROW), 1.5, device=dev)

    def idx():
        return torch.tensor([2, 3], device=dev)

    def scatter_index():
        return torch.tensor([2, 3], device=dev).view(2, 1).expand(2, ROW).contiguous()

    def mask():
        return (torch.arange(2 * ROW, device=dev) % 2 == 0).view(2, ROW)

    def setitem(x, s):
        x[2:4] = s[0]

    return {
        "copy_ into slice": (lambda: (src(),), lambda x, s: x[2:4].copy_(s[0])),
        "index_copy_": (lambda: (idx(), src()), lambda x, s: x.index_copy_(0, s[0], s[1])),
        "index_put_": (lambda: (idx(), src()), lambda x, s: x.index_put_((s[0],), s[1])),
        "slice assignment": (lambda: (src(),), setitem),
        "masked_fill_ (slice)": (lambda: (mask(),), lambda x, s: x[2:4].masked_fill_(s[0], 2.0)),
        "scatter_": (lambda: (scatter_index(), src()),
                     lambda x, s: x.scatter_(0, s[0], s[1])),
        "scatter_add_": (lambda: (scatter_index(), src()),
                         lambda x, s: x.scatter_add_(0, s[0], s[1])),
        "index_add_": (lambda: (idx(), src()), lambda x, s: x.index_add_(0, s[0], s[1])),
        "fill_ (slice)": (lambda: (), lambda x, s: x[2:4].fill_(3.0)),
        "zero_ (slice)": (lambda: (), lambda x, s: x[2:4].zero_()),
        "add_ (slice)": (lambda: (), lambda x, s: x[2:4].add_(1.0)),
        "mul_ (slice)": (lambda: (), lambda x, s: x[2:4].mul_(0.5)),
    }


EXECUTORS = ("cpu", "strict", "fused", "compiled")


def _measure_write(executor, size_mib, name, timer):
    dev = "cpu" if executor == "cpu" else "tpu"
    setup, write = _ops(dev)[name]
    x = torch.zeros(size_mib * MiB // 4 // ROW, ROW, device=dev)
    state = setup()
    sync = torch.tpu.synchronize if dev == "tpu" else None
    if executor == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(lambda x, *s: write(x, s), backend="tpu")
        call = lambda: fn(x, *state)  # noqa: E731
    else:
        call = lambda: write(x, state)  # noqa: E731
    mode = torch.tpu.EagerMode.DEFER_AND_FUSE if executor == "fused" else \
        torch.tpu.EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode(mode):
        for _ in range(3):  # compile
            call()
        if sync:
            sync()
        base = settle_rss()
        peak = None
        if reset_peak():
            for _ in range(3):
                call()
                if sync:
                    sync()
            peak = max(proc_status("VmHWM") - base, 0)
        m = timer.measure(call, sync=sync, number=5 if size_mib >= 512 and executor != "cpu"
                          else None)
    del x, state
    return m.median_s * 1e3, peak


def run_writes(sizes, ops, executors, repeats):
    timer = Timer(warmup=2, repeats=repeats, min_repeat_s=0.02, max_number=200)
    before = dict(torch.tpu.metrics()["counters"])
    results = {}
    for name in ops:
        for size in sizes:
            for ex in executors:
                results[(name, size, ex)] = _measure_write(ex, size, name, timer)
    after = torch.tpu.metrics()
    table = Table(f"8 MiB written into a float32 tensor of N MiB: ms per write (median of "
                  f"{repeats}) | extra peak resident MiB during 3 writes",
                  [f"{ex}" for ex in executors], unit="ms")
    for name in ops:
        for size in sizes:
            vals = {ex: results[(name, size, ex)][0] for ex in executors}
            table.add(f"{name}, {size} MiB", vals)
    notes = []
    for ex in executors:
        worst = []
        for name in ops:
            t16 = results.get((name, min(sizes), ex))
            t512 = results.get((name, 512, ex)) or results.get((name, max(sizes), ex))
            if t16 and t512:
                worst.append((t512[0] / t16[0], name))
        if worst:
            r, n = max(worst)
            notes.append(f"{ex}: worst {max(s for s in sizes if s <= 512)} MiB / "
                         f"{min(sizes)} MiB time ratio {r:.2f}x ({n})")
    peaks = []
    for name in ops:
        for size in sizes:
            cells = []
            for ex in executors:
                p = results[(name, size, ex)][1]
                cells.append("-" if p is None else f"{p / MiB:.0f}")
            peaks.append(f"  {name}, {size} MiB: extra peak MiB " + " / ".join(
                f"{ex} {c}" for ex, c in zip(executors, cells)))
    table.notes += ["", *notes, "", "peak memory (VmHWM rise over VmRSS before the writes):",
                    *peaks]
    c = after["counters"]
    table.notes.append("donation: eager_donated_writes +%d, eager_copied_writes +%d %s, "
                       "fused_donated_buffers +%d, compile_donated_buffers +%d" % (
                           c.get("eager_donated_writes", 0) - before.get("eager_donated_writes", 0),
                           c.get("eager_copied_writes", 0) - before.get("eager_copied_writes", 0),
                           after["per_op"].get("eager_copied_writes", {}),
                           c.get("fused_donated_buffers", 0) - before.get("fused_donated_buffers", 0),
                           c.get("compile_donated_buffers", 0)
                           - before.get("compile_donated_buffers", 0)))
    table.notes.append(timer.noise_note())
    table.print()


# ---- generate with a static cache ----

def _llama(device):
    import logging

    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=8192, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval().to(device)


SHORT, LONG = 16, 144  # new tokens of the two timed calls: their difference is 128 decode steps


def child_generate(device, lengths, calls, eager=False):
    """ms per decode token per cache length; ``eager``: transformers' decode step not compiled
    (``disable_compile=True``: Strict per-op programs; on "tpu" transformers compiles it)."""
    from transformers import StaticCache

    model = _llama(device)
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    out = {}
    for length in lengths:
        per = {}
        for new in (SHORT, LONG):
            times = []
            for _ in range(calls):
                cache = StaticCache(config=model.config, max_cache_len=length)
                t0 = time.perf_counter()
                with torch.no_grad():
                    toks = model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, past_key_values=cache,
                                          disable_compile=eager)
                toks.cpu()
                times.append(time.perf_counter() - t0)
            per[new] = statistics.median(times[1:])  # the first call compiles
        out[length] = (per[LONG] - per[SHORT]) / (LONG - SHORT) * 1e3  # ms per decode token
    c = torch.tpu.metrics()["counters"] if device == "tpu" else {}
    return {"ms_per_token": out, "counters": {k: c.get(k, 0) for k in (
        "eager_donated_writes", "eager_copied_writes", "compile_donated_buffers")}}


def run_generate(lengths, calls):
    cols = {"tpu": ("tpu", False), "tpu eager": ("tpu", True), "cpu": ("cpu", False)}
    res = {c: _spawn({"case": "generate", "device": d, "lengths": lengths, "calls": calls,
                      "eager": e}) for c, (d, e) in cols.items()}
    table = Table("HF static-cache greedy generate, tiny Llama: ms per decode token (tpu: the "
                  "decode step compiled by transformers; tpu eager: disable_compile=True)",
                  list(cols), unit="ms")
    for length in lengths:
        table.add(f"max length {length}", {c: res[c]["ms_per_token"][str(length)]
                                           for c in cols})
    for c in ("tpu", "tpu eager"):
        t = res[c]["ms_per_token"]
        table.notes.append(f"{c}: length {lengths[-1]} / length {lengths[0]}: "
                           f"{t[str(lengths[-1])] / t[str(lengths[0])]:.2f}x (target <= 1.2x); "
                           f"counters {res[c]['counters']}")
    table.print(ratios=[("tpu", "cpu"), ("tpu eager", "cpu")])


# ---- AdamW peak memory ----

N_PARAMS, PARAM_MIB = 8, 128


def child_adamw(device, impl):
    n = PARAM_MIB * MiB // 4
    torch.empty(1, device=device).normal_()  # the runtime and its first program: not tensors
    rss0 = settle_rss()
    params = [torch.nn.Parameter(torch.empty(n, device=device).normal_()) for _ in range(N_PARAMS)]
    for p in params:
        p.grad = torch.empty(n, device=device).normal_()
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=impl == "foreach",
                            fused=impl == "fused" or None)
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
    sync()
    reset_peak()
    t0 = time.perf_counter()
    opt.step()  # creates the states (and compiles on tpu)
    sync()
    first_s = time.perf_counter() - t0
    first_peak = proc_status("VmHWM") - rss0
    before = settle_rss()
    reset_peak()
    t0 = time.perf_counter()
    opt.step()
    sync()
    step_s = time.perf_counter() - t0
    peak = proc_status("VmHWM")
    return {"base_mib": (before - rss0) / MiB, "step_extra_mib": (peak - before) / MiB,
            "step_peak_mib": (peak - rss0) / MiB, "first_step_peak_mib": first_peak / MiB,
            "first_s": first_s, "step_s": step_s}


def run_adamw():
    budget = (N_PARAMS * PARAM_MIB) * 4 + PARAM_MIB  # params, grads, 2 states + one parameter
    table = Table(f"AdamW step over {N_PARAMS} x {PARAM_MIB} MiB parameters: resident MiB above "
                  f"the process before the parameters (CUDA budget {budget} MiB)",
                  ["held", "step peak", "step extra", "first step peak"], unit="MiB")
    times = []
    for impl in ("foreach", "fused"):
        for dev in ("tpu", "cpu"):
            r = _spawn({"case": "adamw", "device": dev, "impl": impl})
            table.add(f"{dev} {impl}", {"held": r["base_mib"], "step peak": r["step_peak_mib"],
                                         "step extra": r["step_extra_mib"],
                                         "first step peak": r["first_step_peak_mib"]})
            times.append(f"{dev} {impl}: second step {r['step_s'] * 1e3:.0f} ms")
    table.notes.append("held: parameters + gradients + states after the first step; step peak: "
                       "the second step's VmHWM; step extra: its rise over what was held")
    table.notes.append("; ".join(times))
    table.print()


def _spawn(spec):
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("writes", "generate", "adamw"))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--ops", default="")
    ap.add_argument("--executors", default=",".join(EXECUTORS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", default="256,1024,4096,8192")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        spec = json.loads(a.child)
        if spec["case"] == "generate":
            res = child_generate(spec["device"], spec["lengths"], spec["calls"],
                                 spec.get("eager", False))
        else:
            res = child_adamw(spec["device"], spec["impl"])
        print(json.dumps(res))
        return
    print(environment())
    if a.only in (None, "writes"):
        names = list(_ops("cpu"))
        ops = [o for o in a.ops.split(",") if o] or names
        ops = [next(n for n in names if n.startswith(o)) for o in ops]
        run_writes([int(s) for s in a.sizes.split(",")], ops, a.executors.split(","),
                   a.repeats)
    if a.only in (None, "generate"):
        run_generate([int(n) for n in a.lengths.split(",")], a.calls)
    if a.only in (None, "adamw"):
        run_adamw()
    print(environment())


if __name__ == "__main__":
    main()
