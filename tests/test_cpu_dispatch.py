"""TORCHTPU_CPU_SYNC_DISPATCH=1 (runtime/devices.py): XLA:CPU runs each program inline on the
calling thread. The option must really reach JAX's CPU client (JAX ignores its own environment
variable for it), and every result must be bit-equal to the default (async) dispatch and match
PyTorch on CPU. Each setting needs its own process: the client reads the option once."""
from __future__ import annotations

import os

import pytest
from helpers import run_json

from torchtpu.runtime import devices

# A decoder-like chain (matmuls, RMSNorm, rotary, GQA attention through the fused SDPA op, an
# in-place update, a reduction, argmax), each result printed exactly (float.hex).
SCRIPT = r"""
import json, sys
import torch, torchtpu
import jax, jax.numpy as jnp
import torch.nn.functional as F
from torchtpu.runtime import devices

def chain(dev):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, 64, generator=g).to(dev)
    w = torch.randn(64, 64, generator=g).to(dev) * 0.1
    k = torch.randn(1, 2, 9, 16, generator=g).to(dev)
    v = torch.randn(1, 2, 9, 16, generator=g).to(dev)
    h = x @ w
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    q = h.view(1, 5, 4, 16).transpose(1, 2)
    q = torch.cat([-q[..., 8:], q[..., :8]], -1) * 0.5 + q
    a = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
    y = a.transpose(1, 2).reshape(1, 5, 64)
    y.add_(x)
    s = torch.cumsum(F.silu(y @ w.t()), -1)
    return [s, s.argmax(-1), s.sum()]

with torch.no_grad():
    outs = [t.cpu() for t in chain("tpu")]
    ref = chain("cpu")
torch.tpu.synchronize()
f = jax.jit(lambda a: a @ a @ a)
big = jnp.ones((256, 256), jnp.float32)
f(big).block_until_ready()
ready = sum(bool(f(big).is_ready()) for _ in range(10))
close = all(torch.allclose(o.float(), r.float(), rtol=1e-4, atol=1e-4) for o, r in zip(outs, ref))
print(json.dumps({"dispatch": devices.cpu_dispatch(), "ready": ready, "close": close,
                  "res": [[float(v).hex() for v in o.flatten().tolist()] for o in outs]}))
"""


def _run(sync: bool):
    env = dict(os.environ, TORCHTPU_CPU_SYNC_DISPATCH="1" if sync else "0")
    return run_json(SCRIPT, env, timeout=300)


@pytest.mark.skipif(devices.platform() != "cpu",
                    reason="an XLA:CPU option; other platforms do not read it")
def test_sync_dispatch_takes_effect_and_is_bit_equal():
    sync, default = _run(True), _run(False)
    assert sync["dispatch"] == "sync" and default["dispatch"] == "async"
    # inline execution: a program's output is ready when the call returns (not so in async
    # mode for a program of this size, which runs on XLA's worker pool)
    assert sync["ready"] == 10
    assert sync["close"] and default["close"]
    assert sync["res"] == default["res"]
