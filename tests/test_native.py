"""torchtpu's C++ pinned-memory hooks (device/native.py, device/pinned_hooks.cpp).

Each check runs in a fresh process: installing the hooks changes process-wide PyTorch state
(the PrivateUse1 hooks), and the point is what a new process finds in the on-disk cache.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dist_launch import child_env

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("c++") is None
    and shutil.which("g++") is None, reason="needs Linux and a C++ compiler")

INSTALL = r'''
import json, torch
import torchtpu.device.native as native
x = torch.ones(3, device="tpu")
before = None
try:
    torch.empty(4, pin_memory=True)
except NotImplementedError as e:  # torch's Python hooks have no pinned allocator
    before = "getPinnedMemoryAllocator" in str(e)
native.install_pinned_hooks()
native.install_pinned_hooks()  # idempotent
p = torch.empty(16, pin_memory=True)
q = torch.arange(5.0).pin_memory()  # torchtpu's Python pin_memory: still pinned
print(json.dumps({
    "status": native.status(), "path": native.library_path(), "failed_before": before,
    "pinned": p.is_pinned(), "view_pinned": p[3:].is_pinned(),
    "plain_pinned": torch.empty(16).is_pinned(), "python_pinned": q.is_pinned(),
    "hooks": torch.tpu.is_available() and torch._C._get_accelerator().type == "tpu",
    "roundtrip": (torch.arange(4.0, device="tpu") + p[:4].fill_(1).to("tpu")).tolist(),
}))
'''


def _run(code, env, timeout=300):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_built_once_then_loaded_from_cache(tmp_path):
    env = child_env(TORCHTPU_CACHE_DIR=tmp_path)
    first = _run(INSTALL, env)
    assert first["status"]["installed"] and first["status"]["built"]
    assert first["path"].startswith(str(tmp_path / "native"))
    assert os.path.exists(first["path"])
    assert first["failed_before"] is True
    assert first["pinned"] and first["view_pinned"] and first["python_pinned"]
    assert not first["plain_pinned"]
    assert first["hooks"] and first["roundtrip"] == [1.0, 2.0, 3.0, 4.0]
    # a second process loads the cached library: it must not even look for a compiler
    second = _run(INSTALL, dict(env, CXX="/nonexistent/c++"))
    assert second["status"]["installed"] and not second["status"]["built"]
    assert second["path"] == first["path"]
    assert second["pinned"] and not second["plain_pinned"]


NO_COMPILER = r'''
import datetime, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
m = torch.nn.Linear(3, 3).to("tpu")
DDP(m)  # no find_unused_parameters: needs nothing
try:
    DDP(m, find_unused_parameters=True)
except RuntimeError as e:
    print("RAISED", str(e).replace("\n", " "))
dist.destroy_process_group()
'''


def test_missing_compiler_is_a_clear_error(tmp_path):
    env = child_env(TORCHTPU_CACHE_DIR=tmp_path, CXX="/nonexistent/c++")
    r = subprocess.run([sys.executable, "-c", NO_COMPILER], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RAISED")]
    assert line, r.stdout[-2000:]
    assert "C++ compiler" in line[0] and "find_unused_parameters=False" in line[0]


ONE_RANK = r'''
import copy, datetime, json, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("tpu_dist", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
used, unused = nn.Linear(4, 2), nn.Linear(2, 2)
ref = copy.deepcopy(used)
out = {}
for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
    mod = nn.ModuleDict({"used": copy.deepcopy(used), "unused": copy.deepcopy(unused)}).to("tpu")
    class Wrap(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.d = d
        def forward(self, x):
            return self.d["used"](x)
    model = DDP(Wrap(mod), **kw)
    for step in range(2):
        model.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        model(x.to("tpu")).square().sum().backward()
    r = copy.deepcopy(ref)
    r(x).square().sum().backward()
    out[next(iter(kw))] = {
        "grad_ok": torch.allclose(mod["used"].weight.grad.cpu(), r.weight.grad, atol=1e-5),
        "unused_none": mod["unused"].weight.grad is None}
dist.destroy_process_group()
print(json.dumps(out))
'''


def test_one_rank_ddp_unused_parameters(tmp_path):
    """A group of one: the Reducer's used-parameter map goes through the pinned staging
    copy; a used parameter gets its gradient, the unused one keeps grad None."""
    out = _run(ONE_RANK, child_env(TORCHTPU_CACHE_DIR=tmp_path))
    for kw in ("find_unused_parameters", "static_graph"):
        assert out[kw] == {"grad_ok": True, "unused_none": True}, (kw, out)
