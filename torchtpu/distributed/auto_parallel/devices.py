"""The device table of the cost model: peak matmul throughput, memory and interconnect.

Published figures (per chip): TPU v5e 197 TFLOP/s bf16, 16 GB HBM, 1,600 Gbit/s ICI;
TPU v6e (Trillium) 918 TFLOP/s bf16, 32 GB HBM, 3,200 Gbit/s ICI; H100 SXM 989 TFLOP/s dense
bf16, 80 GB HBM3, NVLink 900 GB/s (both directions). A TPU chip's ICI is split over the two
axes of its 2-D torus, so one mesh axis (one ring) gets half of it in each direction; NVLink
reaches every GPU of the node, so every axis gets half the bidirectional figure. ``cpu`` is this
kind of host: XLA:CPU on a few cores, collectives through gloo (latency and bandwidth as
measured for 2 processes in DISTRIBUTED.md, ~0.3 ms and ~0.4 GB/s).

``efficiency`` scales the peak to what a training step reaches (model FLOPs utilisation); float32
matmuls count ``fp32_slowdown`` times the bf16 time (TPU: multi-pass bf16; H100: TF32 is half
the bf16 rate).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # bf16 FLOP/s per device
    hbm_bytes: float
    axis_bandwidth: float  # bytes/s one device sends along one mesh axis (one direction)
    latency: float  # seconds per collective step (alpha)
    efficiency: float = 0.5
    fp32_slowdown: float = 2.0

    def to_dict(self) -> dict:
        return asdict(self)


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


GB = 1e9
DEVICES = {
    "v5e": DeviceSpec("TPU v5e", 197e12, 16 * GB, 1600e9 / 8 / 2, 2e-6),
    "v6e": DeviceSpec("TPU v6e", 918e12, 32 * GB, 3200e9 / 8 / 2, 2e-6),
    "h100": DeviceSpec("NVIDIA H100 SXM", 989e12, 80 * GB, 900e9 / 2, 8e-6),
    "cpu": DeviceSpec("XLA:CPU host", 50e9, _host_memory(), 0.4e9, 3e-4, efficiency=1.0,
                      fp32_slowdown=1.0),
}


def device_spec(spec) -> DeviceSpec:
    """A ``DeviceSpec`` from a name in ``DEVICES`` (case-insensitive) or a spec itself."""
    if isinstance(spec, DeviceSpec):
        return spec
    key = str(spec).lower().replace("tpu", "").replace("-", "").replace(" ", "") or "cpu"
    if key not in DEVICES:
        raise ValueError(f"auto_parallelize: unknown device_spec {spec!r}; known: "
                         f"{sorted(DEVICES)} or a DeviceSpec")
    return DEVICES[key]
