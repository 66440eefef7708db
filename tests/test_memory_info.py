"""Memory size queries: torch.tpu.mem_get_info / memory_stats / get_device_properties.

PJRT's statistics where the platform has them (simulated here, since the CPU client has none),
else the host's memory (the CPU platform's device memory is host memory).
"""
from __future__ import annotations

import pytest
import torch

from torchtpu.device import tpu_module
from torchtpu.runtime import devices, memory

GiB = 1 << 30
on_cpu_platform = pytest.mark.skipif(devices.platform() != "cpu", reason="CPU platform only")


@on_cpu_platform
def test_cpu_platform_reports_host_memory():
    info = memory._meminfo()
    free, total = torch.tpu.mem_get_info()
    cg = memory._cgroup_limit()
    expect_total = info["MemTotal"] if cg is None else min(info["MemTotal"], cg[0])
    assert total == expect_total == torch.tpu.get_device_properties().total_memory
    # free is the kernel's MemAvailable (read again: other processes move it a little), not
    # total minus what torchtpu holds (that reported all of RAM as free)
    avail = memory._meminfo()["MemAvailable"]
    assert 0 < free <= total
    assert abs(free - avail) < max(avail // 10, 256 << 20)
    assert torch.accelerator.get_memory_info() == (pytest.approx(free, rel=0.1), total)
    stats = torch.tpu.memory_stats()
    assert stats["bytes_limit"] == total and 0 < stats["bytes_free"] <= total
    assert torch.tpu.get_device_properties().is_integrated


def test_host_memory_bounded_by_cgroup(monkeypatch):
    monkeypatch.setattr(memory, "_meminfo", lambda: {"MemTotal": 64 * GiB, "MemAvailable": 40 * GiB})
    monkeypatch.setattr(memory, "_cgroup_limit", lambda: None)
    assert memory.host_memory() == (40 * GiB, 64 * GiB)
    monkeypatch.setattr(memory, "_cgroup_limit", lambda: (16 * GiB, 10 * GiB))
    assert memory.host_memory() == (6 * GiB, 16 * GiB)
    monkeypatch.setattr(memory, "_cgroup_limit", lambda: (16 * GiB, 17 * GiB))
    assert memory.host_memory() == (0, 16 * GiB)


def test_pjrt_statistics_are_used_where_the_platform_has_them(monkeypatch):
    stats = {"bytes_limit": 16 * GiB, "bytes_in_use": 3 * GiB, "peak_bytes_in_use": 5 * GiB,
             "num_allocs": 7}
    monkeypatch.setattr(memory, "_pjrt_stats", lambda i: dict(stats))
    monkeypatch.setattr(memory, "_peak_reset_base", set())
    assert torch.tpu.mem_get_info() == (13 * GiB, 16 * GiB)
    assert memory.total_memory(0) == 16 * GiB
    assert torch.tpu.get_device_properties().total_memory == 16 * GiB
    s = torch.tpu.memory_stats()
    assert s["source"] == "pjrt" and s["bytes_limit"] == 16 * GiB
    assert s["allocated_bytes.all.current"] == 3 * GiB
    assert s["allocated_bytes.all.peak"] == 5 * GiB


def test_peak_flops_of_known_device_kinds():
    assert tpu_module.peak_flops("TPU v4") == 275e12
    assert tpu_module.peak_flops("TPU v5 lite") == 197e12
    assert tpu_module.peak_flops("TPU v5p") == 459e12
    assert tpu_module.peak_flops("TPU v6 lite") == 918e12
    assert tpu_module.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert tpu_module.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert tpu_module.peak_flops("NVIDIA L40S") == 362e12
    assert tpu_module.peak_flops("cpu") is None
    p = torch.tpu.get_device_properties()
    assert p.peak_flops == tpu_module.peak_flops(p.device_kind)
    assert p.name == torch.tpu.get_device_name()
