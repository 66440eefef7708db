"""torch.profiler on device "tpu": device events per XLA program (Strict, Fused, compiled),
key_averages device time, the Chrome trace, the XLA trace, metrics per region."""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os

import jax
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

import torchtpu  # noqa: F401
from torchtpu.eager import copy as _copy

TPU_ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.TPU]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("tpu")


def _step_fn(m):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 16, device="tpu")
    y = torch.randint(0, 4, (8,), device="tpu")

    def step():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _profile_steps(step, tmp_path, n=2):
    d = str(tmp_path / "tb")
    with profile(activities=TPU_ACTIVITIES, on_trace_ready=tensorboard_trace_handler(d)) as p:
        for _ in range(n):
            with record_function("train_step"):
                step().item()
    (path,) = glob.glob(os.path.join(d, "*.pt.trace.json"))
    with open(path) as f:
        return p, json.load(f)


def _kernels(trace):
    return [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]


def _check_trace(p, trace, n_steps):
    evs = trace["traceEvents"]
    ann = collections.Counter(e["name"] for e in evs if e.get("cat") == "user_annotation")
    assert ann["train_step"] == n_steps
    assert ann["tpu::host_sync"] == n_steps  # each .item()
    kernels = _kernels(trace)
    assert kernels
    # device events sit on the "TPU 0" process, inside the profiled window
    pids = {e["pid"] for e in kernels}
    names = {e["pid"]: e["args"]["name"] for e in evs
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert {names[pid] for pid in pids} == {"TPU 0"}
    steps = [e for e in evs if e.get("cat") == "user_annotation" and e["name"] == "train_step"]
    lo = min(e["ts"] for e in steps)
    hi = max(e["ts"] + e["dur"] for e in steps)
    for k in kernels:
        assert k["dur"] > 0 and lo - 1e3 <= k["ts"] <= hi + 1e3
    # each flow arrow goes from a launch on a CPU thread to a later device event
    flows = collections.defaultdict(dict)
    for e in evs:
        if e.get("cat") == "ac2g":
            flows[e["id"]][e["ph"]] = e
    assert flows
    for f in flows.values():
        assert f["s"]["ts"] <= f["f"]["ts"] + 1.0
    assert trace["tpuMetrics"]["counters"]["host_syncs"] == n_steps
    assert p.profiler.tpu_metrics == trace["tpuMetrics"]
    return collections.Counter(k["name"] for k in kernels)


def test_strict_device_events_named_by_aten_op(tmp_path):
    step = _step_fn(_model())
    step().item()  # compile outside the window
    p, trace = _profile_steps(step, tmp_path)
    names = _check_trace(p, trace, 2)
    # forward addmm x2, backward mm per step: one program run per op call
    assert names["aten::addmm.default"] == 4
    assert names["aten::mm.default"] >= 4
    strict = sum(n for k, n in names.items() if k.startswith("aten::"))
    assert strict == sum(1 for k in _kernels(trace) if k["args"]["executor"] == "strict")
    # key_averages: device time per program and under the CPU op that launched it
    avg = {e.key: e for e in p.key_averages()}
    assert avg["aten::addmm.default"].count == 4
    assert avg["aten::addmm.default"].self_device_time_total > 0
    assert avg["aten::addmm"].device_time_total > 0  # the CPU op row
    assert avg["train_step"].device_time_total > 0
    assert "tpu::host_sync" in avg


def test_fused_device_events_one_per_graph(tmp_path):
    step = _step_fn(_model())
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        step().item()
        step().item()
        p, trace = _profile_steps(step, tmp_path)
    names = _check_trace(p, trace, 2)
    fused = {k: n for k, n in names.items() if k.startswith("fused_graph_")}
    c = trace["tpuMetrics"]["counters"]
    runs = c.get("fused_graph_cache_hits", 0) + c.get("fused_graph_compiles", 0)
    assert runs >= 2 and sum(fused.values()) == runs  # one device event per graph run
    assert not any(k.startswith("aten::") for k in names)  # nothing ran op by op


def test_compiled_device_events(tmp_path):
    step = torch.compile(_step_fn(_model()), backend="tpu")
    step().item()
    step().item()
    p, trace = _profile_steps(step, tmp_path)
    names = _check_trace(p, trace, 2)
    assert names["compiled:forward"] == 2 and names["compiled:backward"] == 2
    avg = {e.key: e for e in p.key_averages()}
    assert avg["compiled:forward"].self_device_time_total > 0


def test_legacy_profiler_use_device_tpu(capfd):
    """torch.autograd.profiler.profile(use_device="tpu") records without RecordFunction
    exceptions (the legacy PrivateUse1 stubs are C++-only), with device times."""
    x = torch.randn(32, 32, device="tpu")
    (x @ x).sum().item()
    capfd.readouterr()
    with torch.autograd.profiler.profile(use_device="tpu") as p:
        (x @ x).relu().sum().item()
    err = capfd.readouterr().err
    assert "PrivateUse1 used in profiler but not enabled" not in err
    assert "INTERNAL ASSERT FAILED" not in err
    avg = {e.key: e for e in p.key_averages()}
    assert avg["aten::mm"].device_time_total > 0


def test_cpu_only_profile_records_no_device_events():
    x = torch.randn(8, 8, device="tpu")
    with profile(activities=[ProfilerActivity.CPU]) as p:
        (x + x).sum().item()
    assert not [e for e in p.events() if e.device_type == torch.autograd.DeviceType.PrivateUse1]
    assert getattr(p.profiler, "tpu_metrics", None) is None


def test_xla_trace_written_with_program_names(tmp_path):
    run_dir = str(tmp_path / "xla")
    x = torch.randn(16, 16, device="tpu")
    (x @ x).sum().item()
    cfg = torch.tpu.profiler.TpuProfilerConfig(run_dir=run_dir)
    with torch.tpu.profiler.profile(config=cfg) as p:
        (x @ x).sum().item()
    (pb,) = glob.glob(os.path.join(run_dir, "plugins", "profile", "*", "*.xplane.pb"))
    run = os.path.dirname(pb)
    assert glob.glob(os.path.join(run, "*.trace.json.gz"))
    with gzip.open(os.path.join(run, "perfetto_trace.json.gz")) as f:  # for ui.perfetto.dev
        assert "metadata" not in json.load(f)
    data = jax.profiler.ProfileData.from_file(pb)
    modules = {dict(e.stats).get("hlo_module") for plane in data.planes for line in plane.lines
               for e in line.events}
    assert "jit_aten.mm.default" in modules
    with open(os.path.join(run_dir, "tpu_metrics.json")) as f:
        assert json.load(f) == p.tpu_metrics
    assert p.tpu_metrics["counters"]["host_syncs"] == 1
    # the host-sync wrappers are gone once the session ends
    assert _copy.device_to_host.__module__ == "torchtpu.eager.copy"


def test_trace_without_torch_profiler(tmp_path):
    x = torch.randn(16, 16, device="tpu")
    with torch.tpu.profiler.trace(str(tmp_path)):
        (x @ x).relu().sum().item()
    (pb,) = glob.glob(os.path.join(str(tmp_path), "plugins", "profile", "*", "*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(pb)
    modules = {dict(e.stats).get("hlo_module") for plane in data.planes for line in plane.lines
               for e in line.events}
    assert {"jit_aten.mm.default", "jit_aten.relu.default"} <= modules


def test_metrics_region():
    x = torch.randn(8, 8, device="tpu")
    with torch.tpu.profiler.metrics_region("region") as r:
        (x * 3).sum().item()
        x.cpu()
    assert r.metrics["counters"]["host_syncs"] == 2


def test_config_validation():
    with pytest.raises(TypeError):
        torch.tpu.profiler.set_config({"run_dir": "x"})
