"""vLLM's model runner on "tpu": the GPU runner with its inputs prepared on the host.

``TpuModelRunner`` subclasses vLLM's ``GPUModelRunner`` the way vLLM's CPU runner does: every
input buffer (token ids, positions, block tables, sampling state) is a CPU tensor, so the
runner's bookkeeping and the sampler run on the host unchanged, and the model (weights, KV
cache) lives on "tpu". What differs from the GPU runner:

- a step's tokens are padded to a token bucket (``buckets.py``) and sent to the device with
  their positions, the attention metadata (``attention.py``) and the rows whose logits are
  needed as one int32 array of a fixed shape per bucket (one host-to-device transfer; the
  compiled program slices it);
- a step is one program per token bucket (``_Step``: forward, the rows' gather, logits,
  the rows' tokens: greedy argmax or a temperature draw, ``sampling.py``) with ``torch.compile(backend="tpu")``, all built (or loaded from the compile
  cache) at start-up by ``warm_up``; with ``enforce_eager=True`` it runs eagerly (Strict mode);
- a step whose requests all sample greedily or with a temperature only (no top-k/top-p,
  logprobs, penalties, ...: ``sampling.samples_in_program``) takes its tokens from the
  program: one small transfer, vLLM's sampler skipped; any other step brings its logits back
  (one transfer) for vLLM's sampler on the host: one host sync a step either way;
- the KV cache is one tensor per layer (``[blocks, block_size, 2 * kv_heads, head_dim]``), not
  views of one shared byte buffer: each layer's cache is written in place by its own program.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache

from ..eager.copy import tensor_from_numpy
from ..ops._kv_storage import kv_storage_dtype
from ..runtime.metrics import count
from . import attention as _attn
from . import buckets as _buckets
from . import sampling as _sampling
from .dispatch import BucketDispatch

logger = init_logger(__name__)
PAD_SLOT_ID = -1


class _Step(torch.nn.Module):
    """A step in one program: the model's forward on the step's packed inputs (token ids and
    positions are the first ``2 * T`` int32 of ``packed``, the attention metadata follows, see
    ``attention.py``, and the last ``3 * R`` are the rows whose logits are needed, their
    temperatures (float32 bits) and their sampling seeds), the logits of those rows and their
    sampled tokens (``sampling.py``: argmax where the temperature is 0, first index on ties, as
    vLLM's sampler; else a Gumbel-max draw keyed by the seed and the row's position).
    Returns ``(hidden_states [T, H], logits [R, V], token ids int32 [R])``."""

    def __init__(self, model, compute_logits):
        super().__init__()
        self.model = model
        self.compute_logits = compute_logits

    def forward(self, packed, T: int, R: int):
        h = self.model(input_ids=packed[:T], positions=packed[T:2 * T].to(torch.int64))
        end = packed.shape[0]
        rows = packed[end - 3 * R:end - 2 * R].to(torch.int64)
        logits = self.compute_logits(h[rows])
        ids = _sampling.sample(logits, packed[end - 2 * R:end - R].view(torch.float32),
                               packed[end - R:], packed[T:2 * T][rows])
        return h, logits, ids


class TpuModelRunner(GPUModelRunner):
    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        with _cuda_placeholders():
            super().__init__(vllm_config, torch.device("cpu"))
        self.device_tpu = device
        self.use_cuda_graph = False
        self.cascade_attn_enabled = False
        self.compiled = bool((vllm_config.additional_config or {}).get("torchtpu_compile"))
        self.token_buckets = _buckets.token_buckets(vllm_config)
        self.request_buckets = _buckets.request_buckets(vllm_config)
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self._step_rows: np.ndarray | None = None  # rows, temperatures, seeds (_prepare_inputs)
        self._step_out = None  # (hidden states, logits, token ids) of the step
        self._step_ids = None  # (token ids, real rows) when the step samples in the program
        self._step_n, self._step_sampled = 0, False
        self._host_buffers()
        _install_host_slot_mapping()

    # ---- host-side inputs (as vLLM's CPU runner) ----

    def _host_buffers(self) -> None:
        def replace(obj, cpu_name, dev_name):
            cpu_t = getattr(obj, cpu_name, None)
            if isinstance(cpu_t, torch.Tensor) and isinstance(getattr(obj, dev_name, None),
                                                              torch.Tensor):
                setattr(obj, dev_name, cpu_t)

        for v in vars(self).values():
            if isinstance(v, CpuGpuBuffer):
                v.gpu = v.cpu
        for k in list(vars(self.input_batch)):
            if k.endswith("_cpu_tensor"):
                replace(self.input_batch, k, k[:-11])
        for bt in self.input_batch.block_table.block_tables:
            for v in vars(bt).values():
                if isinstance(v, CpuGpuBuffer):
                    v.gpu = v.cpu

    def may_reinitialize_input_batch(self, *args, **kwargs):
        out = super().may_reinitialize_input_batch(*args, **kwargs)
        self._host_buffers()
        return out

    def _init_device_properties(self) -> None:
        pass

    def _sync_device(self) -> None:
        torch.tpu.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        return sampled_token_ids.tolist()

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        # attention never reads a cache row past a sequence's length, so stale rows of a
        # reused block are harmless: nothing to zero
        return None

    # ---- model ----

    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("loading dummy weights is not supported on 'tpu'")
        logger.info("Loading model %s onto %s", self.model_config.model, self.device_tpu)
        self.model = get_model(vllm_config=self.vllm_config)
        step = _Step(self.model, self.model.compute_logits)
        if self.compiled:
            n = len(self.token_buckets) + 8
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, n)
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * n)
            # a bucket's program is called without Dynamo's guards once built (dispatch.py)
            self._forward = BucketDispatch(
                step, torch.compile(step, backend="tpu", fullgraph=True, dynamic=False),
                self.compilation_config.static_forward_context.values())
        else:
            self._forward = step
        self.model.compute_logits = _LogitsHook(self, self.model.compute_logits)

    def get_model(self):
        return self.model

    # ---- KV cache: one tensor per layer on the device ----

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None) -> dict:
        kv_caches: dict[str, torch.Tensor] = {}
        num_blocks = kv_cache_config.num_blocks
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            for name in group.layer_names:
                if name in self.shared_kv_cache_layers:
                    continue
                shape = _attn.TpuPagedAttentionBackend.get_kv_cache_shape(
                    num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
                kv_caches[name] = torch.zeros(shape, dtype=kv_storage_dtype(spec.dtype),
                                              device=self.device_tpu)
        for name, target in self.shared_kv_cache_layers.items():
            kv_caches[name] = kv_caches[target]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches)
        if isinstance(getattr(self, "_forward", None), BucketDispatch):
            self._forward.set_kv_layers(self.compilation_config.static_forward_context.values())
        return kv_caches

    # ---- a step: bucketed shapes, device transfers ----

    def _determine_batch_execution_and_padding(self, num_tokens, *args, **kwargs):
        mode, desc, ubatch, across_dp, stats = super()._determine_batch_execution_and_padding(
            num_tokens, *args, **kwargs)
        desc = dataclasses.replace(desc, num_tokens=_buckets.pick(self.token_buckets,
                                                                    desc.num_tokens))
        return mode, desc, ubatch, across_dp, stats

    def _get_slot_mappings(self, *args, **kwargs):
        by_group, by_layer = super()._get_slot_mappings(*args, **kwargs)
        # The attention backend writes the KV cache in its forward, from its own metadata
        # (forward_includes_kv_cache_update); the per-layer slot mappings of the forward
        # context are for a separate write, and a compiled forward would guard on them (CPU
        # tensors whose length is the step's): left empty, as at warm-up.
        return by_group, {}

    def rows_bucket(self, T: int) -> int:
        """The logits rows of token bucket ``T``'s program: the request bucket of
        ``min(T, max_num_seqs)`` (a step samples one row per request, at most one per token)."""
        return _buckets.pick(self.request_buckets, min(T, self.max_num_seqs))

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec, max_sampled = super()._prepare_inputs(scheduler_output,
                                                                    num_scheduled_tokens)
        if spec is not None:
            raise NotImplementedError("speculative decoding is not supported on 'tpu' yet")
        n = int(logits_indices.shape[0])
        T = _buckets.pick(self.token_buckets, max(1, int(np.sum(num_scheduled_tokens))))
        R = self.rows_bucket(T)
        # the rows go to the device with the step's inputs (_send_inputs); rows past n are
        # padding (their logits are dropped); the rows' temperatures and seeds follow them
        rows = np.full(R, T - 1, np.int32)
        rows[:n] = logits_indices.numpy()
        self._step_n = n
        self._step_sampled = _sampling.samples_in_program(self, scheduler_output)
        self._step_rows = np.concatenate(
            [rows, _sampling.row_params(self.input_batch, n, R, self._step_sampled)])
        # the program gathers the rows itself: the runner's ``hidden_states[logits_indices]``
        # is a view of the whole hidden states (no device op), which _LogitsHook recognises
        return slice(None), spec, max_sampled

    @contextmanager
    def maybe_get_kv_connector_output(self, scheduler_output, *args, **kwargs):
        """vLLM's KV connector lifecycle around a step's forward, with the per-layer saves
        moved out of the compiled program: while the forward runs the connector holds no
        metadata (vLLM's per-layer hooks in the traced attention then do nothing, as at
        warm-up, so the bucket's program is the same), and afterwards ``save_kv_layer`` runs
        for every layer here, before vLLM's ``wait_for_save``."""
        with super().maybe_get_kv_connector_output(scheduler_output, *args,
                                                   **kwargs) as output:
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

            if not has_kv_transfer_group():
                yield output
                return
            connector = get_kv_transfer_group()
            metadata = connector._connector_metadata
            connector._connector_metadata = None
            try:
                yield output
            finally:
                connector._connector_metadata = metadata
            if metadata is not None:
                self._save_kv_layers(connector)

    def _save_kv_layers(self, connector) -> None:
        from vllm.forward_context import get_forward_context

        attn_metadata = get_forward_context().attn_metadata
        if not isinstance(attn_metadata, dict):
            return
        for name, layer in self.compilation_config.static_forward_context.items():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, torch.Tensor) and attn_metadata.get(name) is not None:
                connector.save_kv_layer(name, kv, attn_metadata[name])

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs) -> Any:
        if intermediate_tensors is not None or inputs_embeds is not None or model_kwargs:
            raise NotImplementedError("pipeline parallelism, input embeddings and multimodal "
                                      "inputs are not supported on 'tpu' yet")
        if positions.dim() != 1:
            raise NotImplementedError("multi-dimensional positions (M-RoPE) are not supported "
                                      "on 'tpu' yet")
        T = int(input_ids.shape[0])
        rows = self._step_rows
        self._step_rows = None
        if rows is None:  # a padding step (warm-up, dummy runs): greedy rows
            R = self.rows_bucket(T)
            rows = np.concatenate([np.full(R, T - 1, np.int32), np.zeros(2 * R, np.int32)])
        h, logits, ids = self._forward(self._send_inputs(input_ids, positions, rows), T,
                                       len(rows) // 3)
        self._step_out = (h, logits, ids)
        return h

    def _send_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     rows: np.ndarray) -> torch.Tensor:
        """The step's token ids, positions, attention metadata and logits rows in one int32
        host-to-device transfer; each attention metadata of the step refers to it
        (``attention.py``)."""
        from vllm.forward_context import get_forward_context

        attn = get_forward_context().attn_metadata
        mds = list({id(m): m for m in (attn.values() if isinstance(attn, dict) else [])
                    if isinstance(m, _attn.TpuPagedAttentionMetadata)}.values())
        T = int(input_ids.shape[0])
        parts = [input_ids.numpy(), positions.numpy()]
        if mds:
            parts += mds[0].host_parts()
        parts.append(rows)
        packed = tensor_from_numpy(np.concatenate(
            [np.asarray(p, np.int32).reshape(-1) for p in parts]), self.device_tpu.index or 0)
        for i, md in enumerate(mds):
            if i == 0:
                md.packed, md.base = packed, 2 * T
            else:  # another KV cache group's metadata (not used today: one group)
                md.packed = torch.from_numpy(np.concatenate(md.host_parts())).to(
                    self.device_tpu)
                md.base = 0
        return packed


    # ---- start-up: every bucket compiled (or loaded) once ----

    def profile_run(self) -> None:
        # the KV cache size is not measured from a profiling run (platform.py, worker.py)
        return None

    def _dummy_run(self, num_tokens: int, *args, **kwargs):
        T = _buckets.pick(self.token_buckets, max(1, num_tokens))
        return self._run_padding_step(T), None

    def _run_padding_step(self, T: int):
        """One forward of ``T`` padding tokens (nothing written, zeros attended)."""
        md = self._padding_metadata(T)
        names = list(self.compilation_config.static_forward_context)
        # host tensors of the step's dtypes, moved as a step moves them (a transfer allocates
        # its destination with a program per shape)
        ids = self.input_ids.cpu[:T]
        pos = self._get_positions(T)
        with set_forward_context({n: md for n in names}, self.vllm_config, num_tokens=T,
                                 slot_mapping={}):
            return self._model_forward(input_ids=torch.zeros_like(ids),
                                       positions=torch.zeros_like(pos))

    def _padding_metadata(self, T: int):
        group = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        max_seqs = int(self.scheduler_config.max_num_seqs)
        pps = -(-int(self.model_config.max_model_len) // group.block_size)
        host = _attn.host_metadata(T, max_seqs, pps, np.zeros(1, np.int32),
                                   np.zeros(0, np.int32), np.zeros((0, pps), np.int32),
                                   np.zeros(0, np.int32))
        return _attn.metadata(host)

    @torch.inference_mode()  # as the worker runs steps (Dynamo guards on the grad mode)
    def warm_up(self) -> float:
        """Compile (or load from the compile cache) every token bucket's step program, and
        run what a step does with its outputs (the token ids' transfer, the logits' transfer
        and the row slices a logits step takes); returns the seconds it took."""
        t0 = time.perf_counter()
        for T in self.token_buckets:
            self._run_padding_step(T)
            _, logits, ids = self._step_out
            self._step_out = None
            ids.cpu()
            for R in self.request_buckets:
                if R <= logits.shape[0]:
                    _rows(logits, R).cpu()
        torch.tpu.synchronize()
        dt = time.perf_counter() - t0
        logger.info("torchtpu: %s %d token buckets %s (logits rows %s) in %.1f s",
                    "compiled" if self.compiled else "warmed up", len(self.token_buckets),
                    self.token_buckets, [self.rows_bucket(T) for T in self.token_buckets], dt)
        return dt

    def _sample(self, logits, spec_decode_metadata):
        """vLLM's sampler, or the token ids the step's program drew when every request of the
        step samples greedily or with a temperature only (``sampling.samples_in_program``):
        one small transfer."""
        got = self._step_ids
        self._step_ids = None
        if got is None:
            count("vllm_steps_sampled_on_host")
            return super()._sample(logits, spec_decode_metadata)
        from vllm.v1.outputs import SamplerOutput

        count("vllm_steps_sampled_in_program")
        self.input_batch.update_async_output_token_ids()
        ids, n = got
        return SamplerOutput(sampled_token_ids=ids.cpu()[:n].view(n, 1),
                             logprobs_tensors=None)


class _LogitsHook:
    """Stands in for ``model.compute_logits``. Given the step's hidden states (the runner's
    ``hidden_states[logits_indices]``, a view of the program's output) it returns what the
    step's program computed: where the step samples in the program, the logits stay on the
    device and ``_sample`` takes the program's token ids; else the logits come back (the
    smallest request bucket holding the step's rows, one transfer: the step's one host sync).
    Any other call (prompt logprobs) runs the model's own and returns its result on the host,
    where vLLM's sampler runs."""

    def __init__(self, runner, original):
        self.runner = runner
        self.original = original

    def __call__(self, hidden_states):
        r = self.runner
        out = r._step_out
        if out is not None and hidden_states.device.type == "tpu" \
                and hidden_states.shape == out[0].shape:
            r._step_out = None
            _, logits, ids = out
            n = r._step_n
            if r._step_sampled:
                r._step_ids = (ids, n)
                return logits
            R = _buckets.pick(r.request_buckets, n)
            # a request bucket of rows comes back (a device-side [:n] would be a program per n)
            return _rows(logits, R).cpu()[:n]
        out = self.original(hidden_states)
        return out.cpu() if isinstance(out, torch.Tensor) else out


def _rows(logits: torch.Tensor, R: int) -> torch.Tensor:
    return logits if R == logits.shape[0] else logits[:R]


@contextmanager
def _cuda_placeholders():
    """vLLM's GPU runner creates CUDA events and streams while it initialises: placeholders
    (as its CPU runner does)."""

    class _Event:
        def __init__(self, *a, **k):
            self.record = lambda *a, **k: None
            self.synchronize = lambda: None

    class _Stream:
        def __init__(self, *a, **k):
            self.wait_stream = lambda *a, **k: None
            self.device = torch.device("cpu")

    ev, st = torch.Event, torch.cuda.Stream
    torch.Event, torch.cuda.Stream = _Event, _Stream
    try:
        yield
    finally:
        torch.Event, torch.cuda.Stream = ev, st


class _HostKernel:
    """``kernel[grid](*args)``: the calling convention of the Triton kernel it replaces."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _slot_mapping_host(num_tokens, max_num_tokens, query_start_loc, positions, block_table,
                       block_table_stride, block_size, slot_mapping, KV_CACHE_BLOCK_SIZE=None,
                       BLOCKS_PER_KV_BLOCK=1, TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                       CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=PAD_SLOT_ID, BLOCK_SIZE=1024):
    """vLLM's slot-mapping kernel on the host (numpy): token t of request r at position p goes
    to ``block_table[r, p // block_size] * block_size + p % block_size``; the rest is PAD_ID."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("context parallelism is not supported on 'tpu'")
    qsl = query_start_loc.numpy().astype(np.int64)
    n_reqs = len(qsl) - 1
    pos = positions.numpy()[:num_tokens].astype(np.int64)
    req = np.repeat(np.arange(n_reqs), np.diff(qsl))[:num_tokens]
    bt = block_table.numpy()
    blocks = bt[req, pos // block_size].astype(np.int64)
    out = slot_mapping.numpy()
    out[:num_tokens] = blocks * block_size + pos % block_size
    out[num_tokens:max_num_tokens] = PAD_ID


def _install_host_slot_mapping() -> None:
    import vllm.v1.worker.block_table as _bt

    _bt._COMPUTE_SLOT_MAPPING_KERNEL.kernel = _HostKernel(_slot_mapping_host)
