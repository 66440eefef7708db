"""Long-sequence attention: forward + backward time and peak memory, "tpu" vs PyTorch CPU.

    python benchmarks/attention.py [--lengths 1024,4096,16384,32768] [--cases sdpa_causal,...]

Batch 1, 8 heads, head dim 64, float32, forward + backward (``out.backward(grad)``), for
  sdpa_causal     F.scaled_dot_product_attention(q, k, v, is_causal=True)
  sdpa_padmask    F.scaled_dot_product_attention with a (1, 1, 1, S) boolean key-padding mask
                  (the last eighth of the keys masked)
  flex_causal     compiled flex_attention with a causal BlockMask
  flex_window     ... a causal sliding window of 1024 tokens
  flex_document   ... causal within packed documents (8 of random lengths)
  flex_full       ... no mask (every block visited): the dense reference of the flex rows
On "tpu" the SDPA rows reach the fused op's lowering (lowering/attention.py: flash.py's
blockwise kernel above a few million scores) and the flex rows ``torch.compile(flex_attention,
backend="tpu")`` (lowering/flex_attention.py: blockwise over the BlockMask's tables). PyTorch
CPU runs its own SDPA kernels (flash attention for CPU). PyTorch has no FlexAttention backward
on CPU, so the CPU column of a flex row is what a CPU user runs instead: SDPA with the same
mask made dense (a boolean (L, L) ``attn_mask`` built from the ``mask_mod``, outside the timed
and measured step; none for flex_full). The flex rows are also compared with each other
(causal against full), timed interleaved in one more process per length.

Time: medians of repeated calls, each ending with ``torch.tpu.synchronize()``, "tpu" and CPU
interleaved in one process per (case, length) after a warm-up call (compilation excluded).
Peak memory: every (case, length, device) in a fresh process running one call: the growth of
the peak resident set (VmHWM) over the resident set once the inputs exist (so it counts the
outputs, gradients and every temporary). For "tpu" that process finds its XLA programs in a
compile cache folder a first process filled (the number excludes compiling, which a warm-up
call in the same process would not: freed memory stays in the process and hides peaks). The
table ends with the targets: memory at 16k within 2x of PyTorch CPU's, time within 2x at every
length, causal flex at most 0.6x full flex.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

H, E = 8, 64
CASES = ["sdpa_causal", "sdpa_padmask", "flex_causal", "flex_window", "flex_document",
         "flex_full"]
REPEATS = {1024: 9, 4096: 5, 16384: 3, 32768: 1}
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import environment, interleaved_medians, proc_status, reset_peak  # noqa: E402


def _rss_mib(field: str) -> float:
    return proc_status(field) / (1 << 20)


def make_step(case: str, L: int, dev: str):
    """A zero-argument fwd+bwd step on ``dev`` and its sync (None on CPU)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, H, L, E, generator=g) for _ in range(4))
    q, k, v, do = (t.to(dev) for t in (q, k, v, do))
    sync = torch.tpu.synchronize if dev == "tpu" else None
    if case.startswith("sdpa"):
        mask = None
        if case == "sdpa_padmask":
            mask = torch.ones(1, 1, 1, L, dtype=torch.bool)
            mask[..., L - L // 8:] = False
            mask = mask.to(dev)

        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  is_causal=case == "sdpa_causal")
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if case == "flex_causal":
            def mask_mod(b, h, i, j):
                return i >= j
        elif case == "flex_window":
            def mask_mod(b, h, i, j):
                return (i >= j) & (i - j < 1024)
        elif case == "flex_document":
            cuts = torch.sort(torch.randperm(L - 1, generator=g)[:7] + 1).values
            doc = torch.zeros(L, dtype=torch.int32)
            for c in cuts.tolist():
                doc[c:] += 1
            doc = doc.to(dev)

            def mask_mod(b, h, i, j):
                return (i >= j) & (doc[i] == doc[j])
        else:
            def mask_mod(b, h, i, j):
                return i >= 0

        if dev == "cpu":  # no FlexAttention backward on CPU: SDPA with the mask made dense
            idx = torch.arange(L)
            dense = None if case == "flex_full" else mask_mod(0, 0, idx[:, None], idx[None, :])

            def fn(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

            return _step(fn, q, k, v, do, sync)
        bm = create_block_mask(mask_mod, 1, None, L, L, device=dev)
        compiled = torch.compile(flex_attention, backend="tpu")

        def fn(q, k, v):
            return compiled(q, k, v, block_mask=bm)

    return _step(fn, q, k, v, do, sync)


def _step(fn, q, k, v, do, sync):
    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).backward(do)
        if sync is not None:
            sync()

    return step


def worker_time(case, L, repeats, devices):
    return interleaved_medians({d: make_step(case, L, d) for d in devices}, repeats)


def worker_pair(L, repeats, cases):
    """Each "tpu" case's median in one process: a ratio between them does not depend on which
    state the shared host was in for each process."""
    return interleaved_medians({c: make_step(c, L, "tpu") for c in cases}, repeats)


def worker_mem(case, L, dev):
    step = make_step(case, L, dev)
    before = _rss_mib("VmRSS")
    reset_peak()
    step()
    return _rss_mib("VmHWM") - before


def _spawn(args, timeout, cache=None):
    env = dict(os.environ)
    if cache is not None:
        env["TORCHTPU_CACHE_DIR"] = cache
    if "cpu" in args and "tpu" not in args:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # plain PyTorch for the CPU-only process
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return None, f"timed out after {timeout} s"
    if p.returncode != 0:
        return None, err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}"
    return json.loads(out.strip().splitlines()[-1]), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--only", choices=("time", "mem"), default=None)
    ap.add_argument("--worker", nargs="+")
    a = ap.parse_args()
    if a.worker:
        kind, case, L = a.worker[0], a.worker[1], int(a.worker[2])
        if kind == "time":
            out = worker_time(case, L, int(a.worker[3]), a.worker[4:])
        elif kind == "pair":
            out = worker_pair(L, int(a.worker[3]), a.worker[4:])
        else:
            out = worker_mem(case, L, a.worker[3])
        print(json.dumps(out))
        return
    import tempfile

    cache = tempfile.mkdtemp(prefix="attention-bench-cache-")
    rows = []
    for L in (int(x) for x in a.lengths.split(",")):
        for case in a.cases.split(","):
            devs = ["tpu", "cpu"]
            t, err = None, None
            if a.only != "mem":
                t, err = _spawn(["time", case, str(L), str(REPEATS.get(L, 2)), *devs],
                                a.timeout)
            row = {"case": case, "L": L, "time": t or {}, "err": err, "mem": {}}
            for d in devs if a.only != "time" else ():
                if d == "tpu":  # a first process fills the compile cache
                    _spawn(["mem", case, str(L), d], a.timeout, cache)
                m, merr = _spawn(["mem", case, str(L), d], a.timeout, cache)
                row["mem"][d] = m if m is not None else merr
            rows.append(row)
            print(json.dumps(row), flush=True)
    import shutil

    shutil.rmtree(cache, ignore_errors=True)
    print()
    print(f"{'case':15s} {'L':>6s} {'tpu s':>8s} {'CPU s':>8s} {'tpu/CPU':>8s} "
          f"{'tpu MiB':>9s} {'CPU MiB':>9s} {'tpu/CPU':>8s}")
    def cell(x, fmt):
        if isinstance(x, (int, float)):
            return fmt.format(x)
        return "-" if x is None else str(x)[:9]

    def ratio(x, y):
        ok = all(isinstance(z, (int, float)) for z in (x, y)) and y > 0
        return f"{x / y:.2f}x" if ok else "-"

    for r in rows:
        tt, tc = r["time"].get("tpu"), r["time"].get("cpu")
        mt, mc = r["mem"].get("tpu"), r["mem"].get("cpu")
        print(f"{r['case']:15s} {r['L']:6d} {cell(tt, '{:.3f}'):>8} {cell(tc, '{:.3f}'):>8} "
              f"{ratio(tt, tc):>8} {cell(mt, '{:.0f}'):>9} {cell(mc, '{:.0f}'):>9} "
              f"{ratio(mt, mc):>8}" + (f"  ({r['err']})" if r["err"] else ""))
    pair = ("flex_causal", "flex_full")
    if a.only != "mem" and all(c in a.cases.split(",") for c in pair):
        for L in sorted({r["L"] for r in rows}):
            t, err = _spawn(["pair", "-", str(L), str(REPEATS.get(L, 2)), *pair], a.timeout)
            if t:
                print(f"flex causal / full at {L}: {t[pair[0]] / t[pair[1]]:.2f}x "
                      f"({t[pair[0]]:.3f} / {t[pair[1]]:.3f} s, interleaved in one process; "
                      "target <= 0.6x)")
            else:
                print(f"flex causal / full at {L}: {err}")
    print(environment())


if __name__ == "__main__":
    main()
