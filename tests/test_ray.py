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


# ---------------------------------------------------------------- Ray Train (when installed)

FIT_TIMEOUT = 300


def _train_loop(cfg):
    """Three SGD steps of a small MLP on "tpu", DDP over the workers (each takes its half of the
    batch); writes losses (averaged over ranks) and final weights to cfg["out"]/rank<r>.json."""
    import json

    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("tpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.parallel.DistributedDataParallel(model.to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    n = len(x) // world
    xs, ys = x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with open(f"{cfg['out']}/rank{rank}.json", "w") as f:
        json.dump({"losses": losses, "backend": dist.get_backend(),
                   "device": str(next(model.parameters()).device),
                   "weight": model.module[0].weight.detach().cpu().tolist()}, f)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def _cpu_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), model[0].weight.detach()


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (optional, ~600 MB)")
    pytest.importorskip("ray.train.torch")
    # workers unpickle the training function by reference: they import this file's module
    path = os.pathsep.join(p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH"))
                           if p)
    ray.init(num_cpus=2, resources={"TPU": 1}, include_dashboard=False,
             runtime_env={"env_vars": {"TORCHTPU_TORCH_TPU_COMPAT": "1", "PYTHONPATH": path}})
    yield ray
    ray.shutdown()


def _fit(trainer):
    import threading

    error = []

    def run():
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001
            error.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(FIT_TIMEOUT)
    if t.is_alive():
        pytest.fail(f"Ray Train fit() did not finish in {FIT_TIMEOUT} s")
    if error:
        raise error[0]


def _results(out, world):
    import json

    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_ray_train_use_tpu_one_worker(ray_cluster, tmp_path):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    _fit(TorchTrainer(_train_loop, train_loop_config={"out": str(tmp_path)},
                      scaling_config=ScalingConfig(num_workers=1, use_tpu=True)))
    (res,) = _results(tmp_path, 1)
    losses, weight = _cpu_reference()
    assert res["backend"] == "tpu_dist" and res["device"].startswith("tpu")
    torch.testing.assert_close(torch.tensor(res["losses"]), losses)
    torch.testing.assert_close(torch.tensor(res["weight"]), weight)


@pytest.mark.slow
def test_ray_train_ddp_two_workers_tpu_dist(ray_cluster, tmp_path):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    _fit(TorchTrainer(_train_loop, train_loop_config={"out": str(tmp_path)},
                      torch_config=TorchConfig(backend="tpu_dist"),
                      scaling_config=ScalingConfig(num_workers=2,
                                                   resources_per_worker={"CPU": 1})))
    losses, weight = _cpu_reference()
    for res in _results(tmp_path, 2):
        assert res["backend"] == "tpu_dist" and res["device"].startswith("tpu")
        torch.testing.assert_close(torch.tensor(res["losses"]), losses)
        torch.testing.assert_close(torch.tensor(res["weight"]), weight)
