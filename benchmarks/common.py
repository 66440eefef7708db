"""Shared timing helpers for the benchmarks: medians of repeated, warmed-up runs, and a table
printer that shows every contender side by side with ratios, measured in one process/run.

    from common import Timer, Table

    t = Timer(min_repeat_s=0.05, repeats=7)
    us_cpu = t.per_call_us(lambda: a_cpu + b_cpu)
    us_tpu = t.per_call_us(lambda: a_tpu + b_tpu, sync=torch.tpu.synchronize)

Asynchronous backends (torchtpu, JAX) return before the device finishes; ``sync`` is called
once at the end of each timed repeat so queued work is paid for, amortised over the calls.
"""
from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable


# ---- process memory (Linux /proc): what the memory columns of the benchmarks read ----

def stop_session(proc, timeout: float = 30.0) -> None:
    """End ``proc`` (started with ``start_new_session=True``) and everything in its session:
    SIGTERM, then SIGKILL after ``timeout`` seconds."""
    import signal
    import subprocess

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def proc_status(key: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> bool:
    """Reset the process's peak resident size VmHWM to the current resident set (Linux >= 4.0);
    False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def settle_rss(tolerance: int = 4 << 20, tries: int = 40) -> int:
    """The resident size once it stops changing: XLA:CPU frees a dead buffer on a runtime
    thread after its last use, up to ~1 s after a synchronize (measured: 1 GiB of foreach
    temporaries still resident right after an AdamW step, gone 1 s later)."""
    last = None
    for _ in range(tries):
        now = proc_status("VmRSS")
        if last is not None and abs(now - last) < tolerance:
            return now
        last = now
        time.sleep(0.1)
    return last


@dataclass
class Measurement:
    """Seconds per call: the median over repeats, plus the spread for judging noise."""

    median_s: float
    min_s: float
    max_s: float
    calls_per_repeat: int
    repeats: int

    @property
    def us(self) -> float:
        return self.median_s * 1e6

    @property
    def spread(self) -> float:
        """(max - min) / median over repeats: large values mean a noisy machine."""
        return (self.max_s - self.min_s) / self.median_s if self.median_s > 0 else math.nan


class Timer:
    """Times ``fn`` as the median of ``repeats`` repeats of ``number`` back-to-back calls.

    ``number`` is chosen (autorange) so that one repeat lasts at least ``min_repeat_s``; the
    first ``warmup`` calls (compilation, caches) are not timed. The garbage collector is off
    while timing, as in ``timeit``.
    """

    def __init__(self, warmup: int = 10, repeats: int = 7, min_repeat_s: float = 0.05,
                 max_number: int = 100_000):
        self.warmup, self.repeats = warmup, repeats
        self.min_repeat_s, self.max_number = min_repeat_s, max_number
        self.history: list[Measurement] = []  # every measurement taken, for a noise summary

    def _run(self, fn, number, sync):
        # every result is held until the sync and each jax array blocked on: the raw JAX
        # columns have no synchronize that sees work whose results were freed (torch.tpu's
        # does, runtime/inflight.py), and holding them all keeps the columns alike
        keep = []
        t0 = time.perf_counter()
        for _ in range(number):
            keep.append(fn())
        if sync is not None:
            sync()
        for r in keep:
            if hasattr(r, "block_until_ready"):
                r.block_until_ready()
        return time.perf_counter() - t0

    def measure(self, fn: Callable[[], object], sync: Callable[[], object] | None = None,
                number: int | None = None) -> Measurement:
        for _ in range(self.warmup):
            fn()
        if sync is not None:
            sync()
        gc_was = gc.isenabled()
        gc.disable()
        try:
            if number is None:
                number = 1
                while True:
                    dt = self._run(fn, number, sync)
                    if dt >= self.min_repeat_s or number >= self.max_number:
                        break
                    number = min(self.max_number,
                                 max(number * 2, int(number * self.min_repeat_s / max(dt, 1e-9))))
            times = [self._run(fn, number, sync) / number for _ in range(self.repeats)]
        finally:
            if gc_was:
                gc.enable()
        m = Measurement(statistics.median(times), min(times), max(times), number, self.repeats)
        self.history.append(m)
        return m

    def per_call_us(self, fn, sync=None, number=None) -> float:
        return self.measure(fn, sync, number).us

    def noise_note(self) -> str:
        """One line: how much repeats of the same measurement disagreed in this run."""
        if not self.history:
            return ""
        spreads = sorted(m.spread for m in self.history)
        return (f"noise: (max-min)/median over repeats is {100 * statistics.median(spreads):.0f}%"
                f" typically, {100 * spreads[-1]:.0f}% at worst"
                + ("  (a loaded machine: compare ratios across runs with care)"
                   if spreads[-1] > 0.5 else ""))


@dataclass
class Table:
    """Rows of named measurements; prints absolute times and ratios to a baseline column."""

    title: str
    columns: list[str]
    unit: str = "us"
    rows: list[tuple[str, dict]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, values: dict) -> None:
        self.rows.append((name, values))

    def render(self, ratios: list[tuple[str, str]] = ()) -> str:
        """``ratios``: (numerator column, denominator column) pairs shown as ``a/b``."""
        heads = ["case"] + [f"{c} ({self.unit})" for c in self.columns] + [f"{a}/{b}"
                                                                           for a, b in ratios]
        body = []
        for name, vals in self.rows:
            cells = [name]
            for c in self.columns:
                v = vals.get(c)
                cells.append("-" if v is None else _fmt(v))
            for a, b in ratios:
                va, vb = vals.get(a), vals.get(b)
                cells.append("-" if not va or not vb else f"{va / vb:.2f}x")
            body.append(cells)
        widths = [max(len(r[i]) for r in [heads] + body) for i in range(len(heads))]
        line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(cells, widths)))
        out = [self.title, "=" * len(self.title), line(heads), line(["-" * w for w in widths])]
        out += [line(r) for r in body]
        out += self.notes
        return "\n".join(out)

    def print(self, ratios=()) -> None:
        print(self.render(ratios), flush=True)


def interleaved_medians(steps: dict, repeats: int) -> dict:
    """Median seconds of each step after a warm-up call (compiles), the steps' calls
    interleaved: every step sees the shared host in the same states."""
    for s in steps.values():
        s()
    times = {k: [] for k in steps}
    for _ in range(repeats):
        for k, s in steps.items():
            t0 = time.perf_counter()
            s()
            times[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def thread_cpu() -> dict:
    """CPU seconds (user + system) of each thread of this process: {tid: (name, seconds)}."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}"


def environment() -> str:
    """One line describing where the numbers were measured (they only compare within a run)."""
    import jax
    import torch

    return (f"python {platform.python_version()}, torch {torch.__version__}, jax {jax.__version__}"
            f" ({jax.default_backend()}), {os.cpu_count()} CPUs, torch threads "
            f"{torch.get_num_threads()}, {platform.machine()}, load average "
            f"{os.getloadavg()[0]:.1f}")
