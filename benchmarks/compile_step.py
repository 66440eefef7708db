"""Training-step benchmark: torch.compile(backend="tpu") vs PyTorch CPU eager vs Inductor (CPU)
vs the same GPT written directly in JAX (jax.jit of loss + grad + AdamW: the XLA ceiling).

    python benchmarks/compile_step.py [--steps N] [--only gpt|mlp] [--skip inductor,jax]

Prints, per model and backend: the median ms per training step over N timed steps (after warm-up)
and the first-step time (trace + compile + run). For "tpu" it also measures a warm start: a
fresh process running the same program again with the persistent compile cache populated.
Models: a small GPT (6 layers, d_model 256, 4 heads, seq 128, vocab 4096, batch 8, float32,
AdamW) and a 4-layer MLP (1024 wide, batch 64, AdamW).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

GPT = dict(layers=6, d=256, heads=4, seq=128, vocab=4096, batch=8)
MLP = dict(layers=4, width=1024, batch=64)
LR = 1e-3


# ---- models (PyTorch) ----

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers, d, heads, seq, vocab, **_):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_mlp(layers, width, **_):
    mods = []
    for i in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()] if i < layers - 1 else [nn.Linear(width, width)]
    return nn.Sequential(*mods)


def gpt_data(device):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, GPT["vocab"], (GPT["batch"], GPT["seq"]), generator=g)
    tgt = torch.randint(0, GPT["vocab"], (GPT["batch"], GPT["seq"]), generator=g)
    return idx.to(device), tgt.to(device)


def mlp_data(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MLP["batch"], MLP["width"], generator=g)
    y = torch.randn(MLP["batch"], MLP["width"], generator=g)
    return x.to(device), y.to(device)


def gpt_loss(model, idx, tgt):
    logits = model(idx)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))


def mlp_loss(model, x, y):
    return F.mse_loss(model(x), y)


def make_step(loss_fn):
    def step(model, opt, a, b):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, a, b)
        loss.backward()
        opt.step()
        return loss

    return step


def sync(device):
    if device == "tpu":
        torch.tpu.synchronize()


def bench_torch(which, backend, steps):
    """backend: 'tpu' (compiled), 'eager' (CPU), 'inductor' (CPU)."""
    device = "tpu" if backend == "tpu" else "cpu"
    torch.manual_seed(0)
    if which == "gpt":
        model, data, loss_fn = TinyGPT(**GPT), gpt_data(device), gpt_loss
    else:
        model, data, loss_fn = make_mlp(**MLP), mlp_data(device), mlp_loss
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    step = make_step(loss_fn)
    if backend == "tpu":
        step = torch.compile(step, backend="tpu")
    elif backend == "inductor":
        step = torch.compile(step, backend="inductor")
    t0 = time.perf_counter()
    loss = step(model, opt, *data)
    float(loss)
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(2):
        float(step(model, opt, *data))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = step(model, opt, *data)
        float(loss)  # the step is done when its loss is on the host
        times.append(time.perf_counter() - t)
    return {"ms": 1000 * statistics.median(times), "first_s": first, "loss": float(loss)}


# ---- the same GPT directly in JAX ----

def bench_jax(which, steps):
    import jax
    import jax.numpy as jnp
    import numpy as np

    torch.manual_seed(0)
    if which == "gpt":
        tmodel = TinyGPT(**GPT)
        idx, tgt = gpt_data("cpu")
        data = (jnp.asarray(idx.numpy()), jnp.asarray(tgt.numpy()))
    else:
        tmodel = make_mlp(**MLP)
        x, y = mlp_data("cpu")
        data = (jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in tmodel.named_parameters()}
    H, D = GPT["heads"], GPT["d"]

    def ln(x, w, b):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * w + b

    def lin(x, p, name, bias=True):
        y = x @ p[name + ".weight"].T
        return y + p[name + ".bias"] if bias else y

    def gpt_fwd(p, idx):
        b, t = idx.shape
        x = p["tok.weight"][idx] + p["pos.weight"][jnp.arange(t)]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for i in range(GPT["layers"]):
            pre = f"blocks.{i}."
            qkv = lin(ln(x, p[pre + "ln1.weight"], p[pre + "ln1.bias"]), p, pre + "qkv")
            q, k, v = jnp.split(qkv, 3, axis=2)
            sh = lambda z: z.reshape(b, t, H, D // H).transpose(0, 2, 1, 3)  # noqa: E731
            q, k, v = sh(q), sh(k), sh(v)
            att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(D // H))
            att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
            y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, D)
            x = x + lin(y, p, pre + "proj")
            h = jax.nn.gelu(lin(ln(x, p[pre + "ln2.weight"], p[pre + "ln2.bias"]), p, pre + "fc1"),
                            approximate=False)
            x = x + lin(h, p, pre + "fc2")
        return lin(ln(x, p["ln.weight"], p["ln.bias"]), p, "head", bias=False)

    def gpt_lossf(p, idx, tgt):
        logits = gpt_fwd(p, idx)
        lp = jax.nn.log_softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)
        return -jnp.take_along_axis(lp, tgt.reshape(-1, 1), axis=1).mean()

    def mlp_lossf(p, x, y):
        n = MLP["layers"]
        for i in range(n):
            x = x @ p[f"{2 * i}.weight"].T + p[f"{2 * i}.bias"]
            if i < n - 1:
                x = jax.nn.relu(x)
        return ((x - y) ** 2).mean()

    lossf = gpt_lossf if which == "gpt" else mlp_lossf
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 1e-2

    def step(p, m, v, t, a, b):
        loss, g = jax.value_and_grad(lossf)(p, a, b)
        t = t + 1
        m = jax.tree.map(lambda m_, g_: b1 * m_ + (1 - b1) * g_, m, g)
        v = jax.tree.map(lambda v_, g_: b2 * v_ + (1 - b2) * g_ * g_, v, g)
        c1 = 1 - b1 ** t
        c2 = 1 - b2 ** t

        def upd(p_, m_, v_):
            p_ = p_ * (1 - LR * wd)
            return p_ - LR * (m_ / c1) / (jnp.sqrt(v_ / c2) + eps)

        p = jax.tree.map(upd, p, m, v)
        return p, m, v, t, loss

    jstep = jax.jit(step, donate_argnums=(0, 1, 2))
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    t = jnp.asarray(0.0, jnp.float32)
    t0 = time.perf_counter()
    params, m, v, t, loss = jstep(params, m, v, t, *data)
    float(loss)
    first = time.perf_counter() - t0
    for _ in range(2):
        params, m, v, t, loss = jstep(params, m, v, t, *data)
        float(loss)
    times = []
    for _ in range(steps):
        s = time.perf_counter()
        params, m, v, t, loss = jstep(params, m, v, t, *data)
        float(loss)
        times.append(time.perf_counter() - s)
    return {"ms": 1000 * statistics.median(times), "first_s": first, "loss": float(np.asarray(loss))}


def run_one(which, backend, steps):
    if backend == "jax":
        return bench_jax(which, steps)
    return bench_torch(which, backend, steps)


def child(which, backend, steps, cache_dir=None):
    """Run one measurement in a fresh process (so compile times are cold unless cached)."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["TORCHTPU_CACHE_DIR"] = cache_dir
    out = subprocess.run([sys.executable, __file__, "--child", which, backend, str(steps)],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", choices=["gpt", "mlp"])
    ap.add_argument("--skip", default="", help="comma list of: eager,inductor,jax,warm")
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        import warnings

        warnings.simplefilter("ignore")
        which, backend, steps = a.child
        print(json.dumps(run_one(which, backend, int(steps))))
        return
    skip = set(filter(None, a.skip.split(",")))
    rows = []
    for which in (["gpt", "mlp"] if a.only is None else [a.only]):
        cache = tempfile.mkdtemp(prefix="torchtpu-bench-cache-")
        res = {"tpu": child(which, "tpu", a.steps, cache)}
        if "warm" not in skip:
            res["tpu (warm cache)"] = child(which, "tpu", a.steps, cache)
        for b in ("eager", "inductor", "jax"):
            if b not in skip:
                res[b] = child(which, b, a.steps)
        rows.append((which, res))
    names = {"tpu": '"tpu" compiled', "tpu (warm cache)": '"tpu" compiled, warm cache',
             "eager": "PyTorch CPU eager", "inductor": "torch.compile Inductor (CPU)",
             "jax": "direct JAX (jax.jit)"}
    print("| model | backend | ms / step (median) | first step (s) | final loss |")
    print("|---|---|---|---|---|")
    for which, res in rows:
        for b, r in res.items():
            if "error" in r:
                print(f"| {which} | {names[b]} | error: {r['error'][:80]} | | |")
            else:
                print(f"| {which} | {names[b]} | {r['ms']:.1f} | {r['first_s']:.2f} | {r['loss']:.4f} |")
    for which, res in rows:
        t, j, i = res.get("tpu", {}), res.get("jax", {}), res.get("inductor", {})
        w = res.get("tpu (warm cache)", {})
        if "ms" in t and "ms" in j:
            print(f"{which}: tpu / direct-JAX step time = {t['ms'] / j['ms']:.2f}")
        if "ms" in t and "ms" in i:
            print(f"{which}: tpu / Inductor step time = {t['ms'] / i['ms']:.2f}")
        if "first_s" in t and "first_s" in w:
            print(f"{which}: warm-cache first step / cold first step = "
                  f"{w['first_s'] / t['first_s']:.2f}")


if __name__ == "__main__":
    main()
