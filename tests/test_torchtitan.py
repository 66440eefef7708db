"""TorchTitan (its PyPI release, pinned in the ``test`` extra) on "tpu": the llama3 debug model
trains a few steps with TorchTitan's own trainer, 1 process and FSDP over 2 processes
(torchrun), pipeline parallelism 2 (1F1B; Interleaved1F1B) on 2 processes and
pipeline x FSDP on 4, and so does the DeepSeek-V3 MoE debug model (1 process; 2 with expert parallelism);
their losses match the same run on CPU with gloo (tests/dist_scripts/titan_train.py: generated
tokenizer and data, the same initial weights). Each run takes minutes on this machine (eager,
one XLA program per op): all are slow tests. The pieces they need are covered by fast tests
here, in test_flex_attention.py and test_grouped_mm.py."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

import dist_launch as dl

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan is not installed (pip install -e .[test])")
SCRIPT = os.path.join(dl.SCRIPTS, "titan_train.py")
STEPS = 3


def test_torchtitan_picks_tpu_and_tpu_dist():
    """TorchTitan's device utilities and its backend choice see "tpu" / "tpu_dist"; its
    Triton-only kernels module imports without Triton and raises when called."""
    from torchtitan.tools import utils

    assert utils.device_type == "tpu"
    assert utils.device_module is torch.tpu
    import torch.distributed as dist

    assert dist.Backend.default_device_backend_map["tpu"] == "tpu_dist"
    if importlib.util.find_spec("triton") is None:
        from torchtitan.distributed.minimal_async_ep import kernels

        with pytest.raises(RuntimeError, match="Triton is not installed"):
            kernels.copy_rows_to_peers_kernel()
    from torchtitan.models.llama3 import model_registry

    assert model_registry("debugmodel").name == "llama3"


# TorchTitan 0.3.0's default SPMD backend ("spmd_types") passes dp_mesh_dims to fully_shard, which
# torch 2.13's FSDP2 accepts only for DTensor parameters (CPU gloo fails the same way): use the
# DTensor backend TorchTitan also offers
FSDP_ARGS = ("--parallelism.spmd_backend", "partial_dtensor")


def _train(tmp_path, device, nproc, timeout, *extra):
    out = str(tmp_path / f"{device}_{nproc}.json")
    work = str(tmp_path / "work")
    os.makedirs(work, exist_ok=True)
    if nproc == 1:
        code, log = dl.run([sys.executable, SCRIPT, device, out, work, str(STEPS), *extra],
                           timeout)
    else:
        code, log = dl.torchrun("titan_train.py", device, out, work, str(STEPS), *extra,
                                nproc=nproc, timeout=timeout)
    assert code == 0 and "ALL OK" in log, log[-6000:]
    with open(out) as f:
        return json.load(f)


def _compare(tpu, cpu):
    assert len(tpu["loss"]) == len(cpu["loss"]) == STEPS
    torch.testing.assert_close(torch.tensor(tpu["loss"]), torch.tensor(cpu["loss"]),
                               rtol=1e-5, atol=1e-5)
    # gradients compared through their float64-summed norm; TorchTitan's own float32
    # norm on tpu must equal it (CPU's float32 norm was off by 1.8e-4: see titan_train.py)
    torch.testing.assert_close(torch.tensor(tpu["grad_norm64"]), torch.tensor(cpu["grad_norm64"]),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(tpu["grad_norm"]), torch.tensor(tpu["grad_norm64"],
                                                                          dtype=torch.float32),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_llama3_debug_one_process_matches_cpu(tmp_path):
    cpu = _train(tmp_path, "cpu", 1, 900)
    tpu = _train(tmp_path, "tpu", 1, 1200)
    assert tpu["device"] == "tpu:0"
    _compare(tpu, cpu)


@pytest.mark.slow
def test_llama3_debug_fsdp_two_processes_matches_cpu_gloo(tmp_path):
    cpu = _train(tmp_path, "cpu", 2, 900, *FSDP_ARGS)
    tpu = _train(tmp_path, "tpu", 2, 1500, *FSDP_ARGS)
    _compare(tpu, cpu)


# Pipeline parallelism: 2 stages on 2 ranks, TorchTitan's 1F1B schedule (its ParallelismConfig
# default; the llama3 debug config's Interleaved1F1B puts 2 stages on each rank), 2 microbatches
# of 1 sequence. On "tpu" the integration turns TorchTitan's CUDA graphs off (its config refuses
# PP while they are on); the CPU reference, plain PyTorch, needs the flag
PP_ARGS = ("--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.pipeline_parallel_schedule", "1F1B")


# the llama3 debug config's own schedule: Interleaved1F1B, 2 stages per rank (4 in all), fed 4
# microbatches (local batch 4)
INTERLEAVED_ARGS = ("--parallelism.pipeline_parallel_degree", "2",
                    "--training.local_batch_size", "4")


@pytest.mark.slow
@pytest.mark.parametrize("args", [PP_ARGS, INTERLEAVED_ARGS], ids=["1F1B", "Interleaved1F1B"])
def test_llama3_debug_pipeline_two_processes_matches_cpu_gloo(tmp_path, args):
    cpu = _train(tmp_path, "cpu", 2, 900, *args, "--training.disable_cuda_graphs")
    tpu = _train(tmp_path, "tpu", 2, 1500, *args)
    assert tpu["device"] == "tpu:1"  # the last stage's rank reports the loss
    assert tpu["dist_calls"].get("send/recv", 0) > 0, tpu["dist_calls"]  # activations, grads
    _compare(tpu, cpu)


@pytest.mark.slow
def test_llama3_debug_pipeline_x_fsdp_four_processes_matches_cpu_gloo(tmp_path):
    """2-D: pipeline 2 (outer) x FSDP 2 on 4 ranks; each stage's parameters sharded over its 2
    data-parallel ranks, microbatches sent between the stages' ranks."""
    args = (*PP_ARGS, *FSDP_ARGS, "--parallelism.data_parallel_shard_degree", "2")
    cpu = _train(tmp_path, "cpu", 4, 1200, *args, "--training.disable_cuda_graphs")
    tpu = _train(tmp_path, "tpu", 4, 1800, *args)
    assert tpu["device"] == "tpu:3"
    calls = tpu["dist_calls"]
    assert calls.get("send/recv", 0) > 0 and calls.get("reduce_scatter_tensor", 0) > 0, calls
    _compare(tpu, cpu)


def test_integration_turns_cuda_graphs_off_and_schedules_take_microbatches():
    """On "tpu" TorchTitan's config needs no --training.disable_cuda_graphs for pipeline
    parallelism (CUDA graphs are a no-op off CUDA); torch's schedules take TorchTitan's
    pre-split microbatches (``step(arg_mbs=..., target_mbs=...)``) with the whole-batch
    results, and a call mixing both forms raises."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel", *PP_ARGS])
    assert config.training.disable_cuda_graphs
    config._validate_cuda_graphs()  # what the trainer calls again: no error

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        ref = torch.nn.Linear(8, 3)
        runs = {}
        for form in ("batch", "mbs"):
            mod = torch.nn.Linear(8, 3)
            mod.load_state_dict(ref.state_dict())
            stage = PipelineStage(mod, 0, 1, torch.device("cpu"))
            sched = Schedule1F1B(stage, 2, loss_fn=torch.nn.functional.mse_loss)
            losses = []
            if form == "batch":
                sched.step(x, target=y, losses=losses)
            else:
                sched.step(arg_mbs=[(x[:2],), (x[2:],)], kwarg_mbs=[{}, {}],
                           target_mbs=[y[:2], y[2:]], losses=losses, return_outputs=False)
            runs[form] = (torch.stack(losses), mod.weight.grad.clone())
        torch.testing.assert_close(runs["mbs"], runs["batch"])
        with pytest.raises(TypeError, match="not both"):
            sched.step(x, arg_mbs=[(x[:2],), (x[2:],)])
    finally:
        dist.destroy_process_group()


# The MoE debug model (DeepSeek-V3 flavor: MLA attention, 8 routed experts top-3 plus shared
# experts; its experts run torch._grouped_mm in bfloat16, lowering/grouped_mm.py). TorchTitan's
# config check refuses its all-to-all token dispatcher while CUDA graphs are enabled (they are by
# default, and do nothing on "tpu" or CPU): --training.disable_cuda_graphs
MOE_ARGS = ("--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
            "--training.disable_cuda_graphs")


def _moe_facts(tpu, experts_local):
    assert tpu["experts_total"] == 8 and tpu["experts_local"] == experts_local
    assert tpu["cpu_fallbacks"] == {}, tpu["cpu_fallbacks"]
    assert tpu["compile_cpu_fallbacks"] == {}, tpu["compile_cpu_fallbacks"]


@pytest.mark.slow
def test_deepseek_v3_moe_debug_one_process_matches_cpu(tmp_path):
    cpu = _train(tmp_path, "cpu", 1, 900, *MOE_ARGS)
    tpu = _train(tmp_path, "tpu", 1, 1500, *MOE_ARGS)
    assert tpu["device"] == "tpu:0"
    _moe_facts(tpu, 8)
    _compare(tpu, cpu)


@pytest.mark.slow
def test_deepseek_v3_moe_debug_compiled_one_process_matches_cpu(tmp_path):
    """TorchTitan's --compile.enable (each block through torch.compile, routed to the tpu
    backend): MoE blocks as compiled graphs (_grouped_mm, the deterministic scatter-add of the
    combine, complex RoPE's _conj) against CPU's eager run."""
    cpu = _train(tmp_path, "cpu", 1, 900, *MOE_ARGS)
    tpu = _train(tmp_path, "tpu", 1, 1500, *MOE_ARGS, "--compile.enable")
    _moe_facts(tpu, 8)
    assert tpu["compile_graphs"] > 0
    _compare(tpu, cpu)


@pytest.mark.slow
def test_deepseek_v3_moe_expert_parallel_two_processes_matches_cpu_gloo(tmp_path):
    """Expert parallelism 2 (FSDP over the same 2 ranks): each rank holds 4 of the 8 experts,
    tokens travel by all_to_all_single with uneven splits (TorchTitan's non-Triton dispatcher)."""
    args = (*MOE_ARGS, *FSDP_ARGS, "--parallelism.expert_parallel_degree", "2")
    cpu = _train(tmp_path, "cpu", 2, 900, *args)
    tpu = _train(tmp_path, "tpu", 2, 2400, *args)
    _moe_facts(tpu, 4)
    assert tpu["dist_calls"].get("all_to_all_single", 0) > 0
    _compare(tpu, cpu)


def test_complex_rope_backward_compiles_and_conj_views_reach_numpy():
    """Compiled complex RoPE (DeepSeek-V3's) differentiates through ``_conj`` views: the graph
    op has a lowering (as a CPU callback it crashed on the conjugate bit), and a CPU op's
    conjugated result converts to its value."""
    from torchtpu.lowering import hops

    def f(x, y):
        return torch.view_as_real(x * y).square().sum()

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4, 3, dtype=torch.cfloat, generator=g) for _ in range(2))
    xt, xc = x.to("tpu").requires_grad_(), x.clone().requires_grad_()
    before = torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0)
    torch.compile(f, backend="tpu")(xt, y.to("tpu")).backward()
    f(xc, y).backward()
    torch.testing.assert_close(xt.grad.cpu(), xc.grad)
    assert torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0) == before
    c = torch.randn(3, dtype=torch.cfloat, generator=g)
    assert (hops.torch_to_np(c.conj()) == c.numpy().conj()).all()
    assert (hops.torch_to_np(torch._neg_view(c)) == -c.numpy()).all()


def test_deterministic_scatter_add_is_lowered_in_compiled_graphs():
    """TorchTitan's MoE combine op runs inside compiled graphs (no CPU callback), forward and
    backward equal to CPU; an index out of range raises as scatter_add's does."""
    from torchtitan.ops.scatter_add import deterministic_scatter_add as dsa

    g = torch.Generator().manual_seed(0)
    out, src = torch.zeros(5, 3), torch.randn(4, 3, generator=g)
    idx = torch.tensor([0, 2, 0, 4]).view(-1, 1).expand(-1, 3)

    def f(o, i, s):
        return dsa(o, i, s).square().sum()

    st, sc = src.to("tpu").requires_grad_(), src.clone().requires_grad_()
    before = torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0)
    loss = torch.compile(f, backend="tpu")(out.to("tpu"), idx.to("tpu"), st)
    loss.backward()
    want = f(out, idx, sc)
    want.backward()
    torch.testing.assert_close(loss.cpu(), want)
    torch.testing.assert_close(st.grad.cpu(), sc.grad)
    assert torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks", 0) == before
    bad = torch.compile(lambda o, i, s: dsa(o, i, s), backend="tpu")(
        out.to("tpu"), torch.full((4, 3), 7, device="tpu"), st.detach())
    with pytest.raises(RuntimeError, match="index out of bounds"):
        bad.cpu()
