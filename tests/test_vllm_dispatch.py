"""torchtpu/vllm/dispatch.py: a bucket's compiled program called without Dynamo's guards once
built, and back through the guarded path when what the program captured changes. Runs
without vLLM (the dispatch is plain torch.compile)."""
from __future__ import annotations

import torch

import torchtpu  # noqa: F401
from torchtpu.vllm.dispatch import BucketDispatch


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, T: int, R: int):
        h = self.lin(x[:T])
        return h, h[T - R:].sum(dim=-1)


def _n(name, default=0):
    return torch.tpu.metrics()["counters"].get(name, default)


def _steps():
    m = _Net().to("tpu")
    return m, BucketDispatch(m, torch.compile(m, backend="tpu", fullgraph=True, dynamic=False))


def _check(d, m, x, T, R):
    ref = _Net()
    ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    h, s = d(x.to("tpu"), T, R)
    eh, es = ref(x, T, R)
    torch.testing.assert_close(h.cpu(), eh)
    torch.testing.assert_close(s.cpu(), es)


@torch.inference_mode()
def test_buckets_run_direct_after_their_first_call():
    torch._dynamo.reset()
    m, d = _steps()
    x = torch.randn(16, 8)
    before = {k: _n(k) for k in ("vllm_steps_direct", "vllm_steps_guarded")}
    for T, R in ((4, 2), (8, 4), (4, 2), (8, 4), (4, 2)):
        _check(d, m, x, T, R)
    got = {k: _n(k) - before[k]
           for k in ("vllm_steps_direct", "vllm_steps_guarded")}
    assert got == {"vllm_steps_direct": 3, "vllm_steps_guarded": 2}


@torch.inference_mode()
def test_weights_in_place_are_seen_and_replaced_ones_go_back_through_the_guards():
    torch._dynamo.reset()
    m, d = _steps()
    x = torch.randn(16, 8)
    _check(d, m, x, 4, 2)
    # in place (as vLLM's load_weights): the direct path reads the new values
    m.lin.weight.copy_(torch.randn(8, 8).to("tpu"))
    n = _n("vllm_steps_direct", 0)
    _check(d, m, x, 4, 2)
    assert _n("vllm_steps_direct", 0) == n + 1
    # a parameter replaced, then a changed dtype: guarded again (Dynamo decides), right values
    for new in (torch.randn(8, 8), torch.randn(8, 8, dtype=torch.float64)):
        m.lin.weight = torch.nn.Parameter(new.to("tpu"), requires_grad=False)
        if new.dtype == torch.float64:
            m.lin.bias = torch.nn.Parameter(m.lin.bias.double(), requires_grad=False)
            x = x.double()
        g = _n("vllm_steps_guarded", 0)
        ref = _Net().double() if new.dtype == torch.float64 else _Net()
        ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
        h, s = d(x.to("tpu"), 4, 2)
        torch.testing.assert_close(h.cpu(), ref(x, 4, 2)[0])
        assert _n("vllm_steps_guarded", 0) == g + 1
        _check(d, m, x, 4, 2) if new.dtype != torch.float64 else d(x.to("tpu"), 4, 2)
    # a new submodule (as LoRA wrapping a layer): guarded
    m.lin = torch.nn.Linear(8, 8).to("tpu")
    x = x.float()
    g = _n("vllm_steps_guarded", 0)
    _check(d, m, x, 4, 2)
    assert _n("vllm_steps_guarded", 0) == g + 1
