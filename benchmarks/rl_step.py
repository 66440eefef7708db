"""Seconds per GRPO step on "tpu", split the way VeRL times it: rollout (vLLM on "tpu" through
torchtpu.vllm), old log-probs and reference log-probs (FSDP2 forward passes), actor update
(FSDP2 forward + backward + AdamW) and weight sync (actor -> rollout engine), on 1 and 2 ranks.

    python benchmarks/rl_step.py [--ranks 1 2] [--steps 6] [--batch 8] [--n 4]

Runs VeRL's own entry point (``python -m verl.trainer.main_ppo``, the recipe in
tests/verl_scripts/recipes.py: tiny Llama from a config, synthetic arithmetic prompts, 8-token
responses) in the VeRL environment (``make venv-verl``; ``TORCHTPU_VERL_PYTHON`` names another
python), once per rank count, and reads VeRL's per-step ``timing_s/*`` metrics from its console
log. VeRL's driver times each phase around remote calls whose results it waits for (log-probs,
metrics), so a phase's time includes its device work. Step 1 (compiles, vLLM warm-up) is
reported apart; the table is the median of the later steps.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "verl_scripts")
sys.path.insert(0, SCRIPTS)
import recipes  # noqa: E402

VERL_PY = os.environ.get("TORCHTPU_VERL_PYTHON") or os.path.join(ROOT, ".venv-verl", "bin",
                                                                "python")
PHASES = [("rollout (vLLM generate)", "timing_s/gen"),
          ("old log-probs", "timing_s/old_log_prob"),
          ("reference log-probs", "timing_s/ref"),
          ("actor update", "timing_s/update_actor"),
          ("weight sync", "timing_s/update_weights"),
          ("whole step", "timing_s/step")]


def run(setup, ranks, steps, batch, n, timeout):
    out = tempfile.mkdtemp(prefix=f"rl_step_{ranks}_", dir=setup)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    env.update(TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    log = os.path.join(out, "run.log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(recipes.grpo(VERL_PY, setup, out, ranks, steps, batch, n), env=env,
                           stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=out)
    wall = time.perf_counter() - t0
    text = open(log).read()
    if p.returncode != 0:
        sys.exit(f"{ranks} rank(s): exit {p.returncode}, see {log}\n{text[-3000:]}")
    m = recipes.metrics(text)
    return m, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--timeout", type=int, default=1800)
    args = ap.parse_args()
    if not os.access(VERL_PY, os.X_OK):
        sys.exit(f"no VeRL environment at {VERL_PY}: run `make venv-verl`")
    with tempfile.TemporaryDirectory(prefix="rl_step_") as setup:
        subprocess.run([VERL_PY, os.path.join(SCRIPTS, "tiny_setup.py"), setup], check=True,
                       capture_output=True, timeout=300)
        results = {r: run(setup, r, args.steps, args.batch, args.n, args.timeout)
                   for r in args.ranks}
    print(f"GRPO step on tpu ({platform.node() or 'host'}, load {os.getloadavg()[0]:.1f}): "
          f"{args.batch} prompts x {args.n} samples, <= 8 new tokens; seconds, median of steps "
          f"2..{args.steps} (step 1 in brackets)")
    head = "| phase | " + " | ".join(f"{r} rank{'s' if r > 1 else ''}" for r in args.ranks) + " |"
    print(head)
    print("|---" * (len(args.ranks) + 1) + "|")
    for name, key in PHASES:
        cells = []
        for r in args.ranks:
            m, _ = results[r]
            later = [m[s][key] for s in sorted(m) if s > 1 and key in m[s]]
            first = m.get(1, {}).get(key, float("nan"))
            cells.append(f"{statistics.median(later):.2f} ({first:.1f})" if later else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for r in args.ranks:
        m, wall = results[r]
        score = [round(m[s]["critic/score/mean"], 3) for s in sorted(m)]
        print(f"{r} rank(s): mean reward per step {score}; run wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
