"""torch.tpu.optimizers: AdamW/SGD equal to torch.optim on CPU step for step, Muon equal to a
plain-PyTorch reference on CPU, the functional forms, state_dict compatibility, one program per
step (optimizer and SingleTraceTrainer), donation, learning-rate changes without recompiling.

Models: the GPT of examples/train_gpt.py and a ResNet-18 (torchvision's architecture: a 7x7
stem, max pool, four stages of two BasicBlocks with BatchNorm and strided 1x1 downsampling,
average pool, a classifier) at small widths. torchvision itself is not installed: PyPI's wheel
is a CUDA build whose ops do not load next to a CPU torch.

Comparing optimizers: the optimizer tests give the CPU optimizer the tpu model's gradients
(copied each step), so both update identical inputs and the comparison is of the updates alone,
at assert_close's float32 defaults. The attention's key bias has a true gradient of zero (softmax
is shift invariant), so what any backend computes for it is rounding noise (~1e-12) which
Adam normalises into steps of a fraction of lr: end-to-end comparisons (the trainer's, whose
gradients never leave its program) use lr=1e-3, where those steps stay under the tolerance.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.adamw import adamw as torch_adamw
from torch.optim.sgd import sgd as torch_sgd

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

import train_gpt  # noqa: E402
from helpers import classification_batches, token_batches  # noqa: E402

from torchtpu.runtime import devices  # noqa: E402

TPU = "tpu"
opts = torch.tpu.optimizers


# ----------------------------------------------------------------------------- models

def small_gpt():
    return train_gpt.GPT(vocab_size=20, seq_len=16, n_layer=2, n_head=2, n_embd=32)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, widths=(8, 16, 32, 64), classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.pool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def gpt_loss(model, x, y):
    return model(x, y)[1]


def ce_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def gpt_batches(n=3):
    return token_batches(n, 4, 16, 20)


def image_batches(n=3, size=64, batch=8):
    """ResNet-18 at 64x64 ends in 2x2 maps: its last BatchNorms see 32 values per channel (at
    16x16 they would see 4, and normalising 4 numbers amplifies rounding ~100x)."""
    return classification_batches(n, batch, (3, size, size), 10, seed=5)


def decay_groups(model, weight_decay=0.1):
    """The example's grouping: decay on matrices, none on biases and norms."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2],
             "weight_decay": weight_decay},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def pair(build, seed=0):
    torch.manual_seed(seed)
    cpu = build()
    return cpu, copy.deepcopy(cpu).to(TPU)


def assert_params_close(cpu_model, tpu_model):
    for (n, pc), pt in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(pt.detach().cpu(), pc.detach(), msg=lambda m: f"{n}: {m}")
    for (n, bc), bt in zip(cpu_model.named_buffers(), tpu_model.buffers()):
        torch.testing.assert_close(bt.cpu(), bc, msg=lambda m: f"buffer {n}: {m}")


def assert_states_close(cpu_opt, tpu_opt):
    sc, st = cpu_opt.state_dict(), tpu_opt.state_dict()
    assert sc["param_groups"] == st["param_groups"]
    assert sc["state"].keys() == st["state"].keys()
    for i, s in sc["state"].items():
        assert s.keys() == st["state"][i].keys(), i
        for k, v in s.items():
            torch.testing.assert_close(st["state"][i][k].cpu(), v.cpu(), msg=lambda m: f"{i}.{k}: {m}")


def eager_ops():
    c = torch.tpu.metrics()["counters"]
    return c.get("eager_cache_hits", 0) + c.get("eager_cache_misses", 0) \
        + c.get("fused_ops_recorded", 0)


def counter(name):
    return torch.tpu.metrics()["counters"].get(name, 0)


# ----------------------------------------------------------------------------- the classes

def run_same_grads(build, batches, loss_fn, make_cpu, make_tpu, check_one_program=True):
    """Train the tpu model with ``make_tpu``'s optimizer; give the CPU model (same weights)
    the tpu gradients and step ``make_cpu``'s torch.optim optimizer; compare every step."""
    cpu, tpu = pair(build)
    oc, ot = make_cpu(cpu), make_tpu(tpu)
    for i, (x, y) in enumerate(batches):
        ot.zero_grad()
        oc.zero_grad()
        loss_fn(tpu, x.to(TPU), y.to(TPU)).backward()
        for pc, pt in zip(cpu.parameters(), tpu.parameters()):
            pc.grad = None if pt.grad is None else pt.grad.cpu()
        for bc, bt in zip(cpu.buffers(), tpu.buffers()):  # BatchNorm's statistics: the forward's
            bc.copy_(bt.cpu())
        torch.tpu.synchronize()
        before, programs = eager_ops(), counter("optim_programs")
        ot.step()
        if check_one_program and i > 0:  # the first step also creates the state (zeros_like)
            assert eager_ops() == before, "optimizer.step ran eager ops"
            assert counter("optim_programs") == programs + 1
        oc.step()
        assert_params_close(cpu, tpu)
    assert_states_close(oc, ot)
    assert counter("optim_fallbacks") == 0, torch.tpu.metrics()["per_op"].get("optim_fallbacks")
    return oc, ot


ADAMW = dict(lr=1e-2, betas=(0.9, 0.95))
SGD_CASES = {
    "nesterov_decay": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "dampening_maximize": dict(lr=0.05, momentum=0.5, dampening=0.3, maximize=True),
    "plain": dict(lr=0.05),
}


def test_adamw_gpt_matches_torch_optim():
    torch.tpu.reset_metrics()
    run_same_grads(small_gpt, gpt_batches(), gpt_loss,
                   lambda m: torch.optim.AdamW(decay_groups(m), **ADAMW),
                   lambda m: opts.AdamW(decay_groups(m), **ADAMW))
    assert counter("optim_traces") == 1  # one program for all groups, traced once
    assert counter("optim_donated_buffers") > 0


@pytest.mark.parametrize("case", sorted(SGD_CASES))
def test_sgd_gpt_matches_torch_optim(case):
    kw = SGD_CASES[case]
    torch.tpu.reset_metrics()
    run_same_grads(small_gpt, gpt_batches(), gpt_loss, lambda m: torch.optim.SGD(decay_groups(m), **kw),
                   lambda m: opts.SGD(decay_groups(m), **kw),
                   check_one_program=True)


@pytest.mark.slow
def test_adamw_amsgrad_and_adam_resnet_match_torch_optim():
    kw = dict(lr=1e-2, amsgrad=True, weight_decay=0.05)
    run_same_grads(ResNet18, image_batches(), ce_loss, lambda m: torch.optim.AdamW(m.parameters(), **kw),
                   lambda m: opts.AdamW(m.parameters(), **kw))
    run_same_grads(ResNet18, image_batches(2), ce_loss,
                   lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.05),
                   lambda m: opts.Adam(m.parameters(), lr=1e-2, weight_decay=0.05))


def test_optimizers_are_torch_optim_classes():
    p = [nn.Parameter(torch.zeros(2, 2, device=TPU))]
    assert isinstance(opts.AdamW(p), torch.optim.AdamW)
    assert isinstance(opts.SGD(p, lr=0.1), torch.optim.SGD)
    assert isinstance(opts.Muon(p), torch.optim.Muon)
    assert isinstance(opts.AdamW(p), torch.optim.Optimizer)


# ----------------------------------------------------------------------------- Muon

NS = dict(ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7)


def reference_muon_step(params, grads, bufs, *, lr, weight_decay, momentum, nesterov,
                        ns_coefficients, ns_steps, eps, ns_dtype=torch.bfloat16):
    """Muon (Keller Jordan's, as torch.optim.Muon documents it) in plain PyTorch on CPU; the
    Newton-Schulz iterations in ``ns_dtype`` (Muon's bfloat16, or float32: the exact math)."""
    a, b, c = ns_coefficients
    for p, g, buf in zip(params, grads, bufs):
        buf.lerp_(g, 1 - momentum)
        u = g.lerp(buf, momentum) if nesterov else buf
        x = u.to(ns_dtype)
        tall = x.size(0) > x.size(1)
        if tall:
            x = x.T
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        if tall:
            x = x.T
        p.mul_(1 - lr * weight_decay)
        p.add_(x, alpha=-lr * max(1, p.size(0) / p.size(1)) ** 0.5)


def muon_reference(params, grads, bufs, **kw):
    """(bfloat16 reference params, float32 reference params); ``bufs`` advanced once."""
    exact, exact_bufs = [p.clone() for p in params], [b.clone() for b in bufs]
    with torch.no_grad():
        reference_muon_step(exact, grads, exact_bufs, ns_dtype=torch.float32, **NS, **kw)
        bf16 = [p.clone() for p in params]
        reference_muon_step(bf16, grads, bufs, **NS, **kw)
    return bf16, exact


def assert_muon_update(got, bf16, exact, old):
    """Muon's update is computed in bfloat16, where XLA's and PyTorch's products round
    differently, and each lands a few percent (relative Frobenius norm of the update) from
    the float32 iteration, in independent directions. So ours must be as close to the
    float32 update as PyTorch's bfloat16 one is (within 1.5x)."""
    def rel(a, b):
        return ((a - b).norm() / (b - old).norm()).item()

    ours, torchs = rel(got, exact), rel(bf16, exact)
    print(f"muon update error vs float32: ours {ours:.4f}, torch bfloat16 {torchs:.4f}")
    assert torchs < 0.2  # the reference itself is close to the exact update
    assert ours <= 1.5 * torchs + 1e-6, (ours, torchs)


def test_muon_matches_reference():
    """GPT's 2-D weights under Muon; each step the reference starts from the tpu parameters
    and takes the tpu gradients. The momentum buffers (float32) agree at float32's tolerance,
    the update to bfloat16's precision (``assert_muon_update``)."""
    torch.tpu.reset_metrics()
    cpu, tpu = pair(small_gpt)
    pick = lambda m: [p for p in m.parameters() if p.ndim == 2]  # noqa: E731
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    ot = opts.Muon(pick(tpu), **kw)
    bufs = [torch.zeros_like(p) for p in pick(cpu)]
    for i, (x, y) in enumerate(gpt_batches()):
        ot.zero_grad()
        gpt_loss(tpu, x.to(TPU), y.to(TPU)).backward()
        grads = [p.grad.cpu() for p in pick(tpu)]
        old = [p.detach().cpu() for p in pick(tpu)]
        before = eager_ops()
        ot.step()
        if i > 0:
            assert eager_ops() == before
        bf16, exact = muon_reference(old, grads, bufs, **kw)
        for pt, b, e, o in zip(pick(tpu), bf16, exact, old):
            assert_muon_update(pt.detach().cpu(), b, e, o)
        for j, buf in enumerate(bufs):
            torch.testing.assert_close(ot.state[pick(tpu)[j]]["momentum_buffer"].cpu(), buf)
    assert counter("optim_traces") == 1


def test_muon_matches_torch_optim_muon_state_dict():
    p = [nn.Parameter(torch.randn(8, 4))]
    p0 = p[0].detach().clone()
    t = [nn.Parameter(p0.to(TPU))]
    oc, ot = torch.optim.Muon(p, lr=0.02), opts.Muon(t, lr=0.02)
    p[0].grad = torch.randn(8, 4)
    t[0].grad = p[0].grad.to(TPU)
    oc.step()
    ot.step()
    assert oc.state_dict()["param_groups"] == ot.state_dict()["param_groups"]
    torch.testing.assert_close(ot.state[t[0]]["momentum_buffer"].cpu(),
                               oc.state[p[0]]["momentum_buffer"])
    bf16, exact = muon_reference([p0], [p[0].grad], [torch.zeros(8, 4)], lr=0.02,
                                 weight_decay=0.1, momentum=0.95, nesterov=True)
    torch.testing.assert_close(bf16[0], p[0].detach())  # the reference is torch.optim.Muon's math
    assert_muon_update(t[0].detach().cpu(), bf16[0], exact[0], p0)


# ----------------------------------------------------------------------------- functional

def test_functional_forms_match_torch_optim():
    torch.manual_seed(0)
    shapes = [(4, 3), (5,), (2, 2, 2)]
    ps = [torch.randn(s) for s in shapes]
    gs = [[torch.randn(s) for s in shapes] for _ in range(3)]
    # adamw
    cpu = dict(p=[p.clone() for p in ps], m=[torch.zeros_like(p) for p in ps],
               v=[torch.zeros_like(p) for p in ps], s=[torch.tensor(0.0) for _ in ps])
    dev = {k: [t.to(TPU) for t in v] for k, v in cpu.items()}
    kw = dict(amsgrad=False, beta1=0.9, beta2=0.99, lr=1e-2, weight_decay=0.1, eps=1e-8,
              maximize=False)
    for g in gs:
        torch_adamw(cpu["p"], g, cpu["m"], cpu["v"], [], cpu["s"], foreach=False, **kw)
        opts.functional.adamw(dev["p"], [x.to(TPU) for x in g], dev["m"], dev["v"], [], dev["s"],
                              **kw)
    for k in cpu:
        for a, b in zip(dev[k], cpu[k]):
            torch.testing.assert_close(a.cpu(), b)
    # sgd: the buffers start as None and are filled in, as torch.optim's functional does
    pc, pd = [p.clone() for p in ps], [p.to(TPU) for p in ps]
    bc, bd = [None] * 3, [None] * 3
    kw = dict(weight_decay=0.01, momentum=0.9, lr=0.05, dampening=0.1, nesterov=False,
              maximize=False)
    for g in gs:
        torch_sgd(pc, g, bc, foreach=False, **kw)
        opts.functional.sgd(pd, [x.to(TPU) for x in g], bd, **kw)
    for a, b in zip(pd + bd, pc + bc):
        torch.testing.assert_close(a.cpu(), b)
    # muon (2-D)
    pd, bc, bd = [torch.randn(6, 4).to(TPU)], [torch.zeros(6, 4)], [torch.zeros(6, 4, device=TPU)]
    for _ in range(2):
        g, old = torch.randn(6, 4), pd[0].cpu()
        opts.functional.muon(pd, [g.to(TPU)], bd, lr=0.02, weight_decay=0.1, momentum=0.95)
        bf16, exact = muon_reference([old], [g], bc, lr=0.02, weight_decay=0.1, momentum=0.95,
                                     nesterov=True)
        assert_muon_update(pd[0].cpu(), bf16[0], exact[0], old)
        torch.testing.assert_close(bd[0].cpu(), bc[0])


# ----------------------------------------------------------------------------- state_dict, lr

def test_state_dict_round_trip_with_torch_optim():
    """Ours -> torch.optim on CPU -> ours again: the same keys and values, and training
    continues identically from each."""
    batches = gpt_batches(4)
    cpu, tpu = pair(small_gpt)
    ot = opts.AdamW(decay_groups(tpu), **ADAMW)
    for x, y in batches[:2]:
        ot.zero_grad()
        gpt_loss(tpu, x.to(TPU), y.to(TPU)).backward()
        ot.step()
    sd = ot.state_dict()
    assert all(v["step"].device.type == TPU for v in sd["state"].values())
    cpu.load_state_dict({k: v.cpu() for k, v in tpu.state_dict().items()})
    oc = torch.optim.AdamW(decay_groups(cpu), **ADAMW)
    oc.load_state_dict({"state": {i: {k: v.cpu() for k, v in s.items()}
                                  for i, s in sd["state"].items()},
                        "param_groups": sd["param_groups"]})
    # and back: a torch.optim state_dict (CPU step counts) into a fresh optimizer of ours
    ot2 = opts.AdamW(decay_groups(tpu), **ADAMW)
    ot2.load_state_dict(oc.state_dict())
    for x, y in batches[2:]:
        ot2.zero_grad()
        oc.zero_grad()
        gpt_loss(tpu, x.to(TPU), y.to(TPU)).backward()
        for pc, pt in zip(cpu.parameters(), tpu.parameters()):
            pc.grad = pt.grad.cpu()
        ot2.step()
        oc.step()
        assert_params_close(cpu, tpu)
    assert_states_close(oc, ot2)


def test_lr_scheduler_changes_lr_without_recompiling():
    torch.tpu.reset_metrics()
    cpu, tpu = pair(small_gpt)
    oc = torch.optim.AdamW(cpu.parameters(), **ADAMW)
    ot = opts.AdamW(tpu.parameters(), **ADAMW)
    sc = torch.optim.lr_scheduler.OneCycleLR(oc, max_lr=3e-2, total_steps=4)
    st = torch.optim.lr_scheduler.OneCycleLR(ot, max_lr=3e-2, total_steps=4)
    for x, y in gpt_batches(4):
        ot.zero_grad()
        oc.zero_grad()
        gpt_loss(tpu, x.to(TPU), y.to(TPU)).backward()
        for pc, pt in zip(cpu.parameters(), tpu.parameters()):
            pc.grad = pt.grad.cpu()
        ot.step()
        oc.step()
        sc.step()
        st.step()
        assert_params_close(cpu, tpu)
    assert len({g["lr"] for g in ot.param_groups}) == 1 and counter("optim_programs") == 4
    assert counter("optim_traces") == 1 and counter("optim_xla_compiles") <= 1


def test_falls_back_to_torch_optim_off_the_device():
    """Parameters on CPU: torch.optim's own step, counted."""
    torch.tpu.reset_metrics()
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), \
        opts.SGD(b.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3)
    for m, o in ((a, oa), (b, ob)):
        for _ in range(2):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    assert_params_close(a, b)
    assert torch.tpu.metrics()["per_op"]["optim_fallbacks"] == {"device": 2}


# ----------------------------------------------------------------------------- donation

def _pointers(tensors):
    """Device addresses of the tensors' arrays (0-d ones left out: XLA may merge the equal
    step counts of a step into one result, which then cannot reuse each input's 4 bytes)."""
    return {t.untyped_storage()._tpu_buffer.array.unsafe_buffer_pointer() for t in tensors
            if t.dim() > 0}


def test_step_updates_parameters_and_state_in_place():
    """Donation: after a step the parameters and state live in the same device memory as
    before (XLA updated them in place), and the device holds one copy of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).to(TPU)
    opt = opts.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 256, device=TPU)

    def step():
        opt.zero_grad(set_to_none=False)
        model(x).sum().backward()
        opt.step()

    step()  # creates the state
    torch.tpu.synchronize()
    state = [t for s in opt.state.values() for t in s.values()]
    before = _pointers(list(model.parameters()) + state)
    allocated = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    torch.tpu.reset_metrics()
    step()
    torch.tpu.synchronize()
    assert _pointers(list(model.parameters()) + state) == before
    assert counter("optim_donated_buffers") == 4 * 4  # 4 parameters x (param + 3 states)
    assert torch.tpu.memory_allocated() == allocated
    # one copy of the state: the peak stays under what a second copy of params + state costs
    nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + state)
    assert torch.tpu.max_memory_allocated() < allocated + nbytes


# ----------------------------------------------------------------------------- trainer

def run_trainer(build, batches, loss_fn, make_opt, cpu_make_opt=None):
    """(cpu losses, trainer losses, cpu model, tpu model, tpu optimizer)."""
    cpu, tpu = pair(build)
    oc = (cpu_make_opt or make_opt)(cpu)
    ot = make_opt(tpu)
    trainer = opts.SingleTraceTrainer(tpu, loss_fn, ot)
    lc, lt = [], []
    for i, (x, y) in enumerate(batches):
        oc.zero_grad()
        loss = loss_fn(cpu, x, y)
        loss.backward()
        oc.step()
        lc.append(loss.detach())
        xt, yt = x.to(TPU), y.to(TPU)
        torch.tpu.synchronize()
        before, programs = eager_ops(), counter("trainer_programs")
        lt.append(trainer.step(xt, yt))
        if i > 0:  # one program per step, nothing else on the device
            assert eager_ops() == before and counter("trainer_programs") == programs + 1
        lt[-1] = lt[-1].cpu()
    return torch.stack(lc), torch.stack(lt), cpu, tpu, oc, ot


def test_trainer_gpt_adamw_matches_cpu():
    torch.tpu.reset_metrics()
    kw = dict(lr=1e-3, betas=(0.9, 0.95))
    lc, lt, cpu, tpu, oc, ot = run_trainer(
        small_gpt, gpt_batches(), gpt_loss, lambda m: opts.AdamW(decay_groups(m), **kw),
        lambda m: torch.optim.AdamW(decay_groups(m), **kw))
    torch.testing.assert_close(lt, lc)
    assert_params_close(cpu, tpu)
    assert_states_close(oc, ot)
    assert counter("trainer_traces") == 1  # one program, built once (or loaded: keyed by text)
    assert counter("trainer_xla_compiles") + counter("trainer_disk_cache_hits") == 1
    assert counter("trainer_donated_buffers") > 0


@pytest.mark.slow
def test_trainer_resnet_sgd_matches_cpu():
    """BatchNorm's running statistics are outputs of the one program (written back). lr=0.01:
    at 0.05 this batch-8 ResNet's loss jumps (2.2 -> 2.9) and the steps amplify rounding."""
    kw = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)
    lc, lt, cpu, tpu, oc, ot = run_trainer(
        ResNet18, image_batches(), ce_loss, lambda m: opts.SGD(m.parameters(), **kw),
        lambda m: torch.optim.SGD(m.parameters(), **kw))
    torch.testing.assert_close(lt, lc)
    assert_params_close(cpu, tpu)
    assert_states_close(oc, ot)


def test_trainer_cnn_adamw_batchnorm_and_scheduler():
    """A conv/BatchNorm net (the ResNet's layers, fewer of them) under AdamW with a scheduler
    changing lr every step: equal to CPU, one trace, one compile."""
    torch.tpu.reset_metrics()

    def build():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                             nn.ReLU(), nn.MaxPool2d(2), BasicBlock(8, 16, 2),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    scheds = []

    def make(m, cls):
        o = cls(m.parameters(), lr=1e-3, weight_decay=0.05)
        scheds.append(torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
        return o

    cpu, tpu = pair(build)
    oc, ot = make(cpu, torch.optim.AdamW), make(tpu, opts.AdamW)
    trainer = opts.SingleTraceTrainer(tpu, ce_loss, ot)
    for x, y in image_batches(3, size=16, batch=4):
        oc.zero_grad()
        lc = ce_loss(cpu, x, y)
        lc.backward()
        oc.step()
        lt = trainer.step(x.to(TPU), y.to(TPU))
        for s in scheds:
            s.step()
        torch.testing.assert_close(lt.cpu(), lc.detach())
    assert ot.param_groups[0]["lr"] == 1e-3 / 8
    assert_params_close(cpu, tpu)
    assert_states_close(oc, ot)
    assert counter("trainer_traces") == 1  # one program, built once (or loaded: keyed by text)
    assert counter("trainer_xla_compiles") + counter("trainer_disk_cache_hits") == 1


def test_trainer_donates_parameters_and_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(TPU)
    opt = opts.AdamW(model.parameters(), lr=1e-3)
    trainer = opts.SingleTraceTrainer(model, lambda m, x: m(x).pow(2).mean(), opt)
    x = torch.randn(8, 256, device=TPU)
    trainer.step(x)
    torch.tpu.synchronize()
    state = [t for s in opt.state.values() for t in s.values()]
    before = _pointers(list(model.parameters()) + state)
    allocated = torch.tpu.memory_allocated()
    loss = trainer.step(x)
    del loss
    torch.tpu.synchronize()
    assert _pointers(list(model.parameters()) + state) == before
    assert torch.tpu.memory_allocated() == allocated


def _compiled_program(trainer, batch):
    """The trainer's one program compiled for one more ``step(*batch)``'s arguments."""
    import jax

    (key, prog), = trainer._programs.items()
    calls = []
    orig = prog.__call__

    class Spy:
        def __call__(self, *flat):
            calls.append([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat])
            return orig(*flat)

    trainer._programs[key] = Spy()
    try:
        trainer.step(*batch)
    finally:
        trainer._programs[key] = prog
    return jax.jit(prog.fn, **prog.jit_kwargs).lower(*calls[0]).compile()


def _optimized_program(trainer, batch):
    """(the trainer's one Program, its optimized HLO text) for one more ``step(*batch)``."""
    (_key, prog), = trainer._programs.items()
    return prog, _compiled_program(trainer, batch).as_text()


@pytest.mark.skipif(devices.platform() != "cpu", reason="XLA:CPU's temporary block")
def test_trainer_saved_values_as_outputs_shrink_the_temporary_block():
    """``_saved_out``: the values the backward reads from the forward are returned as extra
    outputs of the one program (each its own output buffer) rather than placed in the one
    temporary block XLA:CPU allocates per run; the block is smaller, and the results are those
    of the default program (same losses, weights and optimizer state)."""
    def run(saved_out):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256),
                              nn.Linear(256, 8)).to(TPU)
        opt = opts.AdamW(model.parameters(), lr=1e-2)
        trainer = opts.SingleTraceTrainer(model, lambda m, x, y: F.cross_entropy(m(x), y), opt)
        trainer._saved_out = saved_out
        x = torch.randn(64, 32, device=TPU)
        y = torch.randint(0, 8, (64,), device=TPU)
        losses = [trainer.step(x, y).item() for _ in range(3)]
        temp = _compiled_program(trainer, (x, y)).memory_analysis().temp_size_in_bytes
        state = [t.cpu() for s in opt.state.values() for t in s.values()]
        return losses, [p.detach().cpu() for p in model.parameters()], state, temp

    base, ours = run(False), run(True)
    assert ours[3] < base[3], (ours[3], base[3])
    assert ours[0] == base[0]
    for a, b in zip(ours[1] + ours[2], base[1] + base[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("saved_out", [False, True])
def test_trainer_program_updates_weights_without_copying_them(saved_out):
    """The backward reads each weight (``dx = dy @ W``) in ops that the weight's update does
    not depend on; the program still writes every donated weight in place, with no copy of it
    (XLA's copy insertion copied such parameters when nothing ordered those reads first).
    With the saved values returned as outputs (``SAVED_AS_OUTPUTS``, the default on XLA:CPU)
    XLA recomputes a saved ``mm + bias`` in the output's own fusion, which no update waits
    for, and copies that bias (the documented price): still no copy of a weight matrix."""
    import re

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 64)).to(TPU)
    opt = opts.AdamW(model.parameters(), lr=1e-3)
    trainer = opts.SingleTraceTrainer(model, lambda m, x: m(x).pow(2).mean(), opt)
    trainer._saved_out = saved_out
    x = torch.randn(8, 64, device=TPU)
    trainer.step(x)
    prog, text = _optimized_program(trainer, (x,))
    assert prog.jit_kwargs["donate_argnums"], "nothing donated"
    weights = {f"f32[{','.join(map(str, p.shape))}]" for p in model.parameters()
               if p.dim() > (1 if saved_out else 0)}
    copied = re.findall(r"= (f32\[[0-9,]*\])\{[0-9,]*\} copy\(", text)
    assert not [c for c in copied if c in weights], copied


def test_trainer_refuses_a_torch_optim_optimizer():
    model = nn.Linear(2, 2).to(TPU)
    with pytest.raises(TypeError, match="torch.tpu.optimizers"):
        opts.SingleTraceTrainer(model, lambda m, x: m(x).sum(),
                                torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("mode", ["fused", "compiled"])
def test_optimizer_in_fused_mode_and_compiled_steps(mode):
    """In Fused mode the step reads the pending gradients (a cut) and stays one program; in a
    torch.compile'd training step it is torch.optim's step, traced into the graph."""
    torch.tpu.reset_metrics()
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    tpu = copy.deepcopy(cpu).to(TPU)
    oc = torch.optim.AdamW(cpu.parameters(), lr=1e-2, weight_decay=0.1)
    ot = opts.AdamW(tpu.parameters(), lr=1e-2, weight_decay=0.1)

    def step(model, opt, x):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    tstep = step
    if mode == "compiled":
        torch._dynamo.reset()
        tstep = torch.compile(step, backend="tpu")
    g = torch.Generator().manual_seed(1)
    eager = torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch.tpu.EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode(eager):
        for _ in range(3):
            x = torch.randn(5, 8, generator=g)
            step(cpu, oc, x)
            tstep(tpu, ot, x.to(TPU))
    assert_params_close(cpu, tpu)
    if mode == "fused":
        assert counter("optim_programs") == 3 and counter("optim_fallbacks") == 0
    else:
        assert torch.tpu.metrics()["per_op"]["optim_fallbacks"].get("compiling", 0) > 0


def test_trainer_random_ops_draw_fresh_values_each_step():
    """Dropout inside the traced step: a new mask each step (the generator's words are a
    program argument), from torch.manual_seed's stream."""
    def losses():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).to(TPU)
        trainer = opts.SingleTraceTrainer(model, lambda m, x: m(x).abs().sum(),
                                          opts.SGD(model.parameters(), lr=0.0))
        x = torch.ones(4, 64, device=TPU)
        return [trainer.step(x).item() for _ in range(3)]

    first = losses()
    assert len(set(first)) == 3, first
    assert losses() == first


def test_trainer_batch_views():
    """Batches that are views (a window of a token stream, a transposed block) are read as
    the views, not as their storages."""
    torch.manual_seed(0)
    cpu, tpu = pair(lambda: nn.Linear(6, 3))
    oc = torch.optim.SGD(cpu.parameters(), lr=0.1)
    trainer = opts.SingleTraceTrainer(tpu, lambda m, x, y: F.mse_loss(m(x), y),
                                      opts.SGD(tpu.parameters(), lr=0.1))
    data, target = torch.randn(10, 8), torch.randn(3, 5)
    x, y = data[2:7, 1:7], target.t()  # (5, 6) window, (5, 3) transposed
    lt = trainer.step(data.to(TPU)[2:7, 1:7], target.to(TPU).t())
    oc.zero_grad()
    lc = F.mse_loss(cpu(x), y)
    lc.backward()
    oc.step()
    torch.testing.assert_close(lt.cpu(), lc.detach())
    assert_params_close(cpu, tpu)


def _clip_trainer_case(build, batches, loss_fn, kw, max_norm, norm_type):
    """The trainer with write_grads and max_grad_norm against torch.optim on CPU with
    loss.backward(); clip_grad_norm_(model.parameters(), ...); step(): losses, p.grad (the
    clipped gradients), the total norms, parameters and state, step for step."""
    cpu, tpu = pair(build)
    oc = torch.optim.AdamW(cpu.parameters(), **kw)
    ot = opts.AdamW(tpu.parameters(), **kw)
    trainer = opts.SingleTraceTrainer(tpu, loss_fn, ot, write_grads=True,
                                      max_grad_norm=max_norm, norm_type=norm_type)
    clipped = 0
    for i, (x, y) in enumerate(batches):
        oc.zero_grad()
        loss = loss_fn(cpu, x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(cpu.parameters(), max_norm, norm_type)
        clipped += bool(norm > max_norm)
        oc.step()
        torch.tpu.synchronize()
        before, programs = eager_ops(), counter("trainer_programs")
        lt = trainer.step(x.to(TPU), y.to(TPU))
        if i > 0:  # still one program per step, nothing else on the device
            assert eager_ops() == before and counter("trainer_programs") == programs + 1
        torch.testing.assert_close(lt.cpu(), loss.detach(), msg=lambda m: f"step {i} loss: {m}")
        torch.testing.assert_close(trainer.grad_norm.cpu(), norm, msg=lambda m: f"step {i}: {m}")
        for (n, pc), pt in zip(cpu.named_parameters(), tpu.parameters()):
            assert pt.grad is not None and pt.grad.device.type == "tpu", n
            torch.testing.assert_close(pt.grad.cpu(), pc.grad,
                                       msg=lambda m: f"step {i} grad {n}: {m}")
        assert_params_close(cpu, tpu)
    assert_states_close(oc, ot)
    return clipped


def test_trainer_writes_grads_and_clips_like_torch():
    """GPT example, AdamW: clip_grad_norm_ inside the one program (2-norm; max_norm below
    the gradients' norm so every step clips) equal to torch.optim with clip_grad_norm_ on
    CPU step for step, p.grad written."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95))
    clipped = _clip_trainer_case(small_gpt, gpt_batches(), gpt_loss, kw, 0.5, 2.0)
    assert clipped > 0  # the clipping did something
    mlp = lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.Tanh(),  # noqa
                                nn.Linear(16, 10))
    # the inf-norm; a max_norm between the steps' norms, so some steps clip and some do not
    clipped = _clip_trainer_case(mlp, image_batches(3, size=8, batch=4), ce_loss,
                                 dict(lr=1e-2), 0.3, float("inf"))
    assert 0 < clipped < 3


def test_trainer_refuses_gradient_hooks():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)).to(TPU)
    trainer = opts.SingleTraceTrainer(model, lambda m, x: m(x).sum(),
                                      opts.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 4, device=TPU)
    h = model[0].weight.register_hook(lambda g: g * 2)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' has a gradient hook"):
        trainer.step(x)
    h.remove()
    h = model[1].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match=r"module '1' has a backward hook"):
        trainer.step(x)
    h.remove()
    trainer.step(x)  # without hooks it runs
    assert model[0].weight.grad is None  # write_grads off: p.grad untouched
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        opts.SingleTraceTrainer(model, lambda m, x: m(x).sum(),
                                opts.SGD(model.parameters(), lr=0.1), max_grad_norm=0)


# -------------------------------------------------- programs of a later process (compile cache)

_WARM_SCRIPT = r"""
import json, torch, torch.nn as nn
import torchtpu.optimizers as opts
torch.manual_seed(0)
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to("tpu")
m = mlp()
trainer = opts.SingleTraceTrainer(m, lambda m, x: m(x).pow(2).mean(), opts.AdamW(m.parameters(), lr=1e-2))
x = torch.randn(4, 8).to("tpu")
losses = [trainer.step(x).item() for _ in range(3)]
m2 = mlp()
o = opts.SGD(m2.parameters(), lr=0.1, momentum=0.9)
for _ in range(2):
    o.zero_grad()
    m2(x).pow(2).mean().backward()
    o.step()
c = torch.tpu.metrics()["counters"]
print(json.dumps({"losses": losses, "w": m2[0].weight.cpu().tolist(),
                  "c": {k: v for k, v in c.items() if k.startswith(("trainer_", "optim_"))}}))
"""


def test_a_later_process_loads_the_trainer_and_optimizer_programs(tmp_path):
    """The trainer's and the optimizers' programs (keyed by their lowered text) come back from
    the compile cache in a second process: nothing compiled, the same values."""
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _WARM_SCRIPT], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["c"].get("trainer_xla_compiles", 0) >= 1
    assert first["c"].get("optim_xla_compiles", 0) >= 1
    assert second["c"].get("trainer_xla_compiles", 0) == 0, second["c"]
    assert second["c"].get("optim_xla_compiles", 0) == 0, second["c"]
    assert second["c"].get("trainer_disk_cache_hits", 0) >= 1
    assert second["c"].get("optim_disk_cache_hits", 0) >= 1
    assert second["losses"] == first["losses"] and second["w"] == first["w"]


def test_programs_keyed_by_text_never_share_an_executable(tmp_path, monkeypatch):
    """Two BY_TEXT programs of one signature but different bodies get their own executables
    (the key is the lowered text, not the signature); a third with the first one's body loads
    the first one's from the disk cache."""
    import jax.numpy as jnp

    from torchtpu.runtime import program_cache as pc
    from torchtpu.runtime.metrics import COUNTERS

    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    x = jnp.arange(4.0)
    assert pc.Program("optim", lambda v: v * 3, pc.BY_TEXT)(x).tolist() == [0.0, 3.0, 6.0, 9.0]
    assert pc.Program("optim", lambda v: v * 4, pc.BY_TEXT)(x).tolist() == [0.0, 4.0, 8.0, 12.0]
    hits = COUNTERS.get("optim_disk_cache_hits", 0)
    assert pc.Program("optim", lambda v: v * 3, pc.BY_TEXT)(x).tolist() == [0.0, 3.0, 6.0, 9.0]
    assert COUNTERS.get("optim_disk_cache_hits", 0) == hits + 1


def test_trainer_partitioned_joint_graph_is_bit_equal_to_the_joint_graph(monkeypatch):
    """The joint graph partitioned as AOTAutograd does (GELU's forward recomputed in the
    backward, optimizers/partition.py) and stitched back into one program computes exactly what
    the unpartitioned joint graph does: the same gradients, weights, running statistics and
    dropout masks, step after step (a causal mask built per layer, which the partitioner's CSE
    builds once)."""
    from torchtpu.optimizers import trainer as trainer_mod

    def run(partition):
        monkeypatch.setattr(trainer_mod, "PARTITION", partition)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(),
                              nn.Dropout(0.25), nn.Linear(32, 4)).to(TPU)

        def loss_fn(m, x, y):
            h = m(x)
            for _ in range(2):  # causal attention over the batch's rows
                a = h @ h.T
                mask = torch.ones(8, 8, dtype=torch.bool, device=TPU).tril()
                h = a.masked_fill(~mask, float("-inf")).softmax(-1) @ h
            return F.mse_loss(h, y)

        before = counter("trainer_partitions")
        trainer = opts.SingleTraceTrainer(model, loss_fn,
                                          opts.AdamW(model.parameters(), lr=1e-2),
                                          write_grads=True)
        x, y = torch.randn(8, 16, device=TPU), torch.randn(8, 4, device=TPU)
        losses = [trainer.step(x, y).item() for _ in range(3)]
        low = next(iter(trainer._traced.values())).low
        n_tril = sum(n.target is torch.ops.aten.tril.default for n in low.gm.graph.nodes)
        return (losses, [p.grad.cpu() for p in model.parameters()],
                [t.detach().cpu() for t in model.state_dict().values()],
                counter("trainer_partitions") - before, n_tril)

    joint, parted = run(False), run(True)
    assert parted[0] == joint[0]
    for a, b in zip(parted[1] + parted[2], joint[1] + joint[2]):
        assert torch.equal(a, b)
    assert (parted[3], parted[4]) == (1, 1) and (joint[3], joint[4]) == (0, 2)


def _transposed_lhs_batch_dots(trainer, batch) -> int:
    """Top-level batched dots of the trainer's optimized program whose left operand is read
    transposed (contracted over a dimension that is not its last)."""
    import re

    _prog, text = _optimized_program(trainer, batch)
    entry = text[text.index("\nENTRY"):]
    return len(re.findall(r"= f32\[\d+,\d+,\d+\]\{[0-9,]*\} dot\([^)]*\), lhs_batch_dims=\{0\}, "
                          r"lhs_contracting_dims=\{1\}", entry))


def _attention_sgd_trainer():
    """A Linear producing q, k, v and an attention loss over them, with SGD (seeded): the
    saved transposes (``q^T``, ``k^T``, ``p^T``) the trainer tests below look at. SGD: the key
    bias's gradient is 0 up to rounding (softmax ignores a shift shared by all keys), which
    Adam's normalisation would blow up to a full step of either sign."""
    torch.manual_seed(0)
    model = nn.Linear(32, 96).to(TPU)

    def loss_fn(m, x):
        q, k, v = m(x).view(2, 16, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        return a.pow(2).mean()

    return model, opts.SingleTraceTrainer(model, loss_fn, opts.SGD(model.parameters(), lr=0.1))


@pytest.mark.skipif(devices.platform() != "cpu", reason="XLA:CPU's dot emitters")
def test_trainer_backward_reads_saved_transposes_row_major():
    """A transposed activation the backward reads (attention's ``q`` in ``dk^T = q^T @ ds``) is
    computed in its own shape, as torch.compile's forward program returns it, so the backward's
    batched matmul reads it row-major rather than with the transpose folded into the dot; same
    losses and weights as with the transpose folded (within float32 rounding: another dot
    kernel)."""
    def run(materialize):
        model, trainer = _attention_sgd_trainer()
        trainer._materialize = materialize
        x = torch.randn(2, 16, 32, device=TPU)
        losses = [trainer.step(x).item() for _ in range(2)]
        return losses, [p.detach().cpu() for p in model.parameters()], \
            _transposed_lhs_batch_dots(trainer, (x,))

    folded, ours = run(False), run(True)
    assert ours[2] < folded[2], (ours[2], folded[2])
    assert ours[0] == pytest.approx(folded[0], rel=1e-5)
    for a, b in zip(ours[1], folded[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(devices.platform() != "cpu", reason="XLA:CPU's temporary block")
def test_trainer_returns_a_saved_transpose_as_the_value_it_transposes():
    """With the saved values returned as outputs, a saved transpose of an activation
    (attention's ``q^T`` and ``k^T``, read by the backward's batched matmuls) is returned as
    the value it transposes (``SAVED_ROOTS``): the backward's dot reads that value
    with the transpose folded in, so the output is the buffer the backward reads, where the
    transpose as an output was a second array (a transpose and a copy written out, the value
    kept in the temporary block). Smaller block, no transpose among the returned values,
    results identical."""
    from torchtpu.optimizers import partition as _partition

    def run(roots):
        model, trainer = _attention_sgd_trainer()
        trainer._saved_out = True
        trainer._capture_roots = roots
        x = torch.randn(2, 16, 32, device=TPU)
        losses = [trainer.step(x).item() for _ in range(2)]
        (traced,) = trainer._traced.values()
        nodes = traced.capture_nodes
        temp = _compiled_program(trainer, (x,)).memory_analysis().temp_size_in_bytes
        return losses, [p.detach().cpu() for p in model.parameters()], nodes, temp

    views, ours = run(False), run(True)
    assert any(n.target in _partition._TRANSPOSES for n in views[2])
    assert not any(n.target in _partition._TRANSPOSES for n in ours[2]), ours[2]
    assert ours[3] < views[3], (ours[3], views[3])
    assert ours[0] == views[0]
    for a, b in zip(ours[1], views[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(devices.platform() != "cpu", reason="XLA:CPU's temporary block")
def test_trainer_returns_a_saved_linear_output_as_its_product():
    """With the saved values returned as outputs, a saved float32 Linear output (``addmm``,
    read by the GELU backward) is computed as ``mm + bias`` and the ``mm`` returned
    (``SAVED_ROOTS``): XLA adds the bias inside each reader's fusion, so the backward reads
    the product, which is then the output buffer instead of a value kept in the temporary
    block beside a written-out sum. Smaller block, results identical to the sum returned."""
    def run(roots):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 8)).to(TPU)
        opt = opts.AdamW(model.parameters(), lr=1e-2)
        trainer = opts.SingleTraceTrainer(model, lambda m, x, y: F.cross_entropy(m(x), y), opt)
        trainer._saved_out = True
        trainer._capture_roots = roots
        x = torch.randn(64, 32, device=TPU)
        y = torch.randint(0, 8, (64,), device=TPU)
        losses = [trainer.step(x, y).item() for _ in range(3)]
        (traced,) = trainer._traced.values()
        targets = {n.target for n in traced.capture_nodes}
        temp = _compiled_program(trainer, (x, y)).memory_analysis().temp_size_in_bytes
        state = [t.cpu() for s in opt.state.values() for t in s.values()]
        return losses, [p.detach().cpu() for p in model.parameters()], state, targets, temp

    sums, ours = run(False), run(True)
    assert torch.ops.aten.addmm.default in sums[3]
    assert torch.ops.aten.addmm.default not in ours[3]
    assert torch.ops.aten.mm.default in ours[3]
    assert ours[4] < sums[4], (ours[4], sums[4])
    assert ours[0] == sums[0]
    for a, b in zip(ours[1] + ours[2], sums[1] + sums[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(devices.platform() != "cpu", reason="XLA:CPU's temporary block")
@pytest.mark.parametrize("clip", [None, 1.0])
def test_trainer_returns_gradients_and_loss_backward_values(clip):
    """With the saved values returned as outputs, the gradients and the loss's backward values
    on the logits (``nll_loss_backward``, ``_log_softmax_backward_data``) are returned too
    (``SAVED_BACKWARD``): every update waits for every gradient (``_after_all``), so all the
    gradients were live together in the temporary block, and the one-hot of the targets, which
    reads no activation, was computed at the top of the program and kept across the forward.
    Smaller block; results identical to the forward's saved values alone (with clipping too)."""
    def run(backward):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256),
                              nn.Linear(256, 512)).to(TPU)
        opt = opts.AdamW(model.parameters(), lr=1e-2)
        trainer = opts.SingleTraceTrainer(model, lambda m, x, y: F.cross_entropy(m(x), y), opt,
                                          max_grad_norm=clip)
        trainer._saved_out = True
        trainer._capture_backward = backward
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 32, generator=g).to(TPU)
        y = torch.randint(0, 512, (256,), generator=g).to(TPU)
        losses = [trainer.step(x, y).item() for _ in range(3)]
        (traced,) = trainer._traced.values()
        targets = {n.target for n in traced.capture_nodes}
        temp = _compiled_program(trainer, (x, y)).memory_analysis().temp_size_in_bytes
        state = [t.cpu() for s in opt.state.values() for t in s.values()]
        norm = None if clip is None else trainer.grad_norm.item()
        return (losses, [p.detach().cpu() for p in model.parameters()], state, targets, temp,
                norm)

    fwd, ours = run(False), run(True)
    for t in (torch.ops.aten.nll_loss_backward.default,
              torch.ops.aten._log_softmax_backward_data.default):
        assert t in ours[3] and t not in fwd[3]
    assert ours[4] < fwd[4], (ours[4], fwd[4])
    assert ours[0] == fwd[0] and ours[5] == fwd[5]
    for a, b in zip(ours[1] + ours[2], fwd[1] + fwd[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
