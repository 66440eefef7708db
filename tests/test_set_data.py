"""``tensor.data = other`` between "cpu" and "tpu" (device/set_data.py, set_data.cpp), with
CUDA's semantics: the same Python object keeps its autograd meta (requires_grad, .grad, hooks,
leaf-ness) and its version counter, and takes the other tensor's storage, shape, dtype and
device. PyTorch refused it ("incompatible tensor type"); FSDP2's fully_shard does it for a model
built on CPU (tests/test_fsdp.py runs that on two ranks)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

TPU = torch.device("tpu")


def test_parameters_move_both_ways_and_train_like_cpu():
    """Parameters and a buffer moved with ``.data =`` (the optimizer built before the move):
    SGD steps on "tpu" give CPU's losses and parameters; then back to CPU."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref.register_buffer("shift", torch.full((2,), 0.5))
    m = copy.deepcopy(ref)
    objs = [*m.parameters(), *m.buffers()]
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for t in objs:
        t.data = t.to(TPU)
    assert [*m.parameters(), *m.buffers()] == objs  # the same objects, now on tpu
    assert all(t.device.type == "tpu" for t in objs)
    assert all(p.requires_grad and p.is_leaf and isinstance(p, nn.Parameter)
               for p in m.parameters())
    assert opt.param_groups[0]["params"][0] is objs[0]
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        for model, o, dev in ((m, opt, TPU), (ref, ref_opt, "cpu")):
            o.zero_grad()
            loss = nn.functional.mse_loss(model(x.to(dev)) + model.shift, y.to(dev))
            loss.backward()
            o.step()
            if dev == "cpu":
                torch.testing.assert_close(got.cpu(), loss.detach())
            else:
                got = loss.detach()
    for t in objs:
        t.data = t.cpu()
    assert all(t.device.type == "cpu" for t in objs)
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach())
        assert a.grad.device.type == "tpu"  # .grad is left alone, as on CUDA


def test_autograd_state_and_version_counter_are_kept():
    p = nn.Parameter(torch.randn(3))
    with torch.no_grad():
        p.mul_(2)  # version 1
    seen = []
    p.register_hook(lambda g: seen.append(g.device.type))
    p.grad = torch.ones(3)
    version = p._version
    assert version == 1
    p.data = p.detach().to(TPU)
    assert p._version == version  # set_data neither shares nor bumps the counter (CUDA too)
    assert p.grad.device.type == "cpu"  # untouched, as CUDA leaves it
    p.grad = None
    (p * torch.arange(3.0, device=TPU)).sum().backward()
    assert seen == ["tpu"]
    torch.testing.assert_close(p.grad.cpu(), torch.arange(3.0))
    # the data tensor and the parameter do not share a version counter afterwards
    d = p.data
    with torch.no_grad():
        d.add_(1)
    assert p._version == version


def test_a_graph_alive_across_the_move_gets_a_fresh_gradient_accumulator():
    """A graph built before the move holds the parameter's gradient accumulator, whose input
    metadata names CPU: set_data drops it, so a graph built after accumulates on tpu."""
    p = nn.Parameter(torch.randn(4))
    old = (p * 2).sum()  # holds AccumulateGrad(p, cpu)
    p.data = p.detach().to(TPU)
    (p * 3).sum().backward()
    assert p.grad.device.type == "tpu"
    torch.testing.assert_close(p.grad.cpu(), torch.full((4,), 3.0))
    del old


def test_errors_read_like_pytorch():
    p = nn.Parameter(torch.randn(2))
    with pytest.raises(RuntimeError, match="must be floating point or complex dtype"):
        p.data = torch.ones(2, dtype=torch.int64, device=TPU)
    s = torch.randn(2, 2).to_sparse()
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        s.data = torch.randn(2, 2, device=TPU)
    assert p.device.type == "cpu" and s.device.type == "cpu"
    # same-device and CPU-only assignments are PyTorch's own
    q = torch.zeros(2)
    q.data = torch.ones(2, dtype=torch.float64)
    assert q.dtype == torch.float64
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        q.data = torch.ones(2, device="meta")


def test_data_inside_torch_compile():
    """Dynamo handles ``.data`` by name: reading it in a compiled function still works."""
    w = nn.Parameter(torch.randn(3, device=TPU))

    @torch.compile(backend="tpu")
    def f(x):
        return x * w.data + 1

    x = torch.randn(3)
    torch.testing.assert_close(f(x.to(TPU)).cpu(), x * w.detach().cpu() + 1)


def test_library_built_once_and_loaded_by_a_second_process(tmp_path):
    """The C++ helper is compiled by the first process and only loaded by the next (the
    persistent cache folder, TORCHTPU_CACHE_DIR)."""
    code = textwrap.dedent("""
        import torch
        from torchtpu.device import set_data
        p = torch.nn.Parameter(torch.ones(2))
        p.data = p.to("tpu")
        print("BUILT" if set_data._state["built"] else "LOADED", p.device.type)
    """)
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        outs.append(r.stdout.split()[-2:])
    assert outs == [["BUILT", "tpu"], ["LOADED", "tpu"]], outs
