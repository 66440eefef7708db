"""Image resize (F.interpolate bilinear/bicubic, uint8 and float32): time and peak memory,
"tpu" vs PyTorch CPU.

    python benchmarks/resize.py [--cases u8_bilinear_up2,...] [--repeats 9]

Each case resizes a batch-1, 3-channel image (``CASES`` below: up 2x from 540x960, down 4x and
8x from 1080x1920, antialiased downscales). On "tpu" each output reads only its taps (2 per
dimension linear, 4 cubic: lowering/nn.py ``_gather_taps``), so the cost grows with
outputs x taps; antialiased rows (``_upsample_bilinear2d_aa``/``_upsample_bicubic2d_aa``,
torchvision's Resize default) read each output's window, 2 * ceil(support) + 1 taps per
dimension (support = 1 linear / 2 cubic times the downscale factor: 17 taps at 1/8 bilinear).

Time: medians of repeated calls, each ending with ``torch.tpu.synchronize()``, "tpu" and CPU
interleaved in one process per case after a warm-up call (compilation excluded).
Peak memory: every (case, device) in a fresh process running one call: the growth of the peak
resident set (VmHWM) over the resident set once the input exists (the output plus every
temporary). For "tpu" that process finds its XLA program in a compile cache folder a first
process filled. Output bytes per case are printed alongside: the floor of any resize.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import environment, interleaved_medians, proc_status, reset_peak  # noqa: E402

# name: (dtype, input (h, w), output (h, w), mode, antialias)
CASES = {
    "u8_bilinear_up2": ("uint8", (540, 960), (1080, 1920), "bilinear", False),
    "u8_bicubic_up2": ("uint8", (540, 960), (1080, 1920), "bicubic", False),
    "f32_bilinear_up2": ("float32", (540, 960), (1080, 1920), "bilinear", False),
    "f32_bicubic_up2": ("float32", (540, 960), (1080, 1920), "bicubic", False),
    "u8_bilinear_down4": ("uint8", (1080, 1920), (270, 480), "bilinear", False),
    "f32_bilinear_down4": ("float32", (1080, 1920), (270, 480), "bilinear", False),
    "f32_bilinear_aa_down8": ("float32", (1080, 1920), (135, 240), "bilinear", True),
    "u8_bilinear_aa_down8": ("uint8", (1080, 1920), (135, 240), "bilinear", True),
    "f32_bicubic_aa_down4": ("float32", (1080, 1920), (270, 480), "bicubic", True),
    "u8_bicubic_aa_down4": ("uint8", (1080, 1920), (270, 480), "bicubic", True),
    "u8_bilinear_aa_down2": ("uint8", (1080, 1920), (540, 960), "bilinear", True),
}


def make_step(case: str, dev: str):
    import torch
    import torch.nn.functional as F

    dtype, (h, w), size, mode, aa = CASES[case]
    g = torch.Generator().manual_seed(0)
    if dtype == "uint8":
        x = torch.randint(0, 256, (1, 3, h, w), generator=g, dtype=torch.uint8)
    else:
        x = torch.rand(1, 3, h, w, generator=g)
    x = x.to(dev)
    sync = torch.tpu.synchronize if dev == "tpu" else (lambda: None)

    def step():
        y = F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=aa)
        sync()
        return y

    return step


def worker_time(case, repeats):
    return interleaved_medians({d: make_step(case, d) for d in ("tpu", "cpu")}, repeats)


def worker_mem(case, dev):
    step = make_step(case, dev)
    before = proc_status("VmRSS")
    reset_peak()
    y = step()
    return {"peak_mib": (proc_status("VmHWM") - before) / (1 << 20),
            "out_mib": y.numel() * y.element_size() / (1 << 20)}


def _spawn(args, cache=None, timeout=900):
    env = dict(os.environ)
    if cache is not None:
        env["TORCHTPU_CACHE_DIR"] = cache
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *args],
                       capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
    return json.loads(p.stdout.strip().splitlines()[-1]), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--worker", nargs="+")
    a = ap.parse_args()
    if a.worker:
        if a.worker[0] == "time":
            out = worker_time(a.worker[1], int(a.worker[2]))
        else:
            out = worker_mem(a.worker[1], a.worker[2])
        print(json.dumps(out))
        return
    import shutil
    import tempfile

    cache = tempfile.mkdtemp(prefix="resize-bench-cache-")
    print(environment())
    rows = []
    for case in a.cases.split(","):
        t, err = _spawn(["time", case, str(a.repeats)], cache)
        mem = {}
        for d in ("tpu", "cpu"):
            if d == "tpu":
                _spawn(["mem", case, d], cache)  # fills the compile cache
            m, merr = _spawn(["mem", case, d], cache)
            mem[d] = m if m is not None else {"err": merr}
        rows.append((case, t, err, mem, os.getloadavg()[0]))
        print(json.dumps({"case": case, "time": t, "err": err, "mem": mem}), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    print()
    print(f"{'case':22s} {'tpu ms':>8s} {'CPU ms':>8s} {'tpu/CPU':>8s} {'tpu MiB':>8s} "
          f"{'CPU MiB':>8s} {'out MiB':>8s} {'load':>5s}")
    for case, t, err, mem, load in rows:
        if t is None:
            print(f"{case:22s} {err}")
            continue
        mt, mc = mem["tpu"].get("peak_mib"), mem["cpu"].get("peak_mib")
        out = mem["tpu"].get("out_mib", mem["cpu"].get("out_mib"))
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{case:22s} {t['tpu'] * 1e3:8.2f} {t['cpu'] * 1e3:8.2f} {t['tpu'] / t['cpu']:8.2f} "
              f"{f(mt):>8s} {f(mc):>8s} {f(out):>8s} {load:5.2f}")


if __name__ == "__main__":
    main()
