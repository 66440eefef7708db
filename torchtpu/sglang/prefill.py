"""Prefill (extend) through bucketed compiled programs: SGLang's extend forward on "tpu".

An extend step's shapes are its token count (the new tokens of all its requests) and its
request count; compiled per exact shape, nearly every step would compile. ``TpuPrefillRunner``
pads both to *buckets* (powers of two: tokens from ``MIN_TOKENS`` up to the scheduler's
largest extend, requests up to the request pool) and serves the step with the bucket's
``torch.compile(backend="tpu")`` program of the whole extend forward (the paged attention
metadata built on the device, the model, the logits of each request's last token), compiled
the first time the bucket is met, from the compile cache after a restart. Padding: tokens
``0`` at position 0 writing their KV to SGLang's reserved slot 0 and lying past the last
request (the attention op gives them zeros), requests of length 0 on request slot 0 (no
token, so nothing reads their logits); the first ``n`` rows of the logits are returned.

It is reached through SGLang's hook registry around ``EagerRunner._execute_extend`` (the
platform's ``plugin()``), the eager extend path of SGLang's model runner; a step it cannot
serve (log probabilities, hidden-state capture, input embeddings, speculative or
context-parallel batches, more tokens than the largest bucket, another attention backend,
more than one rank) runs eagerly there, as before. ``TORCHTPU_SGLANG_COMPILE_PREFILL=0``
turns it off.
"""
from __future__ import annotations

import logging
import os
import time

import torch
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import (
    ForwardContext,
    forward_context,
    get_forward_context,
    has_forward_context,
)

from .attention import kv_width
from .graph_runner import _dynamo_counts, _pad, _raise_recompile_limit, inactive_reason

logger = logging.getLogger(__name__)

MIN_TOKENS = 16
DEFAULT_MAX_TOKENS = 8192


def _pow2_at_least(n: int, lo: int = 1) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


class TpuPrefillRunner:
    """One compiled extend program per (token bucket, request bucket, KV width)."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.reason = None
        if os.environ.get("TORCHTPU_SGLANG_COMPILE_PREFILL", "1") == "0":
            self.reason = "TORCHTPU_SGLANG_COMPILE_PREFILL=0"
        else:
            self.reason = inactive_reason(model_runner) or (
                None if model_runner.is_generation else "an embedding model")
        if self.reason is not None:
            logger.warning("torchtpu: prefill runs eagerly (%s)", self.reason)
        sa = model_runner.server_args
        top = max(int(getattr(sa, "chunked_prefill_size", 0) or 0),
                  int(getattr(sa, "max_prefill_tokens", 0) or 0))
        self.max_tokens = _pow2_at_least(top if top > 0 else DEFAULT_MAX_TOKENS, MIN_TOKENS)
        self.max_reqs = int(model_runner.req_to_token_pool.size)
        self.kv_full = int(model_runner.req_to_token_pool.req_to_token.shape[1])
        self.page_size = int(model_runner.page_size)
        self.batches: dict = {}
        self.dynamo: dict = {}  # "tokens x requests" -> Dynamo's counts at its first call
        self.compile_s: dict = {}
        self.served = 0  # extend steps run through a bucket's program
        # one Dynamo cache entry per bucket: past the recompile limit the frame would run
        # eagerly for good
        n = (self.max_tokens.bit_length() - MIN_TOKENS.bit_length() + 1) * (
            self.max_reqs.bit_length() + 1) * 8
        _raise_recompile_limit(n)
        self._program = torch.compile(self._step, backend="tpu", dynamic=False)

    def bucket(self, forward_batch):
        """The (tokens, requests) bucket that serves ``forward_batch``, or None (eager)."""
        fb = forward_batch
        if (self.reason is not None or fb.input_ids is None or fb.input_embeds is not None
                or fb.return_logprob or getattr(fb, "spec_info", None) is not None
                or fb.capture_hidden_mode not in (None, CaptureHiddenMode.NULL)
                or getattr(fb, "mrope_positions", None) is not None
                or fb.extend_seq_lens is None or getattr(fb, "attn_cp_metadata", None)
                or not fb.forward_mode.is_extend() or fb.forward_mode.is_target_verify()
                or fb.forward_mode.is_draft_extend_v2()
                or getattr(fb, "token_indices_to_pool", None) is not None
                or getattr(fb, "replace_embeds", None) is not None):
            return None
        n, b = int(fb.input_ids.shape[0]), int(fb.batch_size)
        if n > self.max_tokens or b > self.max_reqs or n == 0:
            return None
        return (_pow2_at_least(n, MIN_TOKENS), min(_pow2_at_least(b), self.max_reqs),
                kv_width(fb, self.page_size, self.kv_full))

    # ---- the program ----

    def _step(self, input_ids, positions, forward_batch):
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)
        return self.model_runner.model.forward(input_ids, positions, forward_batch)

    def _batch(self, tokens: int, reqs: int, width) -> ForwardBatch:
        """The bucket's forward batch (its tensors are replaced each step)."""
        dev, mr = self.device, self.model_runner

        def z(n):
            return torch.zeros((n,), dtype=torch.int64, device=dev)

        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=reqs, input_ids=z(tokens),
            req_pool_indices=z(reqs), seq_lens=torch.ones((reqs,), dtype=torch.int64,
                                                          device=dev),
            out_cache_loc=z(tokens), seq_lens_sum=reqs, return_logprob=False,
            positions=z(tokens), spec_algorithm=mr.spec_algorithm,
            capture_hidden_mode=CaptureHiddenMode.NULL, global_forward_mode=ForwardMode.EXTEND)
        fb.extend_num_tokens = tokens
        fb.extend_seq_lens = z(reqs)
        fb.extend_prefix_lens = z(reqs)
        fb.extend_start_loc = z(reqs)
        fb.torchtpu_kv_width = width  # attention.kv_width
        translator = getattr(mr, "kv_index_translator", None)
        if translator is not None:
            translator.bind_runner_slots(fb)
        return fb

    def execute(self, forward_batch, key):
        tokens, reqs, width = key
        fb = self.batches.get(key)
        if fb is None:
            fb = self.batches[key] = self._batch(tokens, reqs, width)
        n, b = int(forward_batch.input_ids.shape[0]), int(forward_batch.batch_size)
        pt, pb = tokens - n, reqs - b
        fb.input_ids = _pad(forward_batch.input_ids, pt, 0)
        fb.positions = _pad(forward_batch.positions, pt, 0)
        fb.out_cache_loc = _pad(forward_batch.out_cache_loc, pt, 0)
        fb.req_pool_indices = _pad(forward_batch.req_pool_indices, pb, 0)
        fb.seq_lens = _pad(forward_batch.seq_lens, pb, 1)
        fb.extend_seq_lens = _pad(forward_batch.extend_seq_lens, pb, 0)
        fb.extend_prefix_lens = _pad(forward_batch.extend_prefix_lens, pb, 1)
        ctx = get_forward_context() if has_forward_context() else ForwardContext(
            attn_backend=self.model_runner.attn_backend)
        name = f"{tokens}x{reqs}" + (f"x{width}" if width else "")
        first = name not in self.dynamo
        if first:
            before, t0 = _dynamo_counts(), time.perf_counter()
        with forward_context(ctx, forward_batch=fb):
            out = self._program(fb.input_ids, fb.positions, fb)
        if first:
            self.dynamo[name] = {k: v - before[k] for k, v in _dynamo_counts().items()}
            self.compile_s[name] = time.perf_counter() - t0
        self.served += 1
        if pb == 0:
            return out
        return type(out)(next_token_logits=out.next_token_logits[:b],
                         hidden_states=None if out.hidden_states is None
                         else out.hidden_states[:b])


def _runner(model_runner) -> TpuPrefillRunner:
    r = getattr(model_runner, "_torchtpu_prefill", None)
    if r is None:
        r = model_runner._torchtpu_prefill = TpuPrefillRunner(model_runner)
    return r


def execute_extend(original, eager_runner, forward_batch, pp_proxy_tensors=None, **kwargs):
    """Around SGLang's ``EagerRunner._execute_extend``: a bucket's program where one serves
    the batch, else SGLang's eager extend."""
    runner = _runner(eager_runner.model_runner)
    key = None if pp_proxy_tensors is not None or kwargs else runner.bucket(forward_batch)
    if key is None:
        return original(eager_runner, forward_batch, pp_proxy_tensors, **kwargs)
    return runner.execute(forward_batch, key)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend",
        execute_extend, HookType.AROUND)
