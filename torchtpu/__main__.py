"""``python -m torchtpu``: an environment report (versions, PJRT platform, devices, settings)."""
from __future__ import annotations

import os
import sys


def cache_dir() -> str:
    """The persistent compile cache folder (torchtpu/compile/cache.py decides), or "off"."""
    try:
        from torchtpu.compile.cache import cache_dir as _d
    except ImportError:
        _d = None
    if _d is not None:
        return _d() or "off (TORCHTPU_CACHE_DIR is empty)"
    d = os.environ.get("TORCHTPU_CACHE_DIR")
    if d is not None:
        return d or "off (TORCHTPU_CACHE_DIR is empty)"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def report() -> str:
    import jax
    import jaxlib
    import torch

    import torchtpu
    from torchtpu.device import tpu_module as tpu
    from torchtpu.runtime import devices, memory

    lines = [
        f"torchtpu {torchtpu.__version__}",
        f"python {sys.version.split()[0]}",
        f"torch {torch.__version__}",
        f"jax {jax.__version__}",
        f"jaxlib {jaxlib.__version__}",
        f"PJRT platform: {devices.platform()}"
        + (f" (TORCHTPU_PLATFORM={os.environ['TORCHTPU_PLATFORM']})"
           if os.environ.get("TORCHTPU_PLATFORM") else ""),
        f"device count: {tpu.device_count()}",
    ]
    for i in range(tpu.device_count()):
        p = tpu.get_device_properties(i)
        used = memory.memory_allocated(i)
        src = memory.memory_stats(i)["source"]
        lines.append(f"  tpu:{i}: {p.name} (platform {p.platform}, id {p.id}), "
                     f"memory {_mib(p.total_memory)} total, {_mib(used)} in use [{src}]")
    lines += [
        f"eager mode: {tpu.get_eager_mode().name}",
        f"matmul precision: {tpu.precision().name}",
        f"cache folder: {cache_dir()}"
        + ("" if "TORCHTPU_CACHE_DIR" in os.environ else " (set TORCHTPU_CACHE_DIR to change)"),
        f"CPU fallback: {'enabled' if tpu._get_enable_cpu_fallback() else 'disabled'}"
        " (TORCHTPU_CPU_FALLBACK, torch.tpu.enable_cpu_fallback)",
        f"x64 (int64/float64): {bool(jax.config.jax_enable_x64)}",
    ]
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
