"""The process-wide profiler configuration (``torch.tpu.profiler.set_config``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TpuProfilerConfig:
    """How a "tpu" profiling session traces.

    - ``host_tracer_level``: XLA's host tracer (0 off, 1 user annotations, 2 runtime and, on
      XLA:CPU, the HLO ops each program ran: the device timeline there needs 2; 3 verbose).
    - ``device_tracer_level``: 0 records no device timeline (no XLA tracer unless ``run_dir``),
      1 records one event per XLA program run.
    - ``python_tracer_level``: 1 adds Python function calls to the XLA trace (slow).
    - ``run_dir``: when set, the XLA trace (XProf ``.xplane.pb``, readable by TensorBoard's
      profile plugin, XProf and Perfetto via ``xprof``) and the region's ``tpu_metrics.json``
      are written under it, as ``jax.profiler.trace(run_dir)`` lays them out.
    """

    host_tracer_level: int = 2
    device_tracer_level: int = 1
    python_tracer_level: int = 0
    run_dir: str | None = None


config = TpuProfilerConfig()
