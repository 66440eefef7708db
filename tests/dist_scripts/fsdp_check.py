"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on "tpu" against one process on the full batch.

Run under torchrun / spawned ranks. Each training configuration shards a fresh copy of one
CPU-initialised model over a 1-D DeviceMesh of all ranks, trains it for STEPS AdamW steps (each
rank on its slice of every global batch, gradients clipped with ``clip_grad_norm_``, foreach and
per-tensor), and checks that the full parameters (``full_tensor()``) are identical on every rank
and equal (float32 tolerance) to one CPU process that trained the same initial model on the
full batches. Configurations: ``block`` (every block and the root sharded, resharded after
forward, two micro-batches per step with ``set_requires_gradient_sync(False)`` on the first,
then the sharded ``state_dict`` saved and loaded), ``noreshard`` (reshard_after_forward=False),
``root`` (root only), ``mp`` (bf16 parameters, fp32 reduction: compared with one process that
runs each rank's slice in bf16 and averages the fp32-cast gradients, see reference_mp),
``fused`` (Fused eager mode), ``cpu_built`` (per-block sharding of a model left on CPU:
``fully_shard`` moves it with ``param.data = ...``). ``memory`` reads
``torch.tpu.memory_allocated`` in forward and backward hooks: unsharded parameters are
released after forward with ``reshard_after_forward=True``, held with False, and FSDP2's peak
is below DDP's.
Prints "OK <config>" per configuration and "ALL OK <n>"; usage: fsdp_check.py [config ...].
"""
from __future__ import annotations

import copy
import datetime
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 3
BATCH = 8  # global batch, split across ranks
CLIP = 0.05  # small enough that clipping is active on every step
CONFIGS = ["block", "memory", "noreshard", "root", "mp", "fused", "cpu_built"]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)  # h odd: FSDP2 pads the uneven dim-0 shards
        self.down = nn.Linear(h, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=32, h=67, blocks=2, d_in=6, d_out=3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(blocks))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def batch(step, micro=0, d_in=6, d_out=3):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(BATCH, d_in, generator=g), torch.randn(BATCH, d_out, generator=g)


# AdamW's eps: 1e-6, not 1e-8. With 1e-8 a weight whose gradient cancels to ~eps moves by
# lr * g / (|g| + eps), a step that amplifies the gradient's float32 rounding (summation order:
# two half batches plus a reduction vs one full batch) about a million times: blocks.0.up.weight
# (22, 22), gradient -8.5e-9 at the first step, ended 1.16e-5 from the reference on one host.
EPS = 1e-6


def micros(cfg):
    """Micro-batches per step: "block" accumulates gradients over two."""
    return 2 if cfg == "block" else 1


def reference(cfg, init):
    """One CPU process, full batches, the same optimizer and clipping."""
    m = copy.deepcopy(init)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=EPS)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(micros(cfg)):
            x, y = batch(step, micro)
            nn.functional.mse_loss(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
    return m


def reference_mp(init, n, dev):
    """FSDP2's mixed precision in one process on the same device: every rank's slice runs on a
    bf16 copy of the parameters (inputs cast to bf16 as ``cast_forward_inputs`` does), the bf16
    gradients are cast to fp32 and averaged over the slices, and clipping and AdamW act on
    the fp32 parameters. (Not on CPU: torch's CPU bf16 layer_norm backward is not correctly
    rounded -- its bias gradient differed from the fp32 sum rounded to bf16 by 2 ulp, where
    ours equals it -- so bf16 runs on the two devices differ by more than float32 tolerance.)"""
    m = copy.deepcopy(init).to(dev)
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, eps=EPS)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        total = None
        for r in range(n):
            sl = slice(r * BATCH // n, (r + 1) * BATCH // n)
            low = copy.deepcopy(m).to(torch.bfloat16)
            out = low(x[sl].to(dev).to(torch.bfloat16))
            nn.functional.mse_loss(out, y[sl].to(dev)).backward()
            g = [q.grad.float() for q in low.parameters()]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        for p, g in zip(params, total):
            p.grad = g / n
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=step % 2 == 1)
        opt.step()
    return m


def shard(cfg, init, dev, mesh):
    if cfg == "cpu_built":
        # left on CPU: fully_shard moves each parameter and buffer with `tensor.data = ...`
        # (_fsdp_init.py's _move_states_to_device); objects and autograd stay as they were
        m = copy.deepcopy(init)
        m.register_buffer("scale", torch.ones(3))
        before = {id(t) for t in (*m.parameters(), *m.buffers())}
    else:
        m = copy.deepcopy(init).to(dev)
    kw = {"mesh": mesh}
    if cfg == "noreshard":
        kw["reshard_after_forward"] = False
    if cfg == "mp":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if cfg != "root":
        for b in m.blocks:
            fully_shard(b, **kw)
    fully_shard(m, **kw)
    if cfg == "cpu_built":
        here = torch.empty(0, device=dev).device  # the device this rank's tensors report
        assert m.scale.device == here and id(m.scale) in before, m.scale.device
        assert all(p.requires_grad and p.to_local().device == here for p in m.parameters())
    return m


def train(cfg, init, rank, n, dev, mesh, with_opt=False):
    sl = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    m = shard(cfg, init, dev, mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=EPS)
    for step in range(STEPS):
        opt.zero_grad()
        k = micros(cfg)
        for micro in range(k):
            if k > 1:  # gradient accumulation: reduce-scatter only on the last micro-batch
                m.set_requires_gradient_sync(micro == k - 1)
            x, y = batch(step, micro)
            nn.functional.mse_loss(m(x[sl].to(dev)), y[sl].to(dev)).backward()
        # foreach (multi-tensor) norms and scaling on odd steps, per-tensor on even ones
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP, foreach=step % 2 == 1)
        opt.step()
    return (m, opt) if with_opt else m


def full_params(m):
    out = []
    for name, p in m.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not a DTensor"
        out.append((name, p.full_tensor().detach().float().cpu()))
    return out


def same_on_every_rank(cfg, params, n, rank):
    every = [None] * n
    dist.all_gather_object(every, [t for _, t in params])
    for r in range(n):
        for (name, t), o in zip(params, every[r]):
            assert torch.equal(o, t), f"{cfg} {name}: rank {r} differs from rank {rank}"


def check_state_dict(m, ref, init, rank, n, dev, mesh):
    """model.state_dict() of the trained model ``m`` is sharded (DTensor Shard(0), this rank's
    chunk as its local tensor); it loads into a fresh sharded model; a full state dict (the
    reference's) distributed onto the mesh loads too."""
    sd = m.state_dict()
    assert list(sd) == list(init.state_dict()), (list(sd), list(init.state_dict()))
    for k, v in sd.items():
        assert isinstance(v, DTensor) and v.placements == (Shard(0),), (k, type(v))
        full = v.full_tensor()
        want = list(torch.chunk(full.cpu(), n, dim=0))
        want += [full.cpu()[:0]] * (n - len(want))
        assert v.to_local().device == torch.empty(0, device=dev).device, k
        assert torch.equal(v.to_local().cpu(), want[rank]), k
    fresh = shard("block", init, dev, mesh)
    fresh.load_state_dict(sd)
    for (k, a), (_, b) in zip(full_params(fresh), full_params(m)):
        assert torch.equal(a, b), k
    fresh2 = shard("block", init, dev, mesh)
    full_sd = {k: torch.distributed.tensor.distribute_tensor(v.to(dev), mesh, [Shard(0)])
               for k, v in ref.state_dict().items()}
    fresh2.load_state_dict(full_sd)
    for (k, a), b in zip(full_params(fresh2), ref.parameters()):
        assert torch.equal(a, b.detach()), k


def measure_memory(rank, n, dev, mesh):
    """memory_allocated sampled in forward/backward hooks for FSDP2 (reshard_after_forward
    True and False) and DDP on a model whose parameters dominate its memory."""
    torch.manual_seed(1)
    init = Net(blocks=4)  # the training configurations' shapes: their programs are reused
    block_bytes = []  # unsharded (padded) bytes of each block's parameters
    for b in init.blocks:
        block_bytes.append(sum(-(-p.shape[0] // n) * n * p[0].numel() * 4
                               for p in b.parameters()))
    x_all = batch(0)[0]
    sl = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    res = {}
    for kind in ("fsdp", "fsdp_noreshard", "ddp"):
        t_kind = time.perf_counter()
        gc.collect()
        torch.tpu.synchronize()
        base = torch.tpu.memory_allocated(dev)
        samples = {}

        def probe(tag):
            torch.tpu.synchronize()
            samples.setdefault(tag, []).append(torch.tpu.memory_allocated(dev) - base)

        m = copy.deepcopy(init).to(dev)
        if kind.startswith("fsdp"):
            for b in m.blocks:
                fully_shard(b, mesh=mesh, reshard_after_forward=kind == "fsdp")
            fully_shard(m, mesh=mesh)
            model = m
        else:
            model = DDP(m, device_ids=[dev.index])
        for i, b in enumerate(m.blocks):
            # inside the block: its parameters are unsharded (the last submodule's post hook)
            b.down.register_forward_hook(lambda *a, i=i: probe(f"in{i}"))
            # after the block: FSDP2's own post-forward hook (registered first) has resharded
            b.register_forward_hook(lambda *a, i=i: probe(f"after{i}"))
            b.register_full_backward_hook(lambda *a, i=i: probe(f"bwd{i}"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            probe("start")
            out = model(x_all[sl].to(dev))
            probe("fwd_end")
            out.square().mean().backward()
            probe("bwd_end")
            opt.step()
            opt.zero_grad(set_to_none=False)
            probe("step_end")
        if os.environ.get("FSDP_CHECK_DEBUG") and rank == 0:  # every sample, KiB
            print(kind, f"{time.perf_counter() - t_kind:.1f} s",
                  {k: [round(x / 1024, 1) for x in v] for k, v in samples.items()}, flush=True)
        res[kind] = {k: max(v[-2:]) if k != "fwd_end" else v[-1] for k, v in samples.items()}
        res[kind]["peak"] = max(max(v) for v in samples.values())
        res[kind]["fwd_delta"] = samples["fwd_end"][-1] - samples["start"][-1]
        del model, m, opt, out
    gc.collect()
    total = sum(block_bytes)
    f, fn, dd = res["fsdp"], res["fsdp_noreshard"], res["ddp"]
    if rank == 0:
        print(f"memory rank {rank}: block params {total / 1024:.1f} KiB unsharded;"
              f" peak FSDP2 {f['peak'] / 1024:.1f} KiB, FSDP2 no-reshard"
              f" {fn['peak'] / 1024:.1f} KiB, DDP {dd['peak'] / 1024:.1f} KiB;"
              f" held after forward: reshard {f['fwd_delta'] / 1024:.1f} KiB,"
              f" no-reshard {fn['fwd_delta'] / 1024:.1f} KiB", flush=True)
    # inside block i its unsharded parameters are alive; after it they are released
    for i, bb in enumerate(block_bytes):
        drop = f[f"in{i}"] - f[f"after{i}"]
        assert drop >= 0.9 * bb, (i, drop, bb)
        assert fn[f"in{i}"] - fn[f"after{i}"] < 0.1 * bb, (i, fn[f"in{i}"], fn[f"after{i}"])
    # after forward, reshard_after_forward=False holds every block's unsharded parameters more
    held = fn["fwd_delta"] - f["fwd_delta"]
    assert 0.9 * total <= held <= 1.1 * total, (held, total)
    assert f["fwd_delta"] < 0.5 * total, (f["fwd_delta"], total)
    # FSDP2 holds a shard of parameters, gradients and optimizer state: its peak is below DDP's
    assert f["peak"] < 0.75 * dd["peak"], (f["peak"], dd["peak"])
    return res


def main():
    configs = sys.argv[1:] or CONFIGS
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; known: {CONFIGS}")
    dist.init_process_group("tpu_dist", timeout=datetime.timedelta(seconds=300))
    rank, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.tpu.set_device(local)
    dev = torch.device(f"tpu:{local}")
    mesh = init_device_mesh("tpu", (n,))
    assert mesh.device_type == "tpu"
    done = []
    t0 = time.perf_counter()
    for cfg in configs:
        torch.manual_seed(0)
        init = Net()
        if cfg == "memory":
            measure_memory(rank, n, dev, mesh)
            done.append(cfg)
            if rank == 0:
                print("OK", cfg, f"({time.perf_counter() - t0:.1f} s)", flush=True)
            continue
        if cfg == "fused":
            with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
                m = train("block", init, rank, n, dev, mesh)
            cfg_ref = "block"
        else:
            m = train(cfg, init, rank, n, dev, mesh)
            cfg_ref = cfg
        params = full_params(m)
        here = torch.empty(0, device=dev).device  # the index tensors on this rank report
        for _, p in m.named_parameters():  # sharded storage on this rank's device
            assert p.to_local().device == here and p.dtype == torch.float32
        same_on_every_rank(cfg, params, n, rank)
        if cfg == "mp":
            want = [p.detach().cpu() for p in reference_mp(init, n, dev).parameters()]
        else:
            ref = reference(cfg_ref, init)
            want = [p.detach() for p in ref.parameters()]
        for (name, a), b in zip(params, want):
            torch.testing.assert_close(a, b, msg=lambda s, name=name: f"{cfg} {name}: {s}")
        if cfg == "block":
            check_state_dict(m, ref, init, rank, n, dev, mesh)
        done.append(cfg)
        if rank == 0:
            print("OK", cfg, f"({time.perf_counter() - t0:.1f} s)", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print("ALL OK", len(done), flush=True)


if __name__ == "__main__":
    main()
