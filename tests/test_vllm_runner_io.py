"""The vLLM runner's per-step transfers on "tpu" (torchtpu/vllm/model_runner.py): the step's
packed int32 inputs go to the device through jax's batched transfer (``_put_int32``, fewer host
layers than ``tensor_from_numpy``), and the program's ids / logits come back as their arrays
(``_read``); both give what the documented paths give, and fall back to them for anything
else. Needs vLLM (the runner module imports it): run in .venv-vllm."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.eager.copy import tensor_from_numpy

pytest.importorskip("vllm")
from torchtpu.vllm import model_runner as M  # noqa: E402

from helpers import counter  # noqa: E402


def test_step_inputs_take_the_batched_transfer_and_hold_their_values():
    host = np.arange(-7, 3000, dtype=np.int32)
    fast, total = counter("vllm_inputs_fast_transfers"), counter("transfers_host_to_device")
    t = M._put_int32(host.copy())
    assert counter("vllm_inputs_fast_transfers") == fast + 1
    assert counter("transfers_host_to_device") == total + 1
    assert t.device.type == "tpu" and t.dtype == torch.int32 and t.shape == (host.size,)
    assert torch.equal(t.cpu(), torch.from_numpy(host))
    assert torch.equal(t.cpu(), tensor_from_numpy(host.copy()).cpu())
    # a program reads it as any tpu tensor (slices, views, arithmetic)
    assert torch.equal((t[5:9] * 2).cpu(), torch.from_numpy(host[5:9] * 2))
    assert torch.equal(t[7:].view(torch.float32).view(torch.int32).cpu(),
                       torch.from_numpy(host[7:]))
    # another length (another token bucket) in the same process
    h2 = np.arange(33, dtype=np.int32)
    assert torch.equal(M._put_int32(h2.copy()).cpu(), torch.from_numpy(h2))


def test_other_arrays_and_a_failing_fast_path_take_tensor_from_numpy(monkeypatch):
    fast = counter("vllm_inputs_fast_transfers")
    for host in (np.arange(12, dtype=np.int64), np.arange(12, dtype=np.int32).reshape(3, 4),
                 np.linspace(0, 1, 5, dtype=np.float32)):
        t = M._put_int32(host.copy())
        assert t.device.type == "tpu" and torch.equal(t.cpu(), torch.from_numpy(host))
    assert counter("vllm_inputs_fast_transfers") == fast

    def broken(host):
        raise TypeError("jax moved its internals")

    monkeypatch.setitem(M._FAST_PUT, 0, broken)
    host = np.arange(40, dtype=np.int32)
    t = M._put_int32(host.copy())
    assert torch.equal(t.cpu(), torch.from_numpy(host))
    assert M._FAST_PUT[0] is False  # not tried again
    assert counter("vllm_inputs_fast_transfers") == fast


def test_reads_equal_cpu_for_whole_arrays_and_views():
    x = torch.arange(24, dtype=torch.int32).to("tpu") * 3  # a program's output
    syncs = counter("host_syncs")
    got = M._read(x)
    assert counter("host_syncs") == syncs + 1
    assert got.device.type == "cpu" and torch.equal(got, torch.arange(24, dtype=torch.int32) * 3)
    got[0] = 99  # the host copy is the caller's
    assert int(x[0].cpu()) == 0
    logits = torch.randn(6, 5).to("tpu") + 0
    assert torch.equal(M._read(logits), logits.cpu())
    for view in (logits[:4], logits[2:], logits.t(), logits.view(torch.int32), x.view(4, 6)[1]):
        assert torch.equal(M._read(view), view.cpu())
    cpu = torch.arange(3)
    assert torch.equal(M._read(cpu), cpu)
