"""Hugging Face ``Trainer`` / accelerate on "tpu" with no environment variable and no code change.

A tiny random-weight Llama (built from a config, no downloads) is trained by ``Trainer`` on
"tpu" and, from the same weights, on CPU (``use_cpu=True``); per-step losses, evaluation losses
and final parameters must agree at float32 tolerance. Also: gradient accumulation, checkpoint
save and resume, ``bf16=True`` (autocast "tpu"), ``torch_compile`` with backend "tpu", and
``from_pretrained(device_map="auto" | "tpu")``. accelerate and transformers come with the
``test`` extra; without them this file is skipped.
"""
from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

logging.getLogger("transformers").setLevel(logging.ERROR)
VOCAB = 64


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=1,
        eos_token_id=2, pad_token_id=0))


class Data(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, 8), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(out, cpu, **kw):
    kw = {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, "max_steps": 4,
          "learning_rate": 1e-2, "logging_steps": 1, "report_to": [], "save_strategy": "no",
          "disable_tqdm": True, "use_cpu": cpu, **kw}
    return transformers.TrainingArguments(output_dir=str(out), **kw)


def losses(trainer):
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


def eval_losses(trainer):
    return torch.tensor([h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h])


def assert_params_close(cpu_model, tpu_model):
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        assert pt.device.type == "tpu", n
        torch.testing.assert_close(pt.detach().cpu(), pc.detach(), msg=lambda m: f"{n}: {m}")


def train(out, cpu, model=None, resume=None, **kw):
    model = llama() if model is None else model
    t = transformers.Trainer(model=model, args=args(out, cpu, **kw),
                             train_dataset=Data(24, 1), eval_dataset=Data(8, 2))
    t.train(resume_from_checkpoint=resume)
    return t


def test_train_evaluate_accumulate_save_resume_match_cpu(tmp_path):
    assert "ACCELERATE_TORCH_DEVICE" not in os.environ
    kw = dict(gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2,
              save_strategy="steps", save_steps=2)
    cpu = train(tmp_path / "cpu", True, **kw)
    tpu = train(tmp_path / "tpu", False, **kw)
    assert tpu.args.device.type == "tpu" and tpu.accelerator.device.type == "tpu"
    assert cpu.args.device.type == "cpu" and next(cpu.model.parameters()).device.type == "cpu"
    assert len(losses(tpu)) == 4 and len(eval_losses(tpu)) == 2
    torch.testing.assert_close(losses(tpu), losses(cpu))
    torch.testing.assert_close(eval_losses(tpu), eval_losses(cpu))
    assert_params_close(cpu.model, tpu.model)
    # resume from the step-2 checkpoint: steps 3 and 4 again, same losses and weights
    resumed = train(tmp_path / "tpu", False, resume=str(tmp_path / "tpu" / "checkpoint-2"), **kw)
    assert resumed.state.global_step == 4
    torch.testing.assert_close(losses(resumed)[-2:], losses(cpu)[-2:])
    assert_params_close(cpu.model, resumed.model)


@pytest.mark.slow
def test_bf16_autocasts_on_tpu(tmp_path):
    seen = []

    def record(module, inputs):
        seen.append((torch.is_autocast_enabled("tpu"), torch.get_autocast_dtype("tpu")))

    model = llama()
    cpu_model = copy.deepcopy(model)
    model.model.register_forward_pre_hook(record)  # inside the autocast-wrapped forward
    tpu = train(tmp_path / "tpu", False, model=model, bf16=True, max_steps=2)
    cpu = train(tmp_path / "cpu", True, model=cpu_model, bf16=True, max_steps=2)
    assert tpu.accelerator.native_amp and seen and set(seen) == {(True, torch.bfloat16)}
    # CPU and tpu autocast cast different op lists to bfloat16: agreement to bf16 precision
    torch.testing.assert_close(losses(tpu), losses(cpu), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("backend", [
    "tpu", pytest.param(None, id="default")])
def test_torch_compile(tmp_path, backend):
    """torch_compile_backend="tpu", or none: transformers picks Inductor, routed to "tpu".
    SGD, not AdamW: AdamW's first steps move every weight by about lr whatever its gradient's
    size, and by g / (|g| + eps) when |g| is near eps, so one q_proj weight whose gradient is
    exactly 0 at the first step (and tiny at the second) moved 2.2e-5 apart from CPU's on one
    host (the same with the previous session's tree: CPU's own rounding differs by host); with
    SGD the weights compare what the compiled step computed."""
    compiled = []
    orig = torch.compile

    def spy(model=None, *a, **kw):
        compiled.append(kw.get("backend"))
        return orig(model, *a, **kw)

    torch._dynamo.reset()
    torch.tpu.reset_metrics()
    torch.compile = spy
    try:
        tpu = train(tmp_path / "tpu", False, torch_compile=True, torch_compile_backend=backend,
                    max_steps=2, optim="sgd", learning_rate=0.05)
    finally:
        torch.compile = orig
        torch._dynamo.reset()
    cpu = train(tmp_path / "cpu", True, max_steps=2, optim="sgd", learning_rate=0.05)
    assert compiled == [backend or "inductor"]
    c = torch.tpu.metrics()["counters"]  # steps ran as compiled programs
    assert c.get("compile_cache_misses", 0) > 0 and c.get("compile_cache_hits", 0) > 0, c
    torch.testing.assert_close(losses(tpu), losses(cpu))
    assert_params_close(cpu.model, tpu.model)


@pytest.mark.parametrize("device_map", ["auto", "tpu"])
def test_from_pretrained_device_map(tmp_path, device_map):
    llama().save_pretrained(tmp_path)
    cpu_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map)
    assert {p.device.type for p in model.parameters()} == {"tpu"}
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to("tpu")).logits.cpu(), cpu_model(ids).logits)


def test_accelerate_picks_tpu_unless_cpu_is_asked():
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DynamoBackend, get_max_memory

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        assert PartialState().device == torch.device("tpu", 0)
        AcceleratorState._reset_state(reset_partial_state=True)
        assert PartialState(cpu=True).device.type == "cpu"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert DynamoBackend("TPU").value.lower() == "tpu"
    mem = get_max_memory()
    assert set(k for k in mem if isinstance(k, int)) == set(range(torch.tpu.device_count()))
    assert 0 < mem[0] <= torch.tpu.mem_get_info(0)[1]
    assert get_max_memory({0: "1GiB"}) == {0: 1 << 30}


DDP_SCRIPT = '''
import json, os, sys
import torch, transformers
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=64, max_position_embeddings=16, bos_token_id=1,
    eos_token_id=2, pad_token_id=0))
ids = torch.randint(3, 64, (32, 8), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": x, "labels": x} for x in ids]
world = int(os.environ.get("WORLD_SIZE", 1))
args = transformers.TrainingArguments(
    output_dir=sys.argv[1], per_device_train_batch_size=8 // world, max_steps=3,
    learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
    use_cpu=sys.argv[2] == "cpu")  # ddp_find_unused_parameters unset: Trainer's default
trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
trainer.train()
if trainer.is_world_process_zero():
    with open(os.path.join(sys.argv[1], "result.json"), "w") as f:
        json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "device": str(args.device), "world": args.world_size,
                   "mode": str(args.parallel_mode),
                   "find_unused": getattr(trainer.model_wrapped, "find_unused_parameters",
                                          None)}, f)
'''


@pytest.mark.slow
def test_trainer_ddp_under_torchrun(tmp_path):
    """torchrun with two processes: accelerate joins them in a "tpu_dist" process group (it
    found no backend for "tpu", and each rank trained alone); Trainer's default DDP
    (find_unused_parameters=True) works; losses equal one CPU process with the combined
    batch."""
    import json
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    results = {}
    for name, cmd in (("cpu", [sys.executable, str(script)]),
                      ("tpu", [sys.executable, "-m", "torch.distributed.run",
                               "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                               "--master_port", str(port), str(script)])):
        out = tmp_path / name
        out.mkdir()
        # own process group: on a timeout the launcher and its ranks are stopped together
        proc = subprocess.Popen([*cmd, str(out), name], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            pytest.fail(f"{name} run did not finish in 600 s:\n{log[-3000:]}")
        assert proc.returncode == 0, log[-3000:]
        results[name] = json.loads((out / "result.json").read_text())
    tpu, cpu = results["tpu"], results["cpu"]
    assert tpu["device"] == "tpu:0" and tpu["world"] == 2 and tpu["mode"].endswith("DISTRIBUTED")
    assert tpu["find_unused"] is True  # Trainer's default DDP(find_unused_parameters=True)
    assert cpu["world"] == 1 and len(cpu["losses"]) == 3
    torch.testing.assert_close(torch.tensor(tpu["losses"]), torch.tensor(cpu["losses"]))
