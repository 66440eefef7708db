"""One GRPO actor update on a fixed batch, by VeRL's own actor code, written as JSON.

    torchrun --nproc_per_node=1 ppo_update.py OUT.json <SFT trainer overrides...>

VeRL's SFT trainer builds the FSDP2 engine from its config (the same engine, ``TrainingWorker``
and FSDP2 wrapping the GRPO actor uses); this script then swaps its loss for VeRL's ``ppo_loss``
with the actor settings of ``recipes.grpo`` (KL loss 0.001 low_var_kl, no entropy term) and runs
what VeRL's PPO trainer runs for an actor update: old log-probs by ``infer_batch``, GRPO
advantages by ``compute_grpo_outcome_advantage`` from fixed scores, ``train_mini_batch`` on the
no-padding batch, then the log-probs again. The batch (prompt and response tokens, scores) is
drawn from a fixed seed, so a "tpu" run and a CPU run (tests/verl_scripts/cpu_platform.py) see
the same input and must agree.
"""
from __future__ import annotations

import json
import os
import sys
from functools import partial

import hydra
import numpy as np
import torch

PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 4, 4, 6, 5


def fixed_batch(vocab, pad_id):
    """GRPO's padded layout: left-padded prompts, right-padded responses, ``N`` samples each."""
    g = torch.Generator().manual_seed(1234)  # tokens: ordinary words, past the 8 special ones
    rows = PROMPTS * N
    prompts = torch.full((rows, PROMPT_LEN), pad_id, dtype=torch.long)
    responses = torch.full((rows, RESPONSE_LEN), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, PROMPT_LEN, dtype=torch.long)
    response_mask = torch.zeros(rows, RESPONSE_LEN, dtype=torch.long)
    for p in range(PROMPTS):
        plen = 3 + p % (PROMPT_LEN - 2)
        prompt = torch.randint(8, vocab, (plen,), generator=g)
        for s in range(N):
            r = p * N + s
            prompts[r, PROMPT_LEN - plen:] = prompt
            prompt_mask[r, PROMPT_LEN - plen:] = 1
            rlen = 2 + (p + s) % (RESPONSE_LEN - 1)
            responses[r, :rlen] = torch.randint(8, vocab, (rlen,), generator=g)
            response_mask[r, :rlen] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    # one outcome score per response, 0 or 1, with both values in every group (nonzero advantages)
    scores = torch.tensor([float((r * 7 + r // N) % 3 == 0) for r in range(rows)])
    scores[::N] = 1.0
    scores[1::N] = 0.0
    index = np.array([str(r // N) for r in range(rows)], dtype=object)
    return dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                attention_mask=attention_mask, position_ids=position_ids,
                response_mask=response_mask), scores, index


def main(out_path, overrides):
    from verl.trainer import sft_trainer
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import auto_set_device
    from verl.utils.distributed import initialize_global_process_group
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    config_dir = os.path.join(os.path.dirname(sft_trainer.__file__), "config")
    with hydra.initialize_config_dir(config_dir=config_dir, version_base=None):
        config = hydra.compose(config_name="sft_trainer_engine", overrides=overrides)
    auto_set_device(config)
    initialize_global_process_group()
    trainer = sft_trainer.SFTTrainer(config=config)
    worker = trainer.training_client
    actor = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=PROMPTS, rollout_n=N,
                            ppo_micro_batch_size_per_gpu=PROMPTS * N,
                            use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
                            entropy_coeff=0.0)
    worker.set_loss_fn(partial(ppo_loss, config=actor))

    # the GRPO recipe's micro batches: one of 16 rows, for the log-probs and the update
    micro = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=PROMPTS * N,
                 max_token_len_per_gpu=16384, temperature=1.0)
    tok = trainer.model_config.tokenizer
    padded, scores, index = fixed_batch(len(tok), tok.pad_token_id)

    def log_probs():
        td = left_right_2_no_padding(tu.get_tensordict(dict(padded)))
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, **micro)
        lp = tu.get(worker.infer_batch(td), "log_probs")
        return no_padding_2_padding(lp, td).float().cpu()

    old = log_probs()
    mask = padded["response_mask"]
    token_scores = torch.zeros(mask.shape)
    token_scores[torch.arange(len(scores)), mask.sum(1) - 1] = scores
    advantages, _ = compute_grpo_outcome_advantage(token_scores, mask, index)

    td = tu.get_tensordict({**padded, "old_log_probs": old, "ref_log_prob": old,
                            "advantages": advantages})
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False,
                         distillation_only=False, global_batch_size=PROMPTS * N,
                         mini_batch_size=PROMPTS * N, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True, **micro)
    metrics = tu.get(worker.train_mini_batch(td), "metrics")
    new = log_probs()

    def scalar(v):
        v = v[0] if isinstance(v, list) else v
        return float(v.item() if hasattr(v, "item") else v)

    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"metrics": {k: scalar(v) for k, v in metrics.items()
                                   if k in ("pg_loss", "grad_norm", "kl_loss", "ppo_kl")
                                   or k.endswith(("/pg_loss", "/grad_norm"))},
                       "old": old[mask.bool()].tolist(), "new": new[mask.bool()].tolist(),
                       "advantages": advantages[mask.bool()].tolist()}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
