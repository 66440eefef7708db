"""GRPO's reward for tiny_setup.py's arithmetic prompts (VeRL ``custom_reward_function``).

Checkable: 1.0 when the response names the right answer ("what is three plus four" -> a word
"seven"). A tiny random model rarely does, so a shaping term gives GRPO a gradient it can follow
within a few steps: 0.5 x the fraction of the response's words that are number words. Both terms
are read from the decoded text only.
"""
from __future__ import annotations

NUMBERS = frozenset(("zero one two three four five six seven eight nine ten eleven twelve "
                     "thirteen fourteen fifteen sixteen seventeen eighteen").split())


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    words = [w for w in solution_str.replace("<|im_end|>", " ").split() if not w.startswith("<")]
    correct = 1.0 if ground_truth in words else 0.0
    numeric = sum(w in NUMBERS for w in words) / max(len(words), 1)
    return {"score": correct + 0.5 * numeric, "acc": correct, "numeric": numeric}
