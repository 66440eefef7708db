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

The buckets are few enough to compile them all at start-up (``warm_up``, after SGLang's graph
capture, ``ModelRunner.init_cuda_graphs``): one per token bucket, whose request count and KV
width follow from its token count (a step of ``b`` requests has at least ``b`` tokens, and
without a cached prefix its longest sequence is at most its token count): requests padded to
``min(tokens, MAX_PADDED_REQS)`` (a single request: 1, for token buckets up to
``SINGLE_REQ_TOKENS``, so that its logits are not computed ``tokens`` times), the page table
at least as wide as the token bucket. Token buckets are warmed up to the chunked-prefill
size (``TORCHTPU_SGLANG_PREFILL_WARMUP_TOKENS`` sets another bound); only a step past those
(more tokens, more than ``MAX_PADDED_REQS`` requests, a cached prefix longer than the bucket)
compiles a program when first met. A decode-only (disaggregated) instance warms nothing;
``TORCHTPU_SGLANG_PREFILL_WARMUP=0`` neither.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
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

from sglang.srt.utils.common import DynamicGradMode

from .attention import MIN_KV_WIDTH, kv_width
from .positions import pad_on_host, remember_host
from .graph_runner import _dynamo_counts, _raise_recompile_limit, inactive_reason
from .working_set import WorkingSet, defer

logger = logging.getLogger(__name__)

MIN_TOKENS = 16
DEFAULT_MAX_TOKENS = 8192
MAX_PADDED_REQS = 64  # requests of a token bucket's program (fewer tokens: as many as tokens)
SINGLE_REQ_TOKENS = 64  # token buckets up to this also have a one-request program


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
        # warmed at start-up: up to the chunked-prefill size (an extend step's tokens when
        # SGLang chunks prompts), or TORCHTPU_SGLANG_PREFILL_WARMUP_TOKENS
        chunk = int(getattr(sa, "chunked_prefill_size", 0) or 0)
        warm = int(os.environ.get("TORCHTPU_SGLANG_PREFILL_WARMUP_TOKENS", "0") or 0)
        self.warm_tokens = min(self.max_tokens, _pow2_at_least(
            warm if warm > 0 else chunk if chunk > 0 else self.max_tokens, MIN_TOKENS))
        self.max_reqs = int(model_runner.req_to_token_pool.size)
        self.kv_full = int(model_runner.req_to_token_pool.req_to_token.shape[1])
        self.page_size = int(model_runner.page_size)
        self.batches: dict = {}
        self.dynamo: dict = {}  # "tokens x requests" -> Dynamo's counts at its first call
        self.compile_s: dict = {}
        self.warm_up_s = 0.0  # warm_up
        self.warmed: list = []  # names of the buckets warm_up compiled
        self.served = 0  # extend steps run through a bucket's program
        self.working_set = None  # warm_up's (working_set.py)
        self.deferred: list = []  # buckets warm_up left to the idle scheduler
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
        tokens = _pow2_at_least(n, MIN_TOKENS)
        reqs = self._reqs(tokens, single=b == 1)
        if b > reqs:  # more requests than the bucket pads to: compiled when first met
            reqs = min(_pow2_at_least(b), self.max_reqs)
        return tokens, reqs, self._width(tokens, kv_width(fb, self.page_size, self.kv_full))

    def _reqs(self, tokens: int, single: bool) -> int:
        """The request count a token bucket's program is padded to."""
        if single and tokens <= SINGLE_REQ_TOKENS:
            return 1
        return min(tokens, MAX_PADDED_REQS, self.max_reqs)

    def _width(self, tokens: int, width):
        """The KV width of a token bucket's program: at least the bucket (the longest
        sequence of a step without cached prefix), ``width`` where a prefix needs more; None:
        the whole table."""
        if width is None:
            return None
        w = -(-max(tokens, MIN_KV_WIDTH) // self.page_size) * self.page_size
        w = max(w, width)
        return w if w < self.kv_full else None

    def warm_buckets(self) -> list:
        """The (tokens, requests, KV width) keys compiled at start-up."""
        keys = []
        t = MIN_TOKENS
        while t <= self.warm_tokens:
            for single in (True, False):
                key = (t, self._reqs(t, single), self._width(t, MIN_KV_WIDTH))
                if key not in keys:
                    keys.append(key)
            t *= 2
        return keys

    def warm_up(self) -> None:
        """Compile (or load from the compile cache) every bucket of ``warm_buckets`` with an
        extend step of padding only (no token is real: its KV lands in slot 0), in SGLang's
        grad mode (Dynamo guards on it), after one eager step that fills what SGLang's layers
        cache on their first call."""
        if self.reason is not None:
            return
        t0 = time.perf_counter()
        keys = self.warm_buckets()
        # the buckets the last run served warm now, the others while the scheduler idles
        # (working_set.py); without a record (a first start) all of them warm now
        self.working_set = WorkingSet("prefill", self.model_runner, [_name(k) for k in keys])
        now, later = self.working_set.split()
        self.ctx = ForwardContext(attn_backend=self.model_runner.attn_backend)
        with DynamicGradMode():
            fb = self._batch(*keys[0])
            with forward_context(self.ctx, forward_batch=fb):
                self._step(fb.input_ids, fb.positions, fb)
            for key in keys:
                if _name(key) in now:
                    self._warm(key)
            # the last run's buckets outside the plan (more requests, a longer prefix)
            for key in filter(None, map(_parse_name, self.working_set.extra())):
                if key[0] <= self.max_tokens and key[1] <= self.max_reqs:
                    self._warm(key)
        torch.tpu.synchronize()
        self.warm_up_s = time.perf_counter() - t0
        self.working_set.started()
        self.deferred = [_name(k) for k in keys if _name(k) in later]
        for key in keys:
            if _name(key) in later:
                defer(f"prefill {_name(key)}", lambda key=key: self._warm(key))
        logger.info("torchtpu: compiled %d prefill buckets (tokens x requests x KV width) "
                    "in %.1f s (deferred: %d)", len(keys) - len(later), self.warm_up_s,
                    len(later))

    def _warm(self, key) -> None:
        """Trace (compile, or load from the compile cache) bucket ``key`` with an extend step
        of padding only, unless a step met it first."""
        if _name(key) in self.dynamo:
            return
        fb = self.batches.get(key)
        if fb is None:
            fb = self.batches[key] = self._batch(*key)
        self._call(fb, key, self.ctx)
        self.warmed.append(_name(key))

    # ---- the program ----

    def _step(self, input_ids, positions, forward_batch):
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)
        return self.model_runner.model.forward(input_ids, positions, forward_batch)

    def _batch(self, tokens: int, reqs: int, width) -> ForwardBatch:
        """The bucket's forward batch (its tensors are replaced each step)."""
        dev, mr = self.device, self.model_runner

        def z(n, fill=0):
            # as a step's tensors are made (pad_on_host): the same host-to-device programs
            return torch.from_numpy(np.full((n,), fill, dtype=np.int64)).to(dev)

        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=reqs, input_ids=z(tokens),
            req_pool_indices=z(reqs), seq_lens=z(reqs, 1),
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
        b = int(forward_batch.batch_size)
        pb = reqs - b
        # per token: built on the host to the bucket's length (a ``cat`` on the device would
        # be an eager program compiled for every new token count, inside a request's TTFT)
        # from the host copy SGLang's tensor was made from (``remember_host``), else read back
        fb.input_ids = pad_on_host(forward_batch.input_ids, tokens)
        fb.positions = pad_on_host(forward_batch.positions, tokens)
        fb.out_cache_loc = pad_on_host(forward_batch.out_cache_loc, tokens)
        # per request: from SGLang's host copies where it keeps them (a transfer; an eager op
        # over a device tensor of ``b`` rows compiles a program for every new ``b``)
        f = forward_batch
        fb.req_pool_indices = pad_on_host(f.req_pool_indices, reqs, 0,
                                          getattr(f, "req_pool_indices_cpu", None))
        fb.seq_lens = pad_on_host(f.seq_lens, reqs, 1, getattr(f, "seq_lens_cpu", None))
        fb.extend_seq_lens = pad_on_host(f.extend_seq_lens, reqs, 0, f.extend_seq_lens_cpu)
        fb.extend_prefix_lens = pad_on_host(f.extend_prefix_lens, reqs, 1,
                                            f.extend_prefix_lens_cpu)
        ctx = get_forward_context() if has_forward_context() else ForwardContext(
            attn_backend=self.model_runner.attn_backend)
        out = self._call(fb, key, ctx)
        self.served += 1
        if self.working_set is not None:
            self.working_set.served(_name(key))
        if pb == 0:
            return out
        return type(out)(next_token_logits=out.next_token_logits[:b],
                         hidden_states=None if out.hidden_states is None
                         else out.hidden_states[:b])


    def _call(self, fb, key, ctx):
        name = _name(key)
        first = name not in self.dynamo
        if first:
            before, t0 = _dynamo_counts(), time.perf_counter()
        with forward_context(ctx, forward_batch=fb):
            out = self._program(fb.input_ids, fb.positions, fb)
        if first:
            self.dynamo[name] = {k: v - before[k] for k, v in _dynamo_counts().items()}
            self.compile_s[name] = time.perf_counter() - t0
        return out


def resolve_forward_inputs(original, batch, *args, **kwargs):
    """Around SGLang's ``overlap_utils.resolve_forward_inputs`` (an extend's token ids copied
    from their pinned host staging): note the host copy on the device tensor."""
    host = getattr(batch, "prefill_input_ids_cpu", None)
    if getattr(batch, "mix_running_indices", None) is not None:
        host = None  # decode rows are gathered on the device after the prompt's
    out = original(batch, *args, **kwargs)
    ids = getattr(batch, "input_ids", None)
    if host is not None and isinstance(ids, torch.Tensor) and ids.device.type == "tpu":
        # a copy: SGLang may reuse its pinned staging for the next batch
        remember_host(ids, host.numpy().copy() if isinstance(host, torch.Tensor)
                      else np.array(host, dtype=np.int64))
    return out


def _name(key) -> str:
    tokens, reqs, width = key
    return f"{tokens}x{reqs}" + (f"x{width}" if width else "")


def _parse_name(name: str):
    """``_name``'s (tokens, requests, KV width), or None for a name it did not write."""
    try:
        parts = [int(p) for p in name.split("x")]
    except ValueError:
        return None
    if len(parts) == 2:
        return parts[0], parts[1], None
    return tuple(parts) if len(parts) == 3 else None


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


def warm_up(result, model_runner, *args, **kwargs):
    """After SGLang's ``ModelRunner.init_cuda_graphs`` (start-up, also with graphs off): the
    prefill buckets compiled before the first request."""
    sa = model_runner.server_args
    if (os.environ.get("TORCHTPU_SGLANG_PREFILL_WARMUP", "1") == "0"
            or getattr(sa, "disaggregation_mode", "null") == "decode"
            or getattr(model_runner, "is_draft_worker", False)):
        return None
    _runner(model_runner).warm_up()
    return None


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_extend",
        execute_extend, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs", warm_up,
        HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.overlap_utils.resolve_forward_inputs",
                          resolve_forward_inputs, HookType.AROUND)
