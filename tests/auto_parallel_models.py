"""Models for tests/test_auto_parallel.py and dist_scripts/auto_parallel_check.py: a plain MLP,
a small hand-written Llama-style transformer and a tiny HF LlamaForCausalLM."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, HIDDEN, VOCAB, LAYERS = 32, 4, 64, 48, 2


class MLP(nn.Module):
    def __init__(self, d=32, h=128, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
                                    for _ in range(depth))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads = HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them
        q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tiny_llama(vocab=VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN,
                      num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def tiny_gpt2(vocab=VOCAB):
    """HF GPT-2 (its Conv1D layers, learned positions, the head tied to the embedding),
    without dropout (its random masks are not one process's)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=DIM, n_layer=2, n_head=HEADS,
                     bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # one process's losses
    return GPT2LMHeadModel(cfg)


def tiny_qwen2(vocab=VOCAB):
    """HF Qwen2 (biased q/k/v projections, grouped KV heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN,
                      num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg)


VIT_IMAGE, VIT_LABELS = 16, 10


def tiny_vit():
    """HF ViT image classifier (a patch-embedding convolution, a CLS token, its own loss)."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=VIT_IMAGE, patch_size=4, num_channels=3, hidden_size=DIM,
                    num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=HIDDEN,
                    num_labels=VIT_LABELS, attn_implementation="sdpa")
    return ViTForImageClassification(cfg)


class MixingTransformer(Transformer):
    """Transformer whose stream between the blocks is mixed over the sequence (a running mean):
    right on one device, wrong on a rank's half of the tokens, so never sequence parallel."""

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
            h = h.cumsum(1) / torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]
        return self.output(self.norm(h))


class FusedAttention(nn.Module):
    """Attention with one fused q/k/v projection. ``grouped``: its rows hold each head's q, k
    and v together (TorchTitan's wqkv layout: a Shard(0) gives each rank whole heads);
    otherwise they are stacked [q; k; v] and split with ``chunk(3)``: right on one device,
    wrong when a rank holds a row block (the same shapes, other numbers)."""

    def __init__(self, grouped=True):
        super().__init__()
        self.grouped = grouped
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS
        qkv = self.wqkv(x)
        if self.grouped:
            q, k, v = qkv.view(b, s, -1, 3, hd).unbind(3)
        else:
            q, k, v = (t.view(b, s, -1, hd) for t in qkv.chunk(3, -1))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FusedTransformer(Transformer):
    def __init__(self, grouped=True, layers=LAYERS):
        super().__init__(layers)
        for blk in self.layers:
            blk.attention = FusedAttention(grouped)


def beyond_buffers(model, memory: float, fraction: float = 0.9) -> float:
    """A budget of ``fraction`` x a plan's ``memory`` beyond the model's buffers, which every
    plan holds whole on every device (TorchTitan's debug model: a 131072-position rotary
    table per layer, 48 MiB, more than the rest of a short sequence's plan)."""
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return buffers + fraction * (memory - buffers)
