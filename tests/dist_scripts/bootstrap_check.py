"""Bootstrap under torchrun: the device is used BEFORE init_process_group (the first device
use joins the JAX cluster through torchrun's agent store), then init_process_group with
device_id= binds the group; CUDA habits name this rank's device. Prints "ALL OK 1"."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def main():
    local = int(os.environ["LOCAL_RANK"])
    n = int(os.environ["WORLD_SIZE"])
    assert torch.tpu.device_count() == n  # tpu:0 .. tpu:{n-1}, all this rank's device
    torch.tpu.set_device(local)
    x = torch.full((3,), float(local + 1), device=f"tpu:{local}")  # joins the cluster here
    # Every index names this rank's one device; tensors report tpu:0 (the autograd engine of a
    # Python backend has one device queue), and the current device agrees with where "tpu",
    # "tpu:{local}" and .to() put tensors, as FSDP2 and DTensor require.
    here = torch.device("tpu", torch.tpu.current_device())
    assert x.device == here, (x.device, here)
    for t in (torch.zeros(2).to("tpu"), torch.tensor([1.0], device="tpu"),
              torch.nn.Linear(2, 2).to(f"tpu:{local}").weight, torch.empty(1, device="tpu")):
        assert t.device == here, (t.device, here)
    w = torch.ones(3, device="tpu", requires_grad=True)
    (w * x).sum().backward()
    assert w.grad.device == here and w.grad.cpu().tolist() == [float(local + 1)] * 3
    dist.init_process_group(device_id=torch.device("tpu", local))
    assert dist.get_world_size() == n
    dist.all_reduce(x)
    assert x.cpu().tolist() == [float(sum(range(1, n + 1)))] * 3, x
    y = torch.ones(2, device="tpu")  # "tpu" is the current device: this rank's as well
    dist.all_reduce(y)
    assert y.cpu().tolist() == [float(n)] * 2
    dist.destroy_process_group()
    if dist.is_torchelastic_launched() and local == 0:
        print("ALL OK 1", flush=True)


if __name__ == "__main__":
    main()
