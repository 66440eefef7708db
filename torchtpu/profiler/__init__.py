"""``torch.tpu.profiler``: device timelines for ``torch.profiler`` and the XLA trace.

``torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.TPU])`` (TPU is
PrivateUse1, our device) records, besides PyTorch's CPU ops, one device event per XLA program
run, named by what it runs: ``aten::mm.default`` (a Strict per-op program), ``fused_graph_<n>``
(a Fused graph), ``compiled:forward`` / ``compiled:backward`` / ``compiled:inference``
(torch.compile). They appear in ``key_averages()`` (device time, per program and under the op
that launched it) and in the exported Chrome trace (``tensorboard_trace_handler``) on a
"TPU <n>" process. Host syncs show as ``tpu::host_sync`` and ``tpu::synchronize`` ranges; the
region's ``torch.tpu.metrics()`` delta is ``prof.tpu_metrics`` (and ``"tpuMetrics"`` in the
trace). See ``_torch.py`` for how, and why post-processing.
"""
import contextlib as _contextlib

import torch as _pytorch

from . import _state
from . import _torch
from ._state import TpuProfilerConfig

__all__ = ["TpuProfilerConfig", "set_config", "get_config", "profile", "trace",
           "metrics_region", "tensorboard_trace_handler"]

tensorboard_trace_handler = _pytorch.profiler.tensorboard_trace_handler


def set_config(config: TpuProfilerConfig) -> None:
    """The configuration every later "tpu" profiling session uses (unless given its own)."""
    if not isinstance(config, TpuProfilerConfig):
        raise TypeError("expected a torch.tpu.profiler.TpuProfilerConfig")
    _state.config = config


def get_config() -> TpuProfilerConfig:
    return _state.config


class profile(_pytorch.profiler.profile):
    """``torch.profiler.profile`` with CPU and TPU activities by default and a
    ``TpuProfilerConfig`` of its own (``config=``). ``tpu_metrics``: the ``torch.tpu.metrics()``
    delta of the last profiled window."""

    def __init__(self, *args, config: TpuProfilerConfig | None = None, **kwargs):
        if "activities" not in kwargs and not args:
            kwargs["activities"] = [_pytorch.profiler.ProfilerActivity.CPU,
                                    _pytorch.profiler.ProfilerActivity.PrivateUse1]
        self.tpu_config = config
        super().__init__(*args, **kwargs)

    def prepare_trace(self):
        super().prepare_trace()
        if self.profiler is not None:
            self.profiler._tpu_config = self.tpu_config

    @property
    def tpu_metrics(self):
        return getattr(self.profiler, "tpu_metrics", None)


@_contextlib.contextmanager
def trace(run_dir: str, config: TpuProfilerConfig | None = None):
    """The XLA trace alone (no PyTorch profiler): ``jax.profiler``'s XProf trace of the block,
    written under ``run_dir``, with torchtpu's program names."""
    from ._xla import XlaSession

    cfg = config or _state.config
    s = XlaSession(cfg.host_tracer_level, cfg.python_tracer_level)
    try:
        yield
    finally:
        from ..runtime import sync

        sync.synchronize()
        s.stop()
        s.export(run_dir)


class metrics_region:
    """``with torch.tpu.profiler.metrics_region("step") as r: ...``: ``r.metrics`` is the
    ``torch.tpu.metrics()`` delta of the block; the block is also a ``record_function`` range."""

    def __init__(self, name: str = "tpu::region"):
        self.name = name
        self.metrics = None

    def __enter__(self):
        from ..runtime import metrics as _metrics

        self._rf = _pytorch.autograd.profiler.record_function(self.name)
        self._rf.__enter__()
        self._before = _metrics.metrics()
        return self

    def __exit__(self, *exc):
        from ..runtime import metrics as _metrics

        self.metrics = _torch._delta(self._before, _metrics.metrics())
        return self._rf.__exit__(*exc)


_torch.install()
