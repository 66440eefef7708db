"""vLLM's device communicator on "tpu": tensor-parallel collectives over the "tpu_dist" group.

The collectives are PyTorch's functional collectives (``torch.distributed._functional_collectives``)
on the group vLLM created with backend "tpu_dist": eagerly they run torchtpu's collective
programs, and inside a model compiled with ``torch.compile(backend="tpu")`` Dynamo keeps them in
the graph and torchtpu's compiler makes the compute and its collectives one SPMD program
(``compile/spmd.py``), so a TP step stays one program per bucket.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)


class TpuCommunicator(DeviceCommunicatorBase):
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        return funcol.all_reduce(input_, "sum", self.device_group)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        if dim < 0:
            dim += input_.dim()
        out = funcol.all_gather_tensor(input_.movedim(dim, 0).contiguous(), 0,
                                       self.device_group)
        return out.movedim(0, dim).contiguous() if dim else out

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        if dim < 0:
            dim += input_.dim()
        out = funcol.reduce_scatter_tensor(input_.movedim(dim, 0).contiguous(), "sum", 0,
                                           self.device_group)
        return out.movedim(0, dim).contiguous() if dim else out
