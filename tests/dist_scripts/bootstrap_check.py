"""Bootstrap under torchrun: the device is used BEFORE init_process_group (the first device
use joins the JAX cluster through torchrun's agent store), then init_process_group with
device_id= binds the group; CUDA habits name this rank's device; split_group and a 2-D
DeviceMesh over the bound group. Prints "ALL OK 1"."""
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
    check_split_group(local, n)
    dist.destroy_process_group()
    if dist.is_torchelastic_launched() and local == 0:
        print("ALL OK 1", flush=True)


def check_split_group(rank, n):
    """split_group over the device-bound default group: every rank alone, then everyone in one
    split listed out of order, then a split this rank is not in (None); and DeviceMesh, which
    creates its dimension groups with split_group once the group is bound to a device."""
    assert dist.group.WORLD.bound_device_id == torch.device("tpu", rank)  # as with NCCL
    alone = dist.split_group(split_ranks=[[r] for r in range(n)])
    assert alone is not None and alone.size() == 1 and alone.rank() == 0
    x = torch.full((2,), float(rank + 1), device="tpu")
    dist.all_reduce(x, group=alone)
    assert x.cpu().tolist() == [float(rank + 1)] * 2
    everyone = dist.split_group(split_ranks=[list(reversed(range(n)))], group_desc="all")
    assert everyone.size() == n and everyone.rank() == rank
    assert everyone.bound_device_id == torch.device("tpu", rank)
    x = torch.full((2,), float(rank + 1), device="tpu")
    dist.all_reduce(x, group=everyone)
    assert x.cpu().tolist() == [float(sum(range(1, n + 1)))] * 2
    only0 = dist.split_group(split_ranks=[[0]])  # the same split_ranks on every rank
    assert (only0 is None) == (rank != 0)
    mesh = torch.distributed.device_mesh.init_device_mesh("tpu", (1, n),
                                                          mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    assert tp.size() == n and mesh.get_group("dp").size() == 1
    assert len(mesh.get_group("dp").group_name) == 40  # made by split_group (a hash name)
    x = torch.full((2,), float(rank + 1), device="tpu")
    dist.all_reduce(x, group=tp)
    assert x.cpu().tolist() == [float(sum(range(1, n + 1)))] * 2
    with pytest_raises(ValueError, "duplicate"):
        dist.split_group(split_ranks=[[0, 0]])


class pytest_raises:
    def __init__(self, exc, text):
        self.exc, self.text = exc, text

    def __enter__(self):
        return self

    def __exit__(self, tp, val, tb):
        assert tp is self.exc and self.text in str(val), (tp, val)
        return True


if __name__ == "__main__":
    main()
