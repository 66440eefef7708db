"""Ray Train on "tpu": the opt-in ``torch_tpu`` compatibility module, and Ray itself if installed.

Ray Train's TPU device manager (``ScalingConfig(use_tpu=True)``) imports Google's module name
``torch_tpu`` and calls ``torch_tpu._loader.load()``. torchtpu serves that name only when
``TORCHTPU_TORCH_TPU_COMPAT=1`` and no other ``torch_tpu`` is importable. Ray (~600 MB) is not in
the test extra: its tests are skipped when it is absent.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from torchtpu import integrations


@pytest.fixture
def no_torch_tpu(monkeypatch):
    """Forget any imported torch_tpu and compat finder; restore both afterwards."""
    for name in [m for m in sys.modules if m == "torch_tpu" or m.startswith("torch_tpu.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, integrations._TorchTpuCompatFinder)])
    yield
    for name in [m for m in sys.modules if m == "torch_tpu" or m.startswith("torch_tpu.")]:
        del sys.modules[name]


def test_torch_tpu_is_not_provided_by_default(no_torch_tpu):
    assert importlib.util.find_spec("torch_tpu") is None


def test_torch_tpu_compat_loads_when_asked(no_torch_tpu):
    sys.meta_path.append(integrations._TorchTpuCompatFinder())
    import torch_tpu
    import torch_tpu._loader

    assert torch_tpu.IS_TORCHTPU_COMPAT
    torch_tpu._loader.load()
    assert torch.distributed.is_backend_available("tpu_dist")
    with pytest.raises(ValueError):
        torch_tpu._loader._init_device("cuda")


def test_torch_tpu_compat_yields_to_and_refuses_beside_the_real_one(no_torch_tpu, tmp_path,
                                                                    monkeypatch):
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "torch_tpu" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.meta_path.append(integrations._TorchTpuCompatFinder())
    import torch_tpu

    assert torch_tpu.REAL and not hasattr(torch_tpu, "IS_TORCHTPU_COMPAT")
    compat = integrations._TorchTpuCompatFinder().find_spec("torch_tpu", None)
    with pytest.raises(ImportError, match="another torch_tpu"):
        compat.loader.exec_module(importlib.util.module_from_spec(compat))


def test_torch_tpu_compat_environment_variable():
    code = "import torch, torch_tpu, torch_tpu._loader; torch_tpu._loader.load(); print('ok')"
    env = {**os.environ, "TORCHTPU_TORCH_TPU_COMPAT": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
