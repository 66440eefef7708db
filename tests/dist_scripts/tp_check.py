"""Tensor parallel on "tpu" against one CPU process training the full model.

Run under torchrun (2 ranks; 4 for fsdp_tp) or spawned ranks. A small Llama-style model
(token embedding, blocks of RMSNorm + causal attention with rotary embedding + RMSNorm +
SwiGLU MLP, final norm, output projection) is built from one seed on every rank, parallelized
with torch.distributed.tensor.parallel and trained for STEPS AdamW steps; a single CPU process
trains the same initial model on the same batches; parameters (gathered with full_tensor) must
match with float32 tolerance. Configurations:
  tp       ColwiseParallel / RowwiseParallel on attention and MLP (Replicate activations)
  sp       + SequenceParallel norms, PrepareModuleInput, sharded embedding and loss_parallel
           (vocab-sharded logits), clip_grad_norm_, foreach AdamW
  dcp      get_state_dict / dcp.save / dcp.load / set_state_dict of the sp model and its
           optimizer into a freshly initialised one: exact round trip, then equal next steps;
           full state dict into a plain CPU model (same logits), and broadcast from rank 0
           into a TP model built on the meta device
  sp_compile  the sp model under torch.compile(backend="tpu") (forward and backward
           compiled, collectives lowered into the programs; loss_parallel and AdamW eager)
  fsdp_tp  2-D: TP (sp plan) on mesh["tp"], fully_shard on mesh["dp"] (4 ranks: dp=2, tp=2),
           each dp rank training on its slice of the global batch
Prints "OK <config>" per configuration and "ALL OK <n>"; any mismatch raises.
Usage: tp_check.py [--mode strict|fused] [--ckpt DIR] [config ...]
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

DIM, HEADS, HIDDEN, VOCAB, SEQ, BATCH, LAYERS = 32, 4, 64, 48, 8, 4, 2
STEPS = 3
checked = []


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, rope):
        b, s, _ = x.shape
        hd = DIM // HEADS
        # -1 heads: under TP each rank holds HEADS / tp of them
        q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope

        def rot(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], dim=-1) * sin

        o = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
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
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.feed_forward = FeedForward()

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        hd = DIM // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(SEQ).float(), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h, (self.cos, self.sin))
        return self.output(self.norm(h))


def block_plan(sp):
    if not sp:
        return {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                        desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize(model, tp_mesh, sp):
    if sp:
        top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1)),
               "norm": SequenceParallel(),
               "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                         use_local_output=False)}
    else:
        top = {"output": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, tp_mesh, top)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block_plan(sp))
    return model


def batch(step):
    gen = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def reference(init, steps, sp):
    m = copy.deepcopy(init)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids, labels = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        if sp:
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return m, opt, losses


def train_step(model, opt, ids, labels, sp, dev):
    opt.zero_grad()
    out = model(ids.to(dev))
    if sp:
        assert isinstance(out, DTensor) and out.placements[-1] == Shard(2), out.placements
        with loss_parallel():
            loss = F.cross_entropy(out.flatten(0, 1), labels.to(dev).flatten())
            loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    else:
        loss = F.cross_entropy(out.flatten(0, 1), labels.to(dev).flatten())
        loss.backward()
    opt.step()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def compare_params(model, ref, what, exact=False):
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        name = name.replace("_fsdp_wrapped_module.", "")
        g = full(got[name])
        if exact:
            assert torch.equal(g, p.detach()), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(g, p.detach(), msg=lambda m: f"{what} {name}: {m}")


_t0 = [time.monotonic()]


def ok(name):
    checked.append(name)
    if dist.get_rank() == 0:
        print(f"OK {name} ({time.monotonic() - _t0[0]:.1f} s)", flush=True)
    _t0[0] = time.monotonic()


def make_model(init, tp_mesh, sp, dev):
    m = copy.deepcopy(init).to(dev)
    parallelize(m, tp_mesh, sp)
    for name, p in m.named_parameters():
        assert p.device.type == "tpu", name
        # without sequence parallel, embeddings and norms stay plain replicated tensors
        assert isinstance(p, DTensor) or not sp and ("norm" in name or "embed" in name), name
    return m


def check_tp(init, mesh, sp, dev, compiled=False):
    name = ("sp" if sp else "tp") + ("_compile" if compiled else "")
    ref, _, ref_losses = reference(init, STEPS, sp)
    model = make_model(init, mesh, sp, dev)
    # foreach only when every parameter is a DTensor: a foreach op over a mix of DTensors and
    # plain tensors raises in DTensor (on any device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=sp)
    run = torch.compile(model, backend="tpu") if compiled else model
    before = torch.tpu.metrics()["counters"].get("compile_collectives", 0)
    for step in range(STEPS):
        loss = train_step(run, opt, *batch(step), sp, dev)
        torch.testing.assert_close(loss.cpu(), torch.tensor(ref_losses[step]))
    compare_params(model, ref, name)
    if compiled:  # the collectives were lowered into the compiled programs
        assert torch.tpu.metrics()["counters"].get("compile_collectives", 0) > before
    ok(name)


def check_dcp(init, mesh, dev, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict, set_model_state_dict,
                                                         set_state_dict)
    model = make_model(init, mesh, True, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(2):
        train_step(model, opt, *batch(step), True, dev)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    # a fresh model from another seed, its optimizer with state of its own
    torch.manual_seed(99)
    other = make_model(Llama(), mesh, True, dev)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    train_step(other, opt2, *batch(7), True, dev)
    msd2, osd2 = get_state_dict(other, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(other, opt2, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    # exact: parameters, and every optimizer state tensor
    a, b = dict(model.named_parameters()), dict(other.named_parameters())
    for name in a:
        assert a[name].placements == b[name].placements, name
        assert torch.equal(full(a[name]), full(b[name])), f"dcp param {name}"
        sa, sb = opt.state[a[name]], opt2.state[b[name]]
        assert set(sa) == set(sb), name
        for k in sa:
            assert torch.equal(full(sa[k]), full(sb[k])), f"dcp optim {name}.{k}"
            if isinstance(sb[k], DTensor):
                assert sb[k].to_local().device.type == "tpu", (name, k)
    # one more step on both: identical
    for m_, o_ in ((model, opt), (other, opt2)):
        train_step(m_, o_, *batch(2), True, dev)
    for name in a:
        assert torch.equal(full(a[name]), full(b[name])), f"dcp next step {name}"
    # full state dict out to a plain CPU model (same outputs), and back in, broadcast from rank
    # 0, to a TP model built on the meta device (TorchTitan's seed-checkpoint flow)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    ids, _ = batch(3)
    logits = full(model(ids.to(dev)))  # every rank: the forward runs collectives
    if dist.get_rank() == 0:
        assert all(v.device.type == "cpu" and not isinstance(v, DTensor) for v in sd.values())
        cpu_model = Llama()
        cpu_model.load_state_dict(sd)
        torch.testing.assert_close(logits, cpu_model(ids).detach())
    else:
        assert sd == {}, "cpu_offload full state dict is for rank 0 only"
    with torch.device("meta"):
        meta = Llama()
    parallelize(meta, mesh, True)
    meta.to_empty(device=dev)
    meta.cos.copy_(init.cos)
    meta.sin.copy_(init.sin)
    set_model_state_dict(meta, sd, options=StateDictOptions(full_state_dict=True,
                                                            broadcast_from_rank0=True))
    c = dict(meta.named_parameters())
    for name in a:
        assert c[name].placements == a[name].placements, name
        assert c[name].to_local().device.type == "tpu", name
        assert torch.equal(full(c[name]), full(a[name])), f"broadcast_from_rank0 {name}"
    ok("dcp")


def check_fsdp_tp(init, world, dev):
    from torch.distributed.fsdp import fully_shard
    dp = world // 2
    mesh = init_device_mesh("tpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    ref, _, _ = reference(init, STEPS, True)
    model = make_model(init, mesh["tp"], True, dev)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.ndim == 2, (name, p.device_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    r = mesh["dp"].get_local_rank()
    sl = slice(r * BATCH // dp, (r + 1) * BATCH // dp)
    for step in range(STEPS):
        ids, labels = batch(step)
        train_step(model, opt, ids[sl], labels[sl], True, dev)
    compare_params(model, ref, "fsdp_tp")
    ok("fsdp_tp")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="strict")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("configs", nargs="*")
    args = ap.parse_args()
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.tpu.set_device(local)
    dev = torch.device("tpu", local)
    if args.mode == "fused":
        torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    configs = args.configs or (["fsdp_tp"] if world == 4 else ["tp", "sp", "dcp"])
    mesh = None if world == 4 else init_device_mesh("tpu", (world,))
    for cfg in configs:
        torch.manual_seed(0)
        init = Llama()
        if cfg == "tp":
            check_tp(init, mesh, False, dev)
        elif cfg == "sp":
            check_tp(init, mesh, True, dev)
        elif cfg == "sp_compile":
            check_tp(init, mesh, True, dev, compiled=True)
        elif cfg == "dcp":
            ckpt = args.ckpt
            if ckpt is None:  # one folder for all ranks (one host), removed afterwards
                obj = [tempfile.mkdtemp(prefix="tp_dcp_") if dist.get_rank() == 0 else None]
                dist.broadcast_object_list(obj, src=0)
                ckpt = obj[0]
            check_dcp(init, mesh, dev, ckpt)
            dist.barrier()
            if args.ckpt is None and dist.get_rank() == 0:
                shutil.rmtree(ckpt, ignore_errors=True)
        elif cfg == "fsdp_tp":
            check_fsdp_tp(init, world, dev)
        else:
            raise SystemExit(f"unknown config {cfg}")
    torch.tpu.synchronize()
    dist.barrier()
    fb = torch.tpu.metrics()["per_op"].get("cpu_fallbacks", {})
    if dist.get_rank() == 0:
        print("cpu fallbacks:", fb, flush=True)
        print("ALL OK", len(checked), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
