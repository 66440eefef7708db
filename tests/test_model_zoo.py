"""Classic PyTorch programs, written as their authors write them, on device "tpu" vs CPU.

Each test builds the model on CPU with a fixed seed, deep-copies it and moves the copy to "tpu",
runs the same few training steps on the same data on both, and compares losses and final
parameters (and buffers: BatchNorm running stats) with ``torch.testing.assert_close`` at its
float32 defaults. Nothing in the programs is torchtpu-specific but the device string.

Executors: every model runs in Strict eager (the default); a subset also runs in Fused eager
(``torch.tpu.set_eager_mode(DEFER_AND_FUSE)``) and compiled (``torch.compile(model,
backend="tpu")``), always compared against eager PyTorch on CPU.

Models: LSTM / GRU word-language model, nn.TransformerEncoder (padding + causal masks),
ResNet-style CNN (train/eval, running stats), VAE (randn_like: shapes, finiteness and
seed-independent parts), DCGAN generator (ConvTranspose2d + BatchNorm + Tanh), and the training
idioms around them: clip_grad_norm_, StepLR / OneCycleLR, autocast(bfloat16), gradient
accumulation, no_grad evaluation with argmax accuracy.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

TPU = torch.device("tpu")


# ----------------------------------------------------------------------------- executors

def _strict():
    return contextlib.nullcontext()


def _fused():
    return torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)


STRICT = pytest.param("strict", id="strict")
FUSED = pytest.param("fused", id="fused")
COMPILE = pytest.param("compile", id="compile")


def mode_ctx(mode):
    return _fused() if mode == "fused" else _strict()


def maybe_compile(model, mode):
    """The module to call: compiled for mode "compile" (parameters stay the model's)."""
    if mode == "compile":
        torch._dynamo.reset()
        return torch.compile(model, backend="tpu")
    return model


# ----------------------------------------------------------------------------- helpers

def make_pair(build, seed=0):
    """(cpu_model, tpu_model) with identical weights: built on CPU, deep-copied, moved."""
    torch.manual_seed(seed)
    cpu_model = build()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    return cpu_model, tpu_model


def assert_state_close(cpu_model, tpu_model, **tol):
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        assert pt.device.type == "tpu", n
        torch.testing.assert_close(pt.detach().cpu(), pc.detach(), msg=lambda m: f"{n}: {m}",
                                   **tol)
    for (n, bc), (_, bt) in zip(cpu_model.named_buffers(), tpu_model.named_buffers()):
        assert bt.device.type == "tpu", n
        torch.testing.assert_close(bt.cpu(), bc, msg=lambda m: f"buffer {n}: {m}", **tol)


def run_steps(model, opt, batches, device, loss_fn, mode="strict", clip=None, sched=None):
    """Train on the batches; returns (losses, grad norms) as CPU tensors."""
    fn = maybe_compile(model, mode)
    losses, norms = [], []
    model.train()
    with mode_ctx(mode if device != "cpu" else "strict"):
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(fn, x, y)
            loss.backward()
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                             .detach().cpu())
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(loss.detach().cpu())
    return torch.stack(losses), norms


def compare_training(build, make_opt, batches, loss_fn, mode="strict", clip=None,
                     make_sched=None, seed=0):
    cpu_model, tpu_model = make_pair(build, seed)
    results = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        opt = make_opt(model)
        sched = make_sched(opt) if make_sched else None
        results.append(run_steps(model, opt, batches, dev, loss_fn,
                                 mode if dev is TPU else "strict", clip, sched))
        if sched is not None:
            results[-1] += (sched.get_last_lr(),)
    (cl, cn, *clr), (tl, tn, *tlr) = results
    torch.testing.assert_close(tl, cl)
    for a, b in zip(tn, cn):
        torch.testing.assert_close(a, b)
    assert clr == tlr
    assert_state_close(cpu_model, tpu_model)
    return cpu_model, tpu_model, cl


from helpers import classification_batches, token_batches  # noqa: E402


def ce_loss(model, x, y):
    return F.cross_entropy(model(x), y)


# ----------------------------------------------------------------------------- word LM (RNN)

VOCAB = 24


class RNNModel(nn.Module):
    """pytorch/examples word_language_model, in miniature."""

    def __init__(self, rnn_type="LSTM", ntoken=VOCAB, ninp=16, nhid=16, nlayers=2, dropout=0.0):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers, self.rnn_type = nhid, nlayers, rnn_type

    def forward(self, input, hidden):
        emb = self.encoder(input)
        output, hidden = self.rnn(emb, hidden)
        return self.decoder(output).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def train_word_lm(model, device, batches, lr=0.5, clip=0.25):
    """The example's train loop: truncated BPTT, hidden carried and detached, manual SGD."""
    model.train()
    hidden = model.init_hidden(batches[0][0].shape[1])
    losses = []
    for data, targets in batches:
        data, targets = data.to(device), targets.to(device)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = F.cross_entropy(output, targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.detach().cpu())
    return torch.stack(losses), repackage_hidden(hidden)


def bptt_batches(n, seq, bsz, seed=5):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, VOCAB, (n * seq + 1, bsz), generator=g)
    return [(src[i:i + seq], src[i + 1:i + 1 + seq]) for i in range(0, n * seq, seq)]


@pytest.mark.parametrize("rnn_type", ["LSTM", "GRU"])
@pytest.mark.parametrize("mode", [STRICT, FUSED])
def test_word_language_model(rnn_type, mode):
    cpu_model, tpu_model = make_pair(lambda: RNNModel(rnn_type))
    batches = bptt_batches(3, 5, 4)
    cl, ch = train_word_lm(cpu_model, "cpu", batches)
    with mode_ctx(mode):
        tl, th = train_word_lm(tpu_model, TPU, batches)
    torch.testing.assert_close(tl, cl)
    for a, b in zip(th if isinstance(th, tuple) else (th,), ch if isinstance(ch, tuple) else (ch,)):
        assert a.device.type == "tpu"
        torch.testing.assert_close(a.cpu(), b)
    assert_state_close(cpu_model, tpu_model)
    # evaluation: no_grad, argmax next-token accuracy
    data, targets = batches[0]
    accs = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        model.eval()
        with torch.no_grad():
            out, _ = model(data.to(dev), model.init_hidden(data.shape[1]))
            accs.append((out.argmax(-1) == targets.reshape(-1).to(dev)).float().mean().item())
    assert accs[0] == accs[1]


# ----------------------------------------------------------------------------- Transformer

class TransformerLM(nn.Module):
    def __init__(self, ntoken=VOCAB, d_model=16, nhead=2, nlayers=2, seq_len=6):
        super().__init__()
        self.emb = nn.Embedding(ntoken, d_model, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=32, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, ntoken)

    def forward(self, src):
        pad = src == 0
        mask = nn.Transformer.generate_square_subsequent_mask(src.shape[1], device=src.device)
        h = self.encoder(self.emb(src) + self.pos[:, :src.shape[1]], mask=mask,
                         src_key_padding_mask=pad, is_causal=True)
        return self.head(h)


def padded_token_batches(n, batch, seq_len, seed=7):
    out = []
    for x, y in token_batches(n, batch, seq_len, VOCAB, seed):
        x = x.clone()
        x[0, -2:] = 0  # right padding on one row (never a fully padded row)
        out.append((x, y))
    return out


def lm_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("mode", [STRICT, FUSED, COMPILE])
def test_transformer_encoder(mode):
    # SGD, not Adam: the key projection's bias has an exactly-zero true gradient (softmax is
    # shift-invariant), so its computed gradient is rounding noise (~1e-9) that Adam's
    # normalisation would blow up to lr-sized, backend-dependent updates.
    batches = padded_token_batches(2, 3, 6)
    compare_training(TransformerLM, lambda m: torch.optim.SGD(m.parameters(), lr=0.1,
                                                              momentum=0.9),
                     batches, lm_loss, mode=mode, clip=1.0)


def test_transformer_encoder_fast_path_eval():
    """eval + no_grad takes nn.TransformerEncoderLayer's fused fast path when it can."""
    cpu_model, tpu_model = make_pair(TransformerLM)
    (x, _), = padded_token_batches(1, 3, 6, seed=8)
    outs = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        model.eval()
        with torch.no_grad():
            outs.append(model(x.to(dev)).cpu())
    torch.testing.assert_close(outs[1], outs[0])


# ----------------------------------------------------------------------------- ResNet CNN

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


@pytest.mark.parametrize("mode", [STRICT, FUSED, COMPILE])
def test_resnet_train_then_eval(mode):
    batches = classification_batches(2, 4, (3, 8, 8), 5, seed=3)
    cpu_model, tpu_model, _ = compare_training(
        ResNet, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                          weight_decay=5e-4),
        batches, ce_loss, mode=mode)
    # running stats moved (they were compared with the parameters); now evaluation
    assert not torch.equal(cpu_model.stem[1].running_mean, torch.zeros(8))
    assert cpu_model.stem[1].num_batches_tracked.item() == 2
    (x, y), = classification_batches(1, 6, (3, 8, 8), 5, seed=4)
    res = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        model.eval()
        fn = maybe_compile(model, mode)
        with torch.no_grad(), mode_ctx(mode if dev is TPU else "strict"):
            logits = fn(x.to(dev))
            correct = (logits.argmax(1) == y.to(dev)).sum()
            res.append((logits.cpu(), correct.item()))
    torch.testing.assert_close(res[1][0], res[0][0])
    assert res[1][1] == res[0][1]
    assert_state_close(cpu_model, tpu_model)  # eval leaves the running stats alone


# ----------------------------------------------------------------------------- VAE

class VAE(nn.Module):
    def __init__(self, d=20, h=16, z=4):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc21 = nn.Linear(h, z)
        self.fc22 = nn.Linear(h, z)
        self.fc3 = nn.Linear(z, h)
        self.fc4 = nn.Linear(h, d)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def vae_loss(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


@pytest.mark.parametrize("mode", [STRICT, FUSED])
def test_vae(mode):
    g = torch.Generator().manual_seed(9)
    data = torch.rand(16, 20, generator=g)
    cpu_model, tpu_model = make_pair(VAE)
    # seed-independent parts: the encoder and the decoder of a fixed z match CPU
    z = torch.randn(16, 4, generator=g)
    with torch.no_grad():
        for a, b in zip(tpu_model.encode(data.to(TPU)), cpu_model.encode(data)):
            torch.testing.assert_close(a.cpu(), b)
        torch.testing.assert_close(tpu_model.decode(z.to(TPU)).cpu(), cpu_model.decode(z))
    # training with randn_like: shapes, finiteness, loss going down
    opt = torch.optim.Adam(tpu_model.parameters(), lr=1e-2)
    losses = []
    x = data.to(TPU)
    torch.tpu.manual_seed(0)
    with mode_ctx(mode):
        for _ in range(12):
            opt.zero_grad()
            recon, mu, logvar = tpu_model(x)
            assert recon.shape == x.shape and mu.shape == logvar.shape == (16, 4)
            assert recon.device.type == "tpu"
            loss = vae_loss(recon, x, mu, logvar)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    losses = torch.tensor(losses)
    assert torch.isfinite(losses).all()
    assert losses[-3:].mean() < losses[:3].mean()
    for p in tpu_model.parameters():
        assert torch.isfinite(p.detach().cpu()).all()
    # the noise is standard normal and the generator state advances
    eps = torch.randn_like(torch.empty(4096, device=TPU)).cpu()
    assert abs(eps.mean().item()) < 0.1 and abs(eps.std().item() - 1) < 0.1


# ----------------------------------------------------------------------------- DCGAN

class Generator(nn.Module):
    def __init__(self, nz=8, ngf=4, nc=3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh())

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self, nc=3, ndf=4):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def weights_init(m):
    if "Conv" in type(m).__name__:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif "BatchNorm" in type(m).__name__:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


def dcgan_steps(netG, netD, device, noises, reals):
    crit = nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    out = []
    for noise, real in zip(noises, reals):
        noise, real = noise.to(device), real.to(device)
        netD.zero_grad()
        b = real.size(0)
        label = torch.full((b,), 1.0, dtype=real.dtype, device=device)
        errD_real = crit(netD(real), label)
        errD_real.backward()
        fake = netG(noise)
        label.fill_(0.0)
        errD_fake = crit(netD(fake.detach()), label)
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        label.fill_(1.0)
        errG = crit(netD(fake), label)
        errG.backward()
        optG.step()
        out.append(torch.stack([errD_real, errD_fake, errG]).detach().cpu())
    return torch.stack(out)


@pytest.mark.parametrize("mode", [STRICT, FUSED])
def test_dcgan(mode):
    def build():
        g, d = Generator(), Discriminator()
        g.apply(weights_init), d.apply(weights_init)
        return nn.ModuleList([g, d])

    cpu_pair, tpu_pair = make_pair(build)
    gen = torch.Generator().manual_seed(11)
    noises = [torch.randn(4, 8, 1, 1, generator=gen) for _ in range(2)]
    reals = [torch.rand(4, 3, 16, 16, generator=gen) * 2 - 1 for _ in range(2)]
    cl = dcgan_steps(cpu_pair[0], cpu_pair[1], "cpu", noises, reals)
    with mode_ctx(mode):
        tl = dcgan_steps(tpu_pair[0], tpu_pair[1], TPU, noises, reals)
    torch.testing.assert_close(tl, cl)
    assert_state_close(cpu_pair, tpu_pair)
    cpu_pair.eval(), tpu_pair.eval()
    with torch.no_grad():
        img = tpu_pair[0](noises[0].to(TPU))
        assert img.shape == (4, 3, 16, 16)
        torch.testing.assert_close(img.cpu(), cpu_pair[0](noises[0]))


# ----------------------------------------------------------------------------- idioms

def mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(),
                         nn.LayerNorm(32), nn.Linear(32, 5))


@pytest.mark.parametrize("mode", [STRICT, FUSED, COMPILE])
def test_step_lr_with_clipping(mode):
    batches = classification_batches(4, 8, (12,), 5, seed=12)
    compare_training(mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9),
                     batches, ce_loss, mode=mode, clip=0.5,
                     make_sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5))


@pytest.mark.parametrize("mode", [STRICT, FUSED])
def test_one_cycle_lr(mode):
    batches = classification_batches(4, 8, (12,), 5, seed=13)
    compare_training(mlp, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                     batches, ce_loss, mode=mode,
                     make_sched=lambda o: torch.optim.lr_scheduler.OneCycleLR(
                         o, max_lr=5e-2, total_steps=4))


@pytest.mark.parametrize("mode", [STRICT, FUSED])
def test_gradient_accumulation(mode):
    batches = classification_batches(6, 4, (12,), 5, seed=14)
    accum = 3
    cpu_model, tpu_model = make_pair(mlp)
    losses = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ls = []
        with mode_ctx(mode if dev is TPU else "strict"):
            opt.zero_grad()
            for i, (x, y) in enumerate(batches):
                loss = ce_loss(model, x.to(dev), y.to(dev)) / accum
                loss.backward()
                ls.append(loss.detach().cpu())
                if (i + 1) % accum == 0:
                    opt.step()
                    opt.zero_grad()
        losses.append(torch.stack(ls))
    torch.testing.assert_close(losses[1], losses[0])
    assert_state_close(cpu_model, tpu_model)


def test_autocast_bfloat16_dtypes_as_on_cuda():
    """autocast("tpu", bfloat16): matmul-like ops run in bf16, reductions/losses in fp32 (the
    CUDA autocast op lists), parameters and their grads stay fp32, training runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5)).to(TPU)
    conv = nn.Conv2d(3, 4, 3).to(TPU)
    x = torch.randn(8, 12, device=TPU)
    y = torch.randint(0, 5, (8,), device=TPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("tpu", dtype=torch.bfloat16):
            logits = model(x)
            assert logits.dtype == torch.bfloat16
            assert torch.mm(x, x.t()).dtype == torch.bfloat16
            assert conv(torch.randn(1, 3, 5, 5, device=TPU)).dtype == torch.bfloat16
            assert torch.softmax(logits, -1).dtype == torch.float32  # fp32 list on CUDA
            assert logits.float().sum().dtype == torch.float32
            loss = F.cross_entropy(logits, y)
            assert loss.dtype == torch.float32
            assert (x + 1).dtype == torch.float32  # not on a list: unchanged
        loss.backward()
        for p in model.parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    # the bf16 forward agrees with CPU autocast(bfloat16) to bf16 precision
    cpu_model = copy.deepcopy(model).to("cpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        t = model(x).float().cpu()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c = cpu_model(x.cpu()).float()
    torch.testing.assert_close(t, c, atol=2e-2, rtol=1.6e-2)  # bfloat16 defaults of assert_close


def test_no_grad_eval_accuracy():
    cpu_model, tpu_model = make_pair(mlp)
    (x, y), = classification_batches(1, 64, (12,), 5, seed=15)
    accs = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        model.eval()
        with torch.no_grad():
            logits = model(x.to(dev))
            assert not logits.requires_grad
            pred = logits.argmax(dim=1)
            correct = pred.eq(y.to(dev).view_as(pred)).sum().item()
            accs.append((correct, pred.cpu()))
    assert accs[0][0] == accs[1][0]
    torch.testing.assert_close(accs[1][1], accs[0][1])


@pytest.mark.parametrize("cell", ["LSTMCell", "GRUCell"])
def test_rnn_cells(cell):
    """Minimal reproduction of the word-LM failure: one nn.LSTMCell / nn.GRUCell step."""
    torch.manual_seed(0)
    cpu_cell = getattr(nn, cell)(3, 4)
    tpu_cell = copy.deepcopy(cpu_cell).to(TPU)
    x = torch.randn(2, 3)
    outs = []
    for m, dev in ((cpu_cell, "cpu"), (tpu_cell, TPU)):
        out = m(x.to(dev))
        out = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in out).backward()
        outs.append([o.detach().cpu() for o in out] + [m.weight_ih.grad.cpu()])
    for a, b in zip(outs[1], outs[0]):
        torch.testing.assert_close(a, b)


def test_move_to_cpu_with_live_autograd_graph():
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    model = copy.deepcopy(cpu_model).to(TPU)
    x = torch.randn(1, 3, 5, 5)
    out = model(x.to(TPU))  # not under no_grad: the graph holds the conv weight
    model.cpu()
    torch.testing.assert_close(model(x), cpu_model(x))
    assert out.requires_grad
