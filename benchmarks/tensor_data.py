#!/usr/bin/env python
"""What ``Tensor.data`` costs now that it is a Python property (device/set_data.py).

Side by side in one process: PyTorch's own C getter/setter (``torch._C.TensorBase.data``,
called directly) against ``x.data`` / ``x.data = y`` through torchtpu's property, for a CPU
tensor (same-device assignments keep PyTorch's setter; only cpu <-> tpu takes the C++ helper),
and the cpu <-> tpu assignment itself (metadata only: no copy, no compile).

    python benchmarks/tensor_data.py
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import Table, Timer, environment  # noqa: E402


def main():
    c_data = torch._C.TensorBase.__dict__["data"]
    assert isinstance(torch.Tensor.__dict__["data"], property), "torchtpu is not loaded"
    t = Timer()
    x, y = torch.randn(16), torch.randn(16)
    table = Table("Tensor.data: PyTorch's C descriptor vs torchtpu's property (us per call)",
                  ["pytorch", "torchtpu"])
    table.add("get x.data", {"pytorch": t.per_call_us(lambda: c_data.__get__(x)),
                             "torchtpu": t.per_call_us(lambda: x.data)})

    def set_torch():
        c_data.__set__(x, y)

    def set_ours():
        x.data = y

    table.add("set x.data = y (cpu)", {"pytorch": t.per_call_us(set_torch),
                                       "torchtpu": t.per_call_us(set_ours)})
    p = torch.nn.Parameter(torch.randn(16))
    p.data = p.to("tpu")  # builds or loads the C++ helper first
    cpu, dev = torch.randn(16), torch.randn(16, device="tpu")

    def across():
        p.data = cpu
        p.data = dev

    table.add("p.data = t cpu<->tpu (x2)", {"torchtpu": t.per_call_us(
        across, sync=torch.tpu.synchronize)})
    table.notes.append(environment())
    table.notes.append(t.noise_note())
    table.print(ratios=[("torchtpu", "pytorch")])


if __name__ == "__main__":
    main()
