"""``torch.profiler`` / ``torch.autograd.profiler`` for device "tpu".

Both profilers run ``torch.autograd.profiler.profile`` underneath; four of its methods are
wrapped (installed once, at import), acting only for sessions whose ``use_device`` is "tpu"
(``ProfilerActivity.PrivateUse1``, which ``ProfilerActivity.TPU`` equals, or
``use_device="tpu"``):

- ``__init__``: the legacy path (``use_device="tpu"`` without kineto) would use PrivateUse1
  ``ProfilerStubs``, a C++-only registration; unregistered, every op raised "PrivateUse1 used
  in profiler but not enabled" from a RecordFunction callback. Such sessions record with kineto
  instead and get their device times below.
- ``_start_trace`` / ``__exit__``: start and stop the XLA tracer (``_xla.XlaSession``), wrap
  host syncs in ``tpu::host_sync`` / ``tpu::synchronize`` ranges, snapshot
  ``torch.tpu.metrics()``; optionally write the XProf trace (``TpuProfilerConfig``).
- ``_parse_kineto_results``: each program run becomes a ``FunctionEvent`` on device "tpu"
  (``key_averages()`` rows with device time) and a kernel of the innermost CPU op that launched
  it (its "TPU total").
- ``export_chrome_trace`` (used by ``tensorboard_trace_handler``): the program runs are merged
  into the Chrome trace as ``"cat": "kernel"`` events on a "TPU <n>" process, with flow arrows
  from the launching op, and the metrics of the region as ``"tpuMetrics"``.
"""
from __future__ import annotations

import json
import os
import re
import threading
import warnings

import torch
from torch.autograd import profiler as _ap
from torch.autograd.profiler_util import FunctionEvent
from torch._C._profiler import ProfilerState
from torch._C import _autograd

from . import _state
from ._xla import XlaSession

_P = _ap.profile
_DEVICE_PID = 1_000_000  # Chrome trace process of "TPU <n>" (kineto uses small pids for GPUs)
_installed: list = []


def _is_tpu(prof) -> bool:
    return getattr(prof, "enabled", False) and getattr(prof, "use_device", None) == "tpu"


def install() -> None:
    if _installed:
        return
    _installed.append(True)
    orig_init, orig_start, orig_exit = _P.__init__, _P._start_trace, _P.__exit__
    orig_parse, orig_export = _P._parse_kineto_results, _P.export_chrome_trace

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        if _is_tpu(self) and self.profiler_kind == ProfilerState.KINETO_PRIVATEUSE1_FALLBACK:
            self.profiler_kind = ProfilerState.KINETO

    def _start_trace(self):
        orig_start(self)
        if _is_tpu(self):
            self._tpu_session = _Session(getattr(self, "_tpu_config", None) or _state.config)

    def __exit__(self, exc_type, exc_val, exc_tb):
        r = orig_exit(self, exc_type, exc_val, exc_tb)  # synchronizes the device first
        s = getattr(self, "_tpu_session", None)
        if s is not None and s.active:
            s.stop()
            self.tpu_metrics = s.metrics
        return r

    def _parse_kineto_results(self, result, *args, **kwargs):
        events = orig_parse(self, result, *args, **kwargs)
        s = getattr(self, "_tpu_session", None)
        if s is not None and not s.active:
            events = _with_device_events(self, events, s, result.trace_start_ns())
        return events

    def export_chrome_trace(self, path, *args, **kwargs):
        r = orig_export(self, path, *args, **kwargs)
        s = getattr(self, "_tpu_session", None)
        if s is not None and not s.active:
            _merge_chrome_trace(path, s)
        return r

    _P.__init__ = __init__
    _P._start_trace = _start_trace
    _P.__exit__ = __exit__
    _P._parse_kineto_results = _parse_kineto_results
    _P.export_chrome_trace = export_chrome_trace


class _Session:
    """One "tpu" profiling window: the XLA tracer, host-sync ranges, metrics."""

    def __init__(self, cfg):
        from ..runtime import metrics as _metrics

        self.cfg = cfg
        self.active = True
        self.runs: list = []
        self.metrics = None
        self._before = _metrics.metrics()
        self.xla = None
        if cfg.device_tracer_level > 0 or cfg.run_dir is not None:
            try:
                self.xla = XlaSession(cfg.host_tracer_level, cfg.python_tracer_level)
            except Exception as e:  # noqa: BLE001  (another JAX trace is running)
                warnings.warn(f"torch.tpu.profiler: no device timeline ({e})", stacklevel=3)
        _hooks_on()

    def stop(self) -> None:
        from ..runtime import metrics as _metrics

        _hooks_off()
        self.active = False
        self.metrics = _delta(self._before, _metrics.metrics())
        if self.xla is None:
            return
        self.xla.stop()
        cfg = self.cfg
        if cfg.run_dir is not None:
            os.makedirs(cfg.run_dir, exist_ok=True)
            self.xla.export(cfg.run_dir)
            with open(os.path.join(cfg.run_dir, "tpu_metrics.json"), "w") as f:
                json.dump(self.metrics, f, indent=1)
        if cfg.device_tracer_level > 0:
            self.runs = self.xla.program_runs()
        self.xla.xspace = None


def _delta(before, after) -> dict:
    c0 = before["counters"]
    counters = {k: v - c0.get(k, 0) for k, v in after["counters"].items() if v != c0.get(k, 0)}
    per_op = {}
    for name, ops in after["per_op"].items():
        b = before["per_op"].get(name, {})
        d = {op: n - b.get(op, 0) for op, n in ops.items() if n != b.get(op, 0)}
        if d:
            per_op[name] = d
    return {"counters": counters, "per_op": per_op}


# ---- host syncs as ranges (only while a session is active) ----

_hook_depth = [0]
_saved: dict = {}


def _hooks_on() -> None:
    _hook_depth[0] += 1
    if _hook_depth[0] > 1:
        return
    from ..eager import copy as _copy
    from ..runtime import sync as _sync

    _saved["d2h"] = d2h = _copy.device_to_host
    _saved["sync"] = sync = _sync.synchronize

    def device_to_host(value):
        with _ap.record_function("tpu::host_sync"):
            return d2h(value)

    def synchronize(device=None):
        with _ap.record_function("tpu::synchronize"):
            return sync(device)

    _copy.device_to_host = device_to_host
    _sync.synchronize = synchronize


def _hooks_off() -> None:
    _hook_depth[0] -= 1
    if _hook_depth[0] > 0:
        return
    from ..eager import copy as _copy
    from ..runtime import sync as _sync

    _copy.device_to_host = _saved.pop("d2h")
    _sync.synchronize = _saved.pop("sync")


# ---- key_averages ----

def _with_device_events(prof, events, s, trace_start_ns):
    if not s.runs:
        return events
    device_type = torch.autograd.DeviceType.PrivateUse1
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
           and not e.is_async and not getattr(e, "is_user_annotation", False)]
    cpu.sort(key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in cpu]
    new = []
    next_id = max((e.id for e in events), default=0) + 1
    import bisect

    for r in s.runs:
        start_us = (r["start_ns"] - trace_start_ns) / 1000
        end_us = (r["end_ns"] - trace_start_ns) / 1000
        fe = FunctionEvent(id=next_id, name=r["name"], thread=0, start_us=start_us,
                           end_us=end_us, input_shapes=[], stack=[], use_device=prof.use_device,
                           device_type=device_type, device_index=r["device"], trace_name=r["name"])
        next_id += 1
        new.append(fe)
        if r["launch_ns"] is None:
            continue
        t = (r["launch_ns"] - trace_start_ns) / 1000
        # the innermost CPU op around the launch: the latest-starting one that still covers it
        i = bisect.bisect_right(starts, t)
        for j in range(i - 1, max(i - 200, -1), -1):
            e = cpu[j]
            if e.time_range.end >= t:
                e.append_kernel(r["name"], r["device"], end_us - start_us)
                break
    out = list(events) + new
    out.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
    return out


# ---- Chrome trace ----

def _merge_chrome_trace(path, s) -> None:
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, ValueError):
        return
    base = int(trace.get("baseTimeNanoseconds", 0))
    evs = trace.setdefault("traceEvents", [])
    pid_cpu = os.getpid()
    # kineto names its threads "thread <tid> (<name>)"; XLA's tracer names lines by thread name
    tids = {}
    for e in evs:
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") == pid_cpu:
            m = re.match(r"thread (\d+) \((.*)\)$", str(e.get("args", {}).get("name", "")))
            if m:
                tids.setdefault(m.group(2), set()).add(int(m.group(1)))
    tids["python"] = {threading.main_thread().native_id}
    devices = sorted({r["device"] for r in s.runs})
    from ..runtime import devices as _devices

    platform = _devices.platform()
    for d in devices:
        pid = _DEVICE_PID + d
        evs.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"TPU {d}"}})
        evs.append({"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
                    "args": {"labels": f"tpu:{d} (XLA:{str(platform).upper()})"}})
        evs.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                    "args": {"sort_index": 5_000_000 + d}})
        evs.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0,
                    "args": {"name": "XLA programs"}})
    for k, r in enumerate(s.runs):
        pid = _DEVICE_PID + r["device"]
        ts = (r["start_ns"] - base) / 1000
        args = {"device": r["device"], "executor": r["executor"], "xla_module": r["module"]}
        if r["run_id"] is not None:
            args["run_id"] = r["run_id"]
        evs.append({"ph": "X", "cat": "kernel", "name": r["name"], "pid": pid, "tid": 0,
                    "ts": ts, "dur": max((r["end_ns"] - r["start_ns"]) / 1000, 0.001),
                    "args": args})
        launch_tids = tids.get(r.get("launch_thread"), ())
        if r["launch_ns"] is not None and len(launch_tids) == 1:
            fid = 0x7470_0000 + k
            evs.append({"ph": "s", "id": fid, "pid": pid_cpu, "tid": next(iter(launch_tids)),
                        "ts": (r["launch_ns"] - base) / 1000, "cat": "ac2g", "name": "ac2g"})
            evs.append({"ph": "f", "id": fid, "pid": pid, "tid": 0, "ts": ts, "cat": "ac2g",
                        "name": "ac2g", "bp": "e"})
    if s.metrics is not None:
        trace["tpuMetrics"] = s.metrics
    with open(path, "w") as f:
        json.dump(trace, f)
