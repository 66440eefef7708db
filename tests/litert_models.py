"""Models for tests/test_litert.py, shared with its LiteRT-environment runner (litert_runner.py):
an MLP, a small CNN and one decode step of a tiny Llama, each trained a few steps on "tpu"."""
from __future__ import annotations

import torch
from torch import nn

VOCAB = 64
PAST = 5  # tokens already in the Llama decode step's KV cache


def mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 10))


def cnn():
    """conv/BN/ReLU/pool stages, global pooling, a classifier (BatchNorm in eval mode is folded
    into the convolutions by the converter)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class InfNet(nn.Module):
    """Infinite constants: clamps whose bounds are partly +-inf, a -inf masked_fill before a
    softmax (the converter stores them as +-max float)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        inf = float("inf")
        self.register_buffer("lo", torch.tensor([-inf, -0.5, -inf, -1.0, -inf, 0.0]))
        self.register_buffer("hi", torch.tensor([inf, 0.5, 1.0, inf, inf, 2.0]))

    def forward(self, x):
        y = torch.maximum(torch.minimum(self.lin(x), self.hi), self.lo)
        mask = torch.cat([torch.zeros_like(x[:, :1], dtype=torch.bool), x[:, 1:6] > 0.5], 1)
        return torch.softmax(y.masked_fill(mask, float("-inf")), -1)


def tiny_llama():
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64))


class LlamaDecodeStep(nn.Module):
    """One decode step of a causal LM with its KV cache passed in and returned: LiteRT models
    hold no state, so the cache is an input (``past``: keys and values of each layer,
    ``[batch, kv_heads, PAST, head_dim]``) and the step returns the logits of the new token and
    the cache with its keys and values appended (``PAST + 1`` positions)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])))
        kw = _cache_kw(self.model)
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                         **{kw: cache})
        kv = []
        for layer in getattr(out, kw).layers:
            kv += [layer.keys, layer.values]
        return (out.logits, *kv)


def _cache_kw(model):
    """transformers 5.25 renamed ``past_key_values`` (argument and output) to ``cache``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def _train(model, batches, loss_fn, steps=3, lr=1e-2):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        x, y = batches(i)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def trained(name, device="tpu", steps=3):
    """``(model, example_args, losses)``: the model built from a fixed seed, trained ``steps``
    AdamW steps on ``device`` (eval mode after), and example inputs (CPU tensors)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ce = nn.functional.cross_entropy
    if name == "mlp":
        model = mlp().to(device)
        losses = _train(model, lambda i: (torch.randn(32, 16, generator=g).to(device),
                                          torch.randint(0, 10, (32,), generator=g).to(device)),
                        ce, steps)
        return model, (torch.randn(4, 16, generator=g),), losses
    if name == "infnet":
        model = InfNet().to(device)
        losses = _train(model, lambda i: (torch.randn(16, 8, generator=g).to(device),
                                          torch.rand(16, 6, generator=g).to(device)),
                        nn.functional.mse_loss, steps)
        return model, (torch.randn(8, 8, generator=g),), losses
    if name == "cnn":
        model = cnn().to(device)
        losses = _train(model, lambda i: (torch.randn(8, 3, 16, 16, generator=g).to(device),
                                          torch.randint(0, 10, (8,), generator=g).to(device)),
                        ce, steps)
        return model, (torch.randn(2, 3, 16, 16, generator=g),), losses
    if name == "llama":
        lm = tiny_llama().to(device)

        def batches(i):
            ids = torch.randint(0, VOCAB, (4, 12), generator=g).to(device)
            return ids, ids

        def lm_loss(out, ids):
            return ce(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

        losses = _train(lm, batches, lm_loss, steps)
        cfg = lm.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        # the cache of a real prefix: the prompt's keys and values, computed on CPU
        prompt = torch.randint(0, VOCAB, (1, PAST), generator=g)
        with torch.no_grad():
            pre = getattr(lm.to("cpu")(prompt, use_cache=True), _cache_kw(lm))
        lm.to(device)
        past = []
        for layer in pre.layers:
            past += [layer.keys.clone(), layer.values.clone()]
        assert past[0].shape == (1, cfg.num_key_value_heads, PAST, hd)
        ids = torch.randint(0, VOCAB, (1, 1), generator=g)
        pos = torch.tensor([[PAST]])
        return LlamaDecodeStep(lm).eval(), (ids, pos, *past), losses
    raise ValueError(name)
