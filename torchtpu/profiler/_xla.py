"""The device side of a profile: a JAX (XProf) profiler session, read back as program runs.

PyTorch's kineto has no Python interface for a PrivateUse1 device's activity (its
``IActivityProfiler`` and the legacy ``ProfilerStubs`` are C++ registrations), so the device
timeline comes from XLA's own tracer: while a ``torch.profiler`` session records "tpu" activity,
a JAX ``ProfilerSession`` runs beside it. At the end its XSpace is read with
``jax.profiler.ProfileData``: every XLA program execution (on XLA:CPU, the HLO ops its thunk
executor ran, grouped by ``run_id``; on TPU/GPU, the "XLA Modules" line of each device plane)
becomes one event named after the program's module. The executors name their programs (the
jitted function's ``__name__``): ``aten.<op>.<overload>`` (Strict), ``fused_graph_<n>``
(Fused), ``compiled.<forward|backward|inference>`` (torch.compile). Nothing runs on the
per-op path: the cost is XLA's tracer, only while a session is active.
"""
from __future__ import annotations

import re
import time

_MODULE_SUFFIX = re.compile(r"\(\d+\)$")


def display_name(module: str) -> str:
    """The name a device event shows for an XLA module name."""
    m = _MODULE_SUFFIX.sub("", module)
    if m.startswith("jit_"):
        m = m[4:]
    if m.startswith(("aten.", "prims.", "torchvision.", "_c10d_functional.")):
        ns, rest = m.split(".", 1)
        return f"{ns}::{rest}"
    if m.startswith("compiled."):
        return "compiled:" + m[len("compiled."):]
    return m


def executor_of(module: str) -> str:
    m = module[4:] if module.startswith("jit_") else module
    if m.startswith("fused_graph_"):
        return "fused"
    if m.startswith("compiled."):
        return "compiled"
    if m.startswith("exported_program"):
        return "export"
    if "." in m and m.split(".", 1)[0] in ("aten", "prims", "torchvision", "_c10d_functional"):
        return "strict"
    return "runtime"


class XlaSession:
    """A running JAX profiler session (``jax.profiler``'s, without its global state)."""

    def __init__(self, host_tracer_level: int = 2, python_tracer_level: int = 0):
        from jax._src.lib import _profiler

        opts = _profiler.ProfileOptions()
        opts.host_tracer_level = int(host_tracer_level)
        opts.python_tracer_level = int(python_tracer_level)
        self._profiler = _profiler
        self.session = _profiler.ProfilerSession(opts)
        # the session's timestamps are relative to its start: a marker with a known
        # CLOCK_REALTIME time (kineto's clock) gives the offset
        self._sync_ns = time.time_ns()
        with _profiler.TraceMe("torchtpu_clock_sync"):
            pass
        self.xspace = None

    def stop(self) -> bytes:
        self.xspace = self.session.stop()
        return self.xspace

    def export(self, log_dir: str) -> None:
        """Write the trace where TensorBoard/XProf look: ``log_dir/plugins/profile/<run>/``
        (``<host>.xplane.pb``, ``<host>.trace.json.gz``), plus ``perfetto_trace.json.gz``: the
        same Chrome trace without its ``metadata`` field, which Perfetto's importer rejects."""
        import gzip
        import json
        import os

        before = set(_trace_jsons(log_dir))
        self.session.export(self.xspace, str(log_dir))
        for path in set(_trace_jsons(log_dir)) - before:
            with gzip.open(path, "rb") as f:
                trace = json.load(f)
            trace.pop("metadata", None)
            with gzip.open(os.path.join(os.path.dirname(path), "perfetto_trace.json.gz"),
                           "wt") as f:
                json.dump(trace, f)

    def program_runs(self) -> list[dict]:
        """One dict per XLA program execution: ``module``, ``name``, ``executor``, ``device``,
        ``start_ns``/``end_ns`` (CLOCK_REALTIME), ``launch_ns`` and ``launch_thread`` (when and
        on which thread the host called it, if known), ``run_id``."""
        import jax

        data = jax.profiler.ProfileData.from_serialized_xspace(self.xspace)
        offset = None
        runs: dict = {}
        launches: dict = {}
        executes: list = []
        device_runs = []
        for plane in data.planes:
            pname = plane.name
            for line in plane.lines:
                lname = line.name
                for ev in line.events:
                    name = ev.name
                    if name == "torchtpu_clock_sync":
                        offset = self._sync_ns - int(ev.start_ns)
                        continue
                    if pname.startswith("/device:") and lname == "XLA Modules":
                        device_runs.append((name, int(ev.start_ns), int(ev.end_ns),
                                            _device_index(pname)))
                        continue
                    if name.startswith("PjitFunction("):
                        fn = name[len("PjitFunction("):-1]
                        if fn.startswith("jit(") and fn.endswith(")"):
                            fn = fn[4:-1]
                        launches.setdefault(fn, []).append((int(ev.start_ns), lname))
                        continue
                    if name.startswith("CommonPjRtLoadedExecutable::ExecuteHelper"):
                        # a call of a compiled executable (whatever Python object made it)
                        executes.append((int(ev.start_ns), lname))
                        continue
                    stats = dict(ev.stats)
                    mod = stats.get("hlo_module")
                    rid = stats.get("run_id")
                    if mod is None or rid is None:
                        continue
                    key = (mod, rid)
                    r = runs.get(key)
                    s, e = int(ev.start_ns), int(ev.end_ns)
                    if r is None:
                        runs[key] = [s, e, int(stats.get("device_ordinal", 0) or 0)]
                    else:
                        r[0] = min(r[0], s)
                        r[1] = max(r[1], e)
        if offset is None:
            return []
        out = []
        for (mod, rid), (s, e, dev) in runs.items():
            out.append((mod, s, e, dev, rid))
        for mod, s, e, dev in device_runs:
            out.append((_MODULE_SUFFIX.sub("", mod), s, e, dev, None))
        out.sort(key=lambda r: r[1])
        for v in launches.values():
            v.sort()
        executes.sort()
        res = []
        for mod, s, e, dev, rid in out:
            fn = mod[4:] if mod.startswith("jit_") else mod
            launch = _last_before(launches.get(fn, ()), s) or _last_before(executes, s)
            res.append({"module": mod, "name": display_name(mod), "executor": executor_of(mod),
                        "device": dev, "start_ns": s + offset, "end_ns": e + offset,
                        "launch_ns": None if launch is None else launch[0] + offset,
                        "launch_thread": None if launch is None else launch[1],
                        "run_id": rid})
        return res


def _trace_jsons(log_dir) -> list:
    import glob
    import os

    return glob.glob(os.path.join(str(log_dir), "plugins", "profile", "*", "*.trace.json.gz"))


def _device_index(plane_name: str) -> int:
    m = re.search(r":(\d+)$", plane_name)
    return int(m.group(1)) if m else 0


def _last_before(sorted_launches, t):
    """The last (time, thread) launch at or before ``t``."""
    import bisect

    i = bisect.bisect_right(sorted_launches, (t, "\uffff"))
    return sorted_launches[i - 1] if i else None
