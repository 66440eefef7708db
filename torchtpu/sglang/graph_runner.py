"""Decode through bucketed compiled programs: SGLang's graph runner on "tpu".

SGLang replays a captured CUDA graph per batch size for decode steps (``--cuda-graph-bs`` /
``--cuda-graph-max-bs``; on CPU, ``--enable-torch-compile`` compiles per batch size instead).
On "tpu" the same batch sizes are *buckets*: ``TpuGraphRunner`` compiles one
``torch.compile(backend="tpu")`` program per bucket of the whole decode forward (the attention
metadata, built on the device from the batch's tensors, the model and the logits), runs each
once at start-up (compiled, or loaded from the compile cache), and serves a decode step of
``n`` requests with the smallest bucket holding ``n``: the step's device tensors are padded to
the bucket (padding rows: request slot 0, length 1, KV written to SGLang's reserved slot 0, as
SGLang's own graph runners pad), the bucket's program runs, and the first ``n`` rows of the
logits are returned to SGLang's sampler. The KV pages are inputs the program overwrites, so
their buffers are donated and the write costs what it writes.

Nothing of a step reads device data back on the host here; the one host sync of a decode step
is SGLang's, when it reads the sampled token ids. Selected where SGLang would capture decode
graphs (the platform declares ``capabilities.graph_capture``); ``--disable-cuda-graph`` runs
decode eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import get_exec
from sglang.srt.utils.common import DynamicGradMode

from .attention import kv_width
from .working_set import WorkingSet, defer

logger = logging.getLogger(__name__)

SEQ_LEN_FILL = 1  # a padding row attends to one key (slot 0), so its softmax is defined


def capture_batch_sizes(model_runner) -> list[int]:
    """The decode buckets: SGLang's decode graph batch sizes, at most the request pool."""
    cfg = get_exec().graph.cuda_graph_config
    sizes = list(getattr(cfg.decode, "bs", None) or []) if cfg is not None else []
    top = int(model_runner.req_to_token_pool.size)
    out = sorted({int(b) for b in sizes if 0 < int(b) <= top})
    if not out:
        raise ValueError(f"no decode batch size to compile within the request pool ({top}): "
                         f"set --cuda-graph-bs or --cuda-graph-max-bs")
    return out


def inactive_reason(model_runner) -> str | None:
    """Why decode cannot run through compiled buckets here, or None."""
    from sglang.srt.runtime_context import get_parallel

    from .attention import TpuPagedAttnBackend

    p = get_parallel()
    if p.pp_size > 1:
        return f"pipeline parallelism ({p.pp_size} stages)"
    if p.tp_size > 1:
        from .collectives import install

        # SGLang's all-reduce inside a compiled program is its own custom op
        # (sglang::inplace_all_reduce): lowered by collectives.py
        if not install():
            return f"{p.tp_size} ranks without a lowering of sglang::inplace_all_reduce"
    backend = model_runner.attn_backend
    if not (isinstance(backend, TpuPagedAttnBackend) and backend.paged):
        # the programs build the paged attention op's metadata on the device; other backends
        # (torch_native: a loop over the requests) run eagerly
        return f"attention backend {type(backend).__name__}"
    if not model_runner.spec_algorithm.is_none():
        return "speculative decoding"
    return None


class TpuGraphRunner:
    """SGLang's decode graph runner interface (``can_run_graph``, ``execute``,
    ``capture_bs``) over bucketed ``torch.compile(backend="tpu")`` programs."""

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.bs = None
        self.raw_bs = None
        reason = inactive_reason(model_runner)
        if reason is not None:
            # SGLang builds its graph runner whenever the platform captures graphs: this one
            # then serves no step (can_run_graph is False) and decode runs eagerly
            logger.warning("torchtpu: decode runs eagerly (%s)", reason)
            self.capture_bs, self.max_bs = [], 0
            return
        self.capture_bs = capture_batch_sizes(model_runner)
        self.max_bs = max(self.capture_bs)
        # a program per (bucket, KV width): widths are powers of two up to the context length
        _raise_recompile_limit(len(self.capture_bs) * 8 + 2)
        self.kv_full = int(model_runner.req_to_token_pool.req_to_token.shape[1])
        self.page_size = int(model_runner.page_size)
        self._program = torch.compile(self._step, backend="tpu", dynamic=False)
        # warmed at the smallest KV width; a wider one compiles when first met
        w0 = kv_width(_Lens(1), self.page_size, self.kv_full)
        self.batches = {(bs, w0): self._batch(bs, w0) for bs in self.capture_bs}
        self.w0 = w0
        # the buckets the last run served warm now, the others while the scheduler idles
        # (working_set.py); without a record (a first start) all of them warm now
        self.working_set = WorkingSet("decode", model_runner,
                                      [_key_name(bs, w0) for bs in self.capture_bs])
        now, later = self.working_set.split()
        t0 = time.perf_counter()
        self.dynamo = {}
        # in the grad mode SGLang's scheduler runs steps in (no_grad, or inference mode with
        # SGLANG_ENABLE_TORCH_INFERENCE_MODE): Dynamo guards on it
        with DynamicGradMode():
            # first eagerly, as SGLang warms up before a CUDA graph capture: its layers cache
            # state on their first call (a norm's chosen method, a stage's exit policy behind
            # a locked functools.cached_property), which the compiled trace then only reads
            self._step_eager(self.batches[(self.capture_bs[0], w0)])
            warm = [bs for bs in reversed(self.capture_bs) if _key_name(bs, w0) in now]
            for bs in warm:
                self._warm(bs)
            # and the last run's buckets at wider KV widths (working_set.py: ``extra``)
            for key in filter(None, map(_parse_key, self.working_set.extra())):
                if key[0] in self.capture_bs:
                    self._run(self.batches.setdefault(key, self._batch(*key)))
            # again: a second call of a warmed bucket must neither trace nor compile
            before = _dynamo_counts()
            for bs in warm:
                self._run(self.batches[(bs, w0)])
            self.dynamo["rerun"] = {k: v - before[k] for k, v in _dynamo_counts().items()}
        torch.tpu.synchronize()
        self.warm_up_s = time.perf_counter() - t0
        self.working_set.started()
        self.deferred = [bs for bs in reversed(self.capture_bs) if _key_name(bs, w0) in later]
        for bs in self.deferred:
            defer(f"decode {bs}", lambda bs=bs: self._warm(bs, again=True))
        breaks = {bs: d["graph_breaks"] for bs, d in self.dynamo.items() if d["graph_breaks"]}
        if breaks:
            logger.warning("torchtpu: decode programs with graph breaks (bucket: count) %s; "
                           "TORCH_LOGS=graph_breaks names them", breaks)
        logger.info("torchtpu: compiled decode buckets %s in %.1f s (deferred: %s)", warm,
                    self.warm_up_s, self.deferred)

    def _warm(self, bs: int, again: bool = False) -> None:
        """Trace bucket ``bs`` (its program compiled, or loaded from the compile cache) and
        keep Dynamo's counts for it; ``again``: then run it once more (it must trace
        nothing), the check the start-up warm-up makes for all its buckets at once."""
        if bs in self.dynamo:  # a step met it first
            return
        fb = self.batches[(bs, self.w0)]
        before = _dynamo_counts()
        self._run(fb)
        self.dynamo[bs] = {k: v - before[k] for k, v in _dynamo_counts().items()}
        if again:
            before = _dynamo_counts()
            self._run(fb)
            grew = {k: v - before[k] for k, v in _dynamo_counts().items()}
            rerun = self.dynamo.setdefault("rerun", dict.fromkeys(grew, 0))
            for k, v in grew.items():
                rerun[k] = rerun.get(k, 0) + v

    def _step_eager(self, fb):
        with forward_context(ForwardContext(attn_backend=self.model_runner.attn_backend),
                             forward_batch=fb):
            return self._step(fb.input_ids, fb.positions, fb)

    # ---- the program ----

    def _step(self, input_ids, positions, forward_batch):
        self.model_runner.attn_backend.init_forward_metadata(forward_batch)
        return self.model_runner.model.forward(input_ids, positions, forward_batch)

    def _run(self, fb):
        with forward_context(ForwardContext(attn_backend=self.model_runner.attn_backend),
                             forward_batch=fb):
            return self._program(fb.input_ids, fb.positions, fb)

    def _batch(self, bs: int, width) -> ForwardBatch:
        """The bucket's forward batch (its tensors are replaced each step)."""
        dev = self.device

        def z():
            return torch.zeros((bs,), dtype=torch.int64, device=dev)

        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=z(),
            req_pool_indices=z(),
            seq_lens=torch.full((bs,), SEQ_LEN_FILL, dtype=torch.int64, device=dev),
            out_cache_loc=z(), seq_lens_sum=bs * SEQ_LEN_FILL, return_logprob=False,
            positions=z(), spec_algorithm=self.model_runner.spec_algorithm,
            capture_hidden_mode=CaptureHiddenMode.NULL, global_forward_mode=ForwardMode.DECODE)
        fb.torchtpu_kv_width = width  # attention.kv_width
        translator = getattr(self.model_runner, "kv_index_translator", None)
        if translator is not None:
            translator.bind_runner_slots(fb)
        return fb

    # ---- SGLang's interface ----

    def can_run_graph(self, forward_batch) -> bool:
        return (self.max_bs > 0 and forward_batch.forward_mode.is_decode()
                and forward_batch.batch_size <= self.max_bs
                and forward_batch.capture_hidden_mode in (None, CaptureHiddenMode.NULL)
                and getattr(forward_batch, "spec_info", None) is None
                and getattr(forward_batch, "mrope_positions", None) is None
                and getattr(forward_batch, "input_embeds", None) is None)

    def execute(self, forward_batch, pp_proxy_tensors=None, **kwargs):
        if pp_proxy_tensors is not None:
            raise NotImplementedError("pipeline parallelism is not supported on 'tpu' yet")
        raw = forward_batch.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw)]
        self.bs, self.raw_bs = bs, raw
        key = (bs, kv_width(forward_batch, self.page_size, self.kv_full))
        fb = self.batches.get(key)
        if fb is None:
            fb = self.batches[key] = self._batch(*key)
        first = key[1] == self.w0 and bs not in self.dynamo  # deferred, not warmed yet
        self.working_set.served(_key_name(*key))  # every KV width: warmed at the next start
        pad = bs - raw
        fb.input_ids = _pad(forward_batch.input_ids, pad, 0)
        fb.req_pool_indices = _pad(forward_batch.req_pool_indices, pad, 0)
        fb.seq_lens = _pad(forward_batch.seq_lens, pad, SEQ_LEN_FILL)
        fb.out_cache_loc = _pad(forward_batch.out_cache_loc, pad, 0)
        fb.positions = _pad(forward_batch.positions, pad, 0)
        if first:
            before = _dynamo_counts()
        out = self._run(fb)
        if first:
            self.dynamo[bs] = {k: v - before[k] for k, v in _dynamo_counts().items()}
        if pad == 0:
            return out
        return LogitsProcessorOutput(
            next_token_logits=out.next_token_logits[:raw],
            hidden_states=None if out.hidden_states is None else out.hidden_states[:raw])


def _key_name(bs: int, width) -> str:
    return f"{bs}x{width}"


def _parse_key(name: str):
    """``_key_name``'s (bucket, KV width), or None for a name it did not write."""
    try:
        bs, width = name.split("x")
        return int(bs), None if width == "None" else int(width)
    except ValueError:
        return None


class _Lens:
    """A batch whose longest sequence has ``n`` tokens (for ``kv_width``)."""

    def __init__(self, n):
        self.seq_lens_cpu = torch.tensor([n])


def _raise_recompile_limit(n: int) -> None:
    """Dynamo keeps one cache entry per bucket of a program's frame: at least ``n``."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, n)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * n)


def _dynamo_counts() -> dict:
    """Dynamo's process-wide counts: graph breaks, graphs traced, frames it gave up on."""
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
            "frames": counters["frames"]["total"]}


def _pad(t: torch.Tensor, pad: int, fill: int) -> torch.Tensor:
    t = t.to(torch.int64)
    if pad == 0:
        return t
    return torch.cat([t, torch.full((pad,), fill, dtype=t.dtype, device=t.device)])
