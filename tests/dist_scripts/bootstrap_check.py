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
    assert torch.tpu.current_device() == local
    x = torch.full((3,), float(local + 1), device=f"tpu:{local}")  # joins the cluster here
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
