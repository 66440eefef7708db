"""Attention on DTensor inputs on "tpu", against one CPU process training the full model.

The model is PyTorch's own test Transformer (``torch.testing._internal.distributed._tensor.
common_dtensor``: token and position embeddings, blocks of LayerNorm + causal SDPA attention +
GELU MLP, weight tying) parallelized by its own ``Transformer.parallelize`` with
``local_output_for_attn=False``: q, k, v reach ``F.scaled_dot_product_attention`` as DTensors
sharded on the heads dim (PyTorch's style), so the attention op's DTensor sharding strategy
decides (on "tpu" SDPA reaches ``_scaled_dot_product_fused_attention_overrideable``, whose
strategies live in torchtpu/distributed/attention.py). Losses per step and the parameters after
training must match the CPU reference. Configurations:
  tp         tensor parallel (2 ranks)
  sp         + sequence parallel norms and embeddings (2 ranks)
  splash     tp with torch.tpu.ops.splash_sdpa in place of SDPA (2 ranks)
  fsdp_tp    2-D: sp on mesh["tp"], fully_shard on mesh["dp"] (4 ranks: dp=2, tp=2), each dp
             rank training on its slice of the batch
  cp         context parallelism: torch's context_parallel() over the sequence of
             tp_check.py's rope Llama (ring attention through the overrideable op, round-robin
             load balance; 2 ranks), loss and rank-averaged gradients against one process
Prints "OK <config>" per configuration and "ALL OK <n>".
Usage: attention_dtensor_check.py [--mode strict|fused] config ...
"""
from __future__ import annotations

import copy
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed._tensor.common_dtensor import (Attention, ModelArgs,
                                                                         Transformer)

STEPS, BATCH, SEQ = 3, 4, 16
ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=SEQ, dim=32, n_heads=4, dropout_p=0.0,
                 use_attn_mask=True)
checked = []
seen = []
_t0 = [time.monotonic()]


def ok(name):
    checked.append(name)
    if dist.get_rank() == 0:
        print(f"OK {name} ({time.monotonic() - _t0[0]:.1f} s)", flush=True)
    _t0[0] = time.monotonic()


class SplashAttention(Attention):
    """PyTorch's test Attention with torch.tpu.ops.splash_sdpa (causal) in place of SDPA."""

    def forward(self, x):
        splash_sdpa = torch.tpu.ops.splash_sdpa
        bsz, seq_len, _ = x.size()
        q, k, v = (w(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        seen.append(tuple(t.placements for t in (q, k, v) if isinstance(t, DTensor)))
        out = splash_sdpa(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


_sdpa = F.scaled_dot_product_attention


def recording_sdpa(q, k, v, *args, **kwargs):
    seen.append(tuple(t.placements for t in (q, k, v) if isinstance(t, DTensor)))
    return _sdpa(q, k, v, *args, **kwargs)


def batch(step):
    g = torch.Generator().manual_seed(70 + step)
    return (torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g),
            torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=g))


def loss_of(model, ids, labels):
    out = model(ids)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return F.cross_entropy(out.flatten(0, 1), labels.flatten())


def reference(init):
    m = copy.deepcopy(init)
    opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step)
        opt.zero_grad()
        loss = loss_of(m, ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return m, losses


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def check_tp(init, cfg, world, dev):
    ref, ref_losses = reference(init)
    model = copy.deepcopy(init).to(dev)
    if cfg == "splash":
        for layer in model.layers:
            layer.attention.__class__ = SplashAttention
    sp = cfg in ("sp", "fsdp_tp")
    if cfg == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("tpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        Transformer.parallelize(model, mesh["tp"], sp, local_output_for_attn=False)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp, r = world // 2, mesh["dp"].get_local_rank()
    else:
        Transformer.parallelize(model, init_device_mesh("tpu", (world,)), sp,
                                local_output_for_attn=False)
        dp, r = 1, 0
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, foreach=False)
    sl = slice(r * BATCH // dp, (r + 1) * BATCH // dp)
    seen.clear()
    for step in range(STEPS):
        ids, labels = batch(step)
        opt.zero_grad()
        loss = loss_of(model, ids[sl].to(dev), labels[sl].to(dev))
        loss.backward()
        opt.step()
        if dp == 1:
            torch.testing.assert_close(loss.detach().cpu(), torch.tensor(ref_losses[step]))
    # q, k, v reached the attention op as DTensors sharded on the heads dim
    assert seen and all(p and all("Shard(dim=1)" in str(x) for x in p) for p in seen), seen[:2]
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full(got[name]), p.detach(),
                                   msg=lambda m, n=name: f"{cfg} {n}: {m}")
    ok(cfg)


def check_cp(world, dev):
    """torch's context_parallel(): buffers sharded on the sequence (round-robin for causal
    attention), SDPA replaced by its DTensor ring attention; loss and rank-averaged gradients
    equal the one-process ones (tp_check.py's rope Llama: positions come from buffers)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tp_check as tc
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(0)
    init = tc.Llama()
    mesh = init_device_mesh("tpu", (world,), mesh_dim_names=("cp",))
    ref, model = copy.deepcopy(init), copy.deepcopy(init).to(dev)
    for step in range(2):
        ids, labels = tc.batch(step)
        ref.zero_grad()
        ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten())
        ref_loss.backward()
        model.zero_grad()
        ids_t, labels_t = ids.to(dev), labels.to(dev)
        with context_parallel(mesh, buffers=[ids_t, labels_t, model.cos, model.sin],
                              buffer_seq_dims=[1, 1, 0, 0],
                              no_restore_buffers={ids_t, labels_t}):
            assert ids_t.shape[1] == tc.SEQ // world
            loss = F.cross_entropy(model(ids_t).flatten(0, 1), labels_t.flatten())
            loss.backward()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), rtol=1e-5,
                                   atol=1e-5)
        for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
            g = p.grad.clone()
            dist.all_reduce(g, op=dist.ReduceOp.AVG)
            torch.testing.assert_close(g.cpu(), rp.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=n: f"cp grad {n}: {m}")
    ok("cp")


def main():
    args = sys.argv[1:]
    mode = "strict"
    if args[:1] == ["--mode"]:
        mode, args = args[1], args[2:]
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    if mode == "fused":
        torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    F.scaled_dot_product_attention = recording_sdpa
    for cfg in args:
        if cfg == "cp":
            F.scaled_dot_product_attention = _sdpa  # context_parallel patches it itself
            check_cp(world, dev)
            F.scaled_dot_product_attention = recording_sdpa
            continue
        if cfg not in ("tp", "sp", "splash", "fsdp_tp"):
            raise SystemExit(f"unknown config {cfg}")
        torch.manual_seed(0)
        check_tp(Transformer(ARGS), cfg, world, dev)
    torch.tpu.synchronize()
    dist.barrier()
    fb = torch.tpu.metrics()["per_op"].get("cpu_fallbacks", {})
    if dist.get_rank() == 0:
        print("cpu fallbacks:", fb, flush=True)
        assert not any("attention" in k for k in fb), fb
        print("ALL OK", len(checked), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
