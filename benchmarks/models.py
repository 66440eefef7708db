"""The benchmark models, shared by every benchmark so they measure the same thing.

GPT: 6 layers, d_model 256, 4 heads, seq 128, vocab 4096, batch 8, float32, AdamW.
MLP: 4 layers, 1024 wide, batch 64, float32, AdamW.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class GPTConfig:
    n_layer: int = 6
    d_model: int = 256
    n_head: int = 4
    seq_len: int = 128
    vocab: int = 4096
    batch: int = 8
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.dropout = c.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def mlp(width: int = 1024, depth: int = 4, n_in: int = 1024, n_out: int = 10) -> nn.Module:
    layers, d = [], n_in
    for _ in range(depth - 1):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, n_out))
    return nn.Sequential(*layers)


class MLPLoss(nn.Module):
    def __init__(self, width=1024, depth=4):
        super().__init__()
        self.net = mlp(width, depth)

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def gpt_case(seed: int = 0, config: GPTConfig | None = None):
    """(model on CPU, (inputs on CPU)) for one GPT training step."""
    c = config or GPTConfig()
    torch.manual_seed(seed)
    model = GPT(c)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, c.vocab, (c.batch, c.seq_len), generator=g)
    tgt = torch.randint(0, c.vocab, (c.batch, c.seq_len), generator=g)
    return model, (idx, tgt)


def mlp_case(seed: int = 0, width: int = 1024, depth: int = 4, batch: int = 64):
    torch.manual_seed(seed)
    model = MLPLoss(width, depth)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1024, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return model, (x, y)


def make_step(model: nn.Module, lr: float = 3e-4):
    """A full training step (zero_grad, forward, backward, AdamW) returning the loss tensor."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)

    def step(*inputs):
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        return loss

    return step, opt


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["GPTConfig", "GPT", "MLPLoss", "gpt_case", "mlp_case", "make_step", "n_params"]
