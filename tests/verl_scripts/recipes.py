"""The VeRL command lines the tests and benchmarks/rl_step.py run (VeRL's own entry points and
config keys; nothing here is torchtpu-specific but the Ray "TPU" resource count on a host whose
"TPU" is XLA:CPU, where Ray cannot detect chips), and a parser for VeRL's console metrics.
"""
from __future__ import annotations

import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
# float32 everywhere (no bf16 autocast): what a CPU reference can match
FP32 = ["+engine.mixed_precision.param_dtype=fp32", "+engine.mixed_precision.reduce_dtype=fp32",
        "+engine.mixed_precision.buffer_dtype=fp32"]


def sft(python, setup, out, nproc=1, steps=3, extra=()):
    """``torchrun -m verl.trainer.sft_trainer``: FSDP2, no-padding batches, 8 rows a step."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={nproc}", "-m", "verl.trainer.sft_trainer",
            f"data.train_files={setup}/sft_train.parquet", f"data.val_files={setup}/sft_val.parquet",
            "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "data.max_length=64",
            "data.pad_mode=no_padding", "data.use_dynamic_bsz=False", "data.num_workers=0",
            f"model.path={setup}/model", "model.enable_gradient_checkpointing=False",
            "engine.strategy=fsdp2", "optim.lr=1e-3", f"trainer.total_training_steps={steps}",
            "trainer.logger=[console]", f"trainer.default_local_dir={out}/ckpt",
            "trainer.project_name=tiny", "trainer.experiment_name=sft",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
            *extra]


def ppo_update(python, setup, out, result, extra=()):
    """``ppo_update.py``: one GRPO actor update on a fixed batch by VeRL's own actor code, in
    float32, with the GRPO recipe's learning rate and micro batch; the engine is built by the SFT
    trainer's config (the overrides of ``sft``), the result written to ``result`` as JSON."""
    args = sft(python, setup, out, steps=1)
    overrides = {a.split("=", 1)[0]: a for a in args[args.index("verl.trainer.sft_trainer") + 1:]}
    overrides.update({"optim.lr": "optim.lr=3e-3",
                      "data.micro_batch_size_per_gpu": "data.micro_batch_size_per_gpu=16"})
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            "--nproc_per_node=1", os.path.join(HERE, "ppo_update.py"), str(result),
            *overrides.values(), *FP32, *extra]


# SGLang's KV pool is sized from the device's memory by default, on XLA:CPU the host's (~10 GB
# for this tiny model, which Ray's memory monitor then kills): a step needs batch x n x 24 tokens
SGLANG = ["actor_rollout_ref.rollout.name=sglang",
          "+actor_rollout_ref.rollout.engine_kwargs.sglang.max_total_tokens=2048"]


def grpo(python, setup, out, nproc=1, steps=4, batch=8, n=4, extra=(), rollout="vllm"):
    """``python -m verl.trainer.main_ppo`` with GRPO: FSDP2 actor and reference on "tpu", the
    rollout served by vLLM on "tpu" (or SGLang on "tpu": ``rollout="sglang"``; hybrid engine:
    weights synchronised to it every step), ``batch`` prompts x ``n`` samples of up to 8 tokens
    per step, reward from reward.py."""
    engine = {"vllm": ["actor_rollout_ref.rollout.name=vllm"], "sglang": SGLANG}[rollout]
    return [python, "-m", "verl.trainer.main_ppo",
            "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
            f"data.train_files={setup}/rl_train.parquet", f"data.val_files={setup}/rl_val.parquet",
            f"data.train_batch_size={batch}", "data.max_prompt_length=16",
            "data.max_response_length=8", "data.filter_overlong_prompts=False",
            "data.dataloader_num_workers=0",
            f"actor_rollout_ref.model.path={setup}/model",
            "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
            "actor_rollout_ref.actor.optim.lr=3e-3",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
            *engine,
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.enforce_eager=True",
            "actor_rollout_ref.rollout.max_num_batched_tokens=512",
            "actor_rollout_ref.rollout.max_model_len=32",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            f"reward.custom_reward_function.path={HERE}/reward.py", "reward.num_workers=1",
            "trainer.critic_warmup=0", "trainer.logger=[console]", "trainer.val_before_train=False",
            f"trainer.n_gpus_per_node={nproc}", "trainer.nnodes=1",
            f"trainer.total_training_steps={steps}", "trainer.total_epochs=1",
            "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.project_name=tiny",
            f"trainer.experiment_name=grpo{nproc}", f"trainer.default_local_dir={out}/ckpt",
            "trainer.resume_mode=disable",
            # Ray detects TPU chips on TPU hosts; with XLA:CPU standing in, declare them
            f"+ray_kwargs.ray_init.resources={{TPU:{nproc}}}",
            # logical CPUs for VeRL's helper actors (TransferQueue storage, agent loop, reward)
            "+ray_kwargs.ray_init.num_cpus=32",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            *extra]


_STEP = re.compile(r"step:(\d+) - (.*)")
_METRIC = re.compile(r"([\w/@.()-]+):([-0-9.eE+]+|nan|inf)")


def metrics(text):
    """{step: {metric: value}} from VeRL's console logger (the first line of each step)."""
    out = {}
    for line in text.splitlines():
        m = _STEP.search(line)
        if m and int(m.group(1)) not in out:
            out[int(m.group(1))] = {k: float(v) for k, v in _METRIC.findall(m.group(2))}
    return out
