"""Training on device "tpu" matches PyTorch on CPU, step by step.

Each test builds the model on CPU with a fixed seed, copies it (deepcopy or load_state_dict)
and moves the copy to "tpu", then runs the same steps with the same data on both and compares
losses (and parameters) with ``torch.testing.assert_close`` at its float32 defaults.
Covered: MLP, small CNN, small GPT (the example script's model); SGD with momentum, Adam and
AdamW on their foreach and single-tensor paths; clip_grad_norm_; state_dict / load_state_dict
(modules, optimizers, torch.save/torch.load); a DataLoader with pin_memory=True.
"""
from __future__ import annotations

import copy
import importlib.util
import io
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

TPU = torch.device("tpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


train_gpt = _load_example()


# ----------------------------------------------------------------------------- models

def mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8 * 2 * 2, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)  # 8x8 -> 4x4
        x = F.relu(self.conv2(F.pad(x, (1, 1, 1, 1))))  # pad to 6x6, stride 2 -> 2x2
        return self.fc(torch.flatten(x, 1))


def small_gpt():
    return train_gpt.GPT(vocab_size=20, seq_len=16, n_layer=2, n_head=2, n_embd=32)


# ----------------------------------------------------------------------------- helpers

def make_pair(build, seed=0):
    """(cpu_model, tpu_model) with identical weights: built on CPU, deep-copied, moved."""
    torch.manual_seed(seed)
    cpu_model = build()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    return cpu_model, tpu_model


from helpers import classification_batches, token_batches  # noqa: E402


def ce_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def gpt_loss(model, x, y):
    return model(x, y)[1]


def train_steps(model, opt, batches, device, loss_fn, clip=None):
    """Run the steps; return the losses (as CPU tensors) and the grad norms if clipping."""
    losses, norms = [], []
    model.train()
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).detach().cpu())
        opt.step()
        losses.append(loss.detach().cpu())
    return torch.stack(losses), norms


def assert_params_close(cpu_model, tpu_model):
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        assert pt.device.type == "tpu", n
        torch.testing.assert_close(pt.detach().cpu(), pc.detach(), msg=lambda m: f"{n}: {m}")
    for (n, bc), (_, bt) in zip(cpu_model.named_buffers(), tpu_model.named_buffers()):
        torch.testing.assert_close(bt.cpu(), bc, msg=lambda m: f"buffer {n}: {m}")


def compare_training(build, make_opt, batches, loss_fn, clip=None, seed=0):
    cpu_model, tpu_model = make_pair(build, seed)
    cpu_losses, cpu_norms = train_steps(cpu_model, make_opt(cpu_model), batches, "cpu", loss_fn,
                                        clip)
    tpu_losses, tpu_norms = train_steps(tpu_model, make_opt(tpu_model), batches, TPU, loss_fn,
                                        clip)
    torch.testing.assert_close(tpu_losses, cpu_losses)
    for a, b in zip(tpu_norms, cpu_norms):
        torch.testing.assert_close(a, b)
    assert_params_close(cpu_model, tpu_model)
    return cpu_losses, tpu_losses


FOREACH = [pytest.param(True, id="foreach"), pytest.param(False, id="single_tensor")]


# ----------------------------------------------------------------------------- optimizers

@pytest.mark.parametrize("foreach", FOREACH)
def test_mlp_sgd_momentum(foreach):
    batches = classification_batches(4, 8, (12,), 5)
    compare_training(mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                                    nesterov=True, weight_decay=1e-4,
                                                    foreach=foreach),
                     batches, ce_loss)


@pytest.mark.parametrize("foreach", FOREACH)
def test_mlp_adam(foreach):
    batches = classification_batches(4, 8, (12,), 5)
    compare_training(mlp, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=foreach),
                     batches, ce_loss)


@pytest.mark.parametrize("foreach", FOREACH)
def test_mlp_adamw_with_grad_clipping(foreach):
    batches = classification_batches(4, 8, (12,), 5)
    cpu_losses, _ = compare_training(
        mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                                         foreach=foreach),
        batches, ce_loss, clip=0.5)
    assert torch.isfinite(cpu_losses).all()


@pytest.mark.parametrize("foreach", FOREACH)
def test_clip_grad_norm(foreach):
    cpu_model, tpu_model = make_pair(mlp)
    (x, y), = classification_batches(1, 8, (12,), 5)
    grads = {}
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        ce_loss(model, x.to(dev), y.to(dev)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=foreach)
        inf_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3, norm_type="inf",
                                                  foreach=foreach)
        grads[dev if dev == "cpu" else "tpu"] = (norm, inf_norm,
                                                 [p.grad for p in model.parameters()])
    (nc, ic, gc), (nt, it, gt) = grads["cpu"], grads["tpu"]
    assert nt.device.type == "tpu"
    torch.testing.assert_close(nt.cpu(), nc)
    torch.testing.assert_close(it.cpu(), ic)
    for a, b in zip(gt, gc):
        torch.testing.assert_close(a.cpu(), b)


# ----------------------------------------------------------------------------- models

def test_cnn_sgd():
    batches = classification_batches(3, 4, (3, 8, 8), 4, seed=3)
    compare_training(SmallCNN, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                     batches, ce_loss)


def test_cnn_eval_mode_uses_running_stats():
    cpu_model, tpu_model = make_pair(SmallCNN)
    (x, _), = classification_batches(1, 4, (3, 8, 8), 4, seed=4)
    for m in (cpu_model, tpu_model):
        m.train()
    cpu_model(x), tpu_model(x.to(TPU))  # updates BatchNorm running stats
    cpu_model.eval(), tpu_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(tpu_model(x.to(TPU)).cpu(), cpu_model(x))
    assert_params_close(cpu_model, tpu_model)


def test_gpt_adamw():
    batches = token_batches(3, 4, 16, 20)
    make_opt = lambda m: train_gpt.make_optimizer(m, lr=3e-3, weight_decay=0.1, foreach=None)
    compare_training(small_gpt, make_opt, batches, gpt_loss, clip=1.0)


def test_train_gpt_example_matches_cpu():
    """The example script itself, on a tiny config: same losses on tpu and cpu; loss falls."""
    common = ["--steps", "8", "--layers", "1", "--heads", "2", "--embd", "32", "--seq-len", "16",
              "--batch-size", "4", "--log-every", "1", "--eval-batches", "1", "--quiet",
              "--warmup", "2", "--lr", "1e-2"]
    cpu = train_gpt.main(common + ["--device", "cpu"])
    tpu = train_gpt.main(common + ["--device", "tpu"])
    torch.testing.assert_close(torch.tensor(tpu["losses"]), torch.tensor(cpu["losses"]))
    torch.testing.assert_close(torch.tensor(tpu["val_loss"]), torch.tensor(cpu["val_loss"]))
    assert tpu["losses"][-1] < tpu["losses"][0]
    # the programs ran on tpu: built here, or read back from a warm compile cache folder
    m = tpu["metrics"]
    assert m.get("eager_compiles", 0) + m.get("eager_disk_cache_hits", 0) > 0, m


def test_optimizer_built_before_move_to_tpu():
    """Common in scripts: build model and optimizer, then ``model.to(device)``. The optimizer
    must train the moved parameters (module.to converts Parameter objects in place)."""
    batches = classification_batches(3, 8, (12,), 5, seed=9)
    torch.manual_seed(0)
    cpu_model = mlp()
    tpu_model = copy.deepcopy(cpu_model)
    opt_c = torch.optim.Adam(cpu_model.parameters(), lr=1e-2)
    opt_t = torch.optim.Adam(tpu_model.parameters(), lr=1e-2)
    tpu_model.to(TPU)
    cpu_losses, _ = train_steps(cpu_model, opt_c, batches, "cpu", ce_loss)
    tpu_losses, _ = train_steps(tpu_model, opt_t, batches, TPU, ce_loss)
    torch.testing.assert_close(tpu_losses, cpu_losses)
    assert_params_close(cpu_model, tpu_model)


# ----------------------------------------------------------------------------- state dicts

def test_module_state_dict_round_trip():
    torch.manual_seed(0)
    cpu_model = SmallCNN()
    tpu_model = SmallCNN().to(TPU)
    tpu_model.load_state_dict(cpu_model.state_dict())  # CPU tensors into tpu parameters
    assert all(p.device.type == "tpu" for p in tpu_model.parameters())
    assert_params_close(cpu_model, tpu_model)
    sd = tpu_model.state_dict()
    assert all(v.device.type == "tpu" for v in sd.values())
    fresh = SmallCNN()
    fresh.load_state_dict(sd)  # tpu tensors into CPU parameters
    assert_params_close(fresh, tpu_model)


def test_torch_save_and_load():
    cpu_model, tpu_model = make_pair(mlp)
    buf = io.BytesIO()
    torch.save(tpu_model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(v.device.type == "tpu" for v in loaded.values())
    for k, v in cpu_model.state_dict().items():
        torch.testing.assert_close(loaded[k].cpu(), v)
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    for k, v in cpu_model.state_dict().items():
        assert on_cpu[k].device.type == "cpu"
        torch.testing.assert_close(on_cpu[k], v)


@pytest.mark.parametrize("foreach", FOREACH)
def test_optimizer_state_dict_resume(foreach):
    """Train 2 steps, checkpoint model+optimizer, resume in fresh objects: same as no break."""
    batches = classification_batches(4, 8, (12,), 5, seed=5)
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=foreach)

    cpu_model, tpu_model = make_pair(mlp)
    ref_losses, _ = train_steps(cpu_model, make_opt(cpu_model), batches, "cpu", ce_loss)

    opt = make_opt(tpu_model)
    first, _ = train_steps(tpu_model, opt, batches[:2], TPU, ce_loss)
    model_sd, opt_sd = tpu_model.state_dict(), opt.state_dict()
    assert opt_sd["state"][0]["exp_avg"].device.type == "tpu"

    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    resumed = mlp().to(TPU)
    resumed.load_state_dict(model_sd)
    opt2 = make_opt(resumed)
    opt2.load_state_dict(opt_sd)
    assert opt2.state_dict()["state"][0]["exp_avg"].device.type == "tpu"
    second, _ = train_steps(resumed, opt2, batches[2:], TPU, ce_loss)
    torch.testing.assert_close(torch.cat([first, second]), ref_losses)
    assert_params_close(cpu_model, resumed)


# ----------------------------------------------------------------------------- data loading

def test_dataloader_pin_memory():
    g = torch.Generator().manual_seed(6)
    xs, ys = torch.randn(24, 12, generator=g), torch.randint(0, 5, (24,), generator=g)
    ds = torch.utils.data.TensorDataset(xs, ys)
    make_loader = lambda: torch.utils.data.DataLoader(
        ds, batch_size=8, shuffle=True, pin_memory=True,
        generator=torch.Generator().manual_seed(7))
    batches = list(make_loader())
    assert len(batches) == 3
    assert all(x.device.type == "cpu" for x, _ in batches)
    cpu_model, tpu_model = make_pair(mlp)
    opt_c = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    opt_t = torch.optim.SGD(tpu_model.parameters(), lr=0.1)
    cpu_losses, _ = train_steps(cpu_model, opt_c, batches, "cpu", ce_loss)
    tpu_losses = []
    for x, y in make_loader():
        x, y = x.to(TPU, non_blocking=True), y.to(TPU, non_blocking=True)
        opt_t.zero_grad()
        loss = ce_loss(tpu_model, x, y)
        loss.backward()
        opt_t.step()
        tpu_losses.append(loss.detach().cpu())
    torch.testing.assert_close(torch.stack(tpu_losses), cpu_losses)
    assert_params_close(cpu_model, tpu_model)


def test_zero_grad_and_accumulation():
    cpu_model, tpu_model = make_pair(mlp)
    batches = classification_batches(2, 4, (12,), 5, seed=8)
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        for x, y in batches:  # two backward passes accumulate into .grad
            ce_loss(model, x.to(dev), y.to(dev)).backward()
    for pc, pt in zip(cpu_model.parameters(), tpu_model.parameters()):
        torch.testing.assert_close(pt.grad.cpu(), pc.grad)
    opt = torch.optim.SGD(tpu_model.parameters(), lr=0.1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and p.grad.abs().sum().item() == 0
               for p in tpu_model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in tpu_model.parameters())


# ----------------------------------------------------------------------------- AMP, checkpoint

def _amp_run(device, mode=torch.tpu.EagerMode.DEFER_NEVER, names="amp"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if names == "tpu.amp":  # torch.cuda.amp-style names
        scaler = torch.tpu.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=2)
        autocast = torch.tpu.amp.autocast
    else:
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
        autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
    g = torch.Generator().manual_seed(1)
    trace = []
    with torch.tpu.set_eager_mode(mode):
        for i in range(7):
            x = torch.randn(5, 8, generator=g)
            if i == 3:
                x[0, 0] = float("inf")  # an overflowing step: skipped, the scale backs off
            with autocast():
                loss = model(x.to(device)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            trace.append((scaler.get_scale(), int(scaler._growth_tracker.item())))
    return trace, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["strict", "fused", "tpu.amp"])
def test_grad_scaler_matches_cpu_without_fallback(mode):
    torch.tpu.reset_metrics()
    want, want_params = _amp_run("cpu")
    got, got_params = _amp_run(
        "tpu", torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch.tpu.EagerMode.DEFER_NEVER,
        names="tpu.amp" if mode == "tpu.amp" else "amp")
    assert got == want  # (scale, growth tracker) after every step, the inf step included
    assert (1024.0, 0) in got
    for a, b in zip(got_params, want_params):
        torch.testing.assert_close(a, b)
    assert not torch.tpu.metrics()["per_op"].get("cpu_fallbacks")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_the_same_dropout_mask(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    x = torch.randn(4, 16, device="tpu", requires_grad=True)
    y = checkpoint(lambda t: F.dropout(t, 0.5, training=True), x, use_reentrant=use_reentrant)
    y.sum().backward()
    # the gradient of sum(dropout(x)) is the forward's mask times 2: only if the recompute drew it
    torch.testing.assert_close(x.grad.cpu(), (y != 0).float().cpu() * 2)


def test_transformer_encoder_inference_with_padding_mask():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).eval()
    x = torch.randn(3, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=pad)
        got = copy.deepcopy(enc).to("tpu")(x.to("tpu"), src_key_padding_mask=pad.to("tpu")).cpu()
    # CPU packs the batch into a nested tensor and returns zeros at padded positions; tpu has
    # no nested tensors and takes the padded path: the positions that are not padding agree
    keep = ~pad
    torch.testing.assert_close(got[keep], want[keep])


# ----------------------------------------------------------------------------- fused optimizers

FUSED_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    "adam_amsgrad_decay": (torch.optim.Adam, dict(lr=1e-2, fused=True, amsgrad=True, weight_decay=0.1)),
    "adamw_maximize_tensor_lr": (torch.optim.AdamW, dict(lr="tensor", fused=True, maximize=True)),
    "sgd_nesterov_decay": (torch.optim.SGD, dict(lr=0.05, fused=True, momentum=0.9, nesterov=True,
                                                 weight_decay=0.01)),
    "sgd_dampening_maximize": (torch.optim.SGD, dict(lr=0.05, fused=True, momentum=0.5,
                                                     dampening=0.1, maximize=True)),
    "sgd_plain": (torch.optim.SGD, dict(lr=0.05, fused=True)),
    "adagrad_decay_maximize": (torch.optim.Adagrad, dict(lr=0.1, fused=True, lr_decay=0.01,
                                                         weight_decay=0.05, maximize=True)),
    "adagrad_tensor_lr": (torch.optim.Adagrad, dict(lr="tensor", fused=True)),
}


def _fused_run(device, name, mode="strict", scaler=False):
    cls, kw = FUSED_OPTIMIZERS[name]
    kw = dict(kw)
    if kw["lr"] == "tensor":
        kw["lr"] = torch.tensor(1e-2, device=device if mode == "compiled" else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = cls(model.parameters(), **kw)
    sc = torch.amp.GradScaler(device, init_scale=2.0 ** 8) if scaler else None

    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if sc is None:
            loss.backward()
            opt.step()
        else:
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()

    if mode == "compiled":
        torch._dynamo.reset()
        step = torch.compile(step, backend="tpu")
    g = torch.Generator().manual_seed(1)
    eager = torch.tpu.EagerMode.DEFER_AND_FUSE if mode == "fused" else torch.tpu.EagerMode.DEFER_NEVER
    with torch.tpu.set_eager_mode(eager):
        for i in range(4):
            x = torch.randn(5, 8, generator=g)
            if scaler and i == 2:
                x[0, 0] = float("inf")  # a skipped step: found_inf reaches the fused op
            step(x.to(device))
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("name", sorted(FUSED_OPTIMIZERS))
def test_fused_optimizers_match_cpu_on_the_device(name, mode):
    torch.tpu.reset_metrics()
    want = _fused_run("cpu", name)
    got = _fused_run("tpu", name, mode)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    per_op = torch.tpu.metrics()["per_op"]
    assert not per_op.get("cpu_fallbacks") and not per_op.get("compile_cpu_fallbacks")


@pytest.mark.parametrize("name", ["adamw", "sgd_nesterov_decay", "adagrad_decay_maximize"])
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_fused_optimizer_with_grad_scaler(mode, name):
    want = _fused_run("cpu", name, scaler=True)
    got = _fused_run("tpu", name, mode, scaler=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
