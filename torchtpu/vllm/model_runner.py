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
  views of one shared byte buffer: each layer's cache is written in place by its own program;
- under vLLM's async scheduling (opt-in, platform.py) a step's sampled ids stay on the
  device: the next step's program takes a decoding request's input token from them (``prev``
  and the per-token source rows in the packed inputs), so the engine schedules and prepares
  step N+1 while the device runs step N, and reads step N's ids (``TpuAsyncOutput``) after.
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
from vllm.v1.outputs import AsyncModelRunnerOutput
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache

from ..eager.copy import device_to_host, tensor_from_numpy, to_numpy_dtype
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
    ``attention.py``, then the rows whose logits are needed, their temperatures (float32
    bits) and their sampling seeds, ``R`` each, and last, per token, the row of ``prev`` (the
    previous step's ids, async scheduling) that holds its id, or -1), the logits of those
    rows and their sampled tokens (``sampling.py``: argmax where the temperature is 0, first
    index on ties, as vLLM's sampler; else a Gumbel-max draw keyed by the seed and the row's
    position). Returns ``(hidden_states [T, H], logits [R, V], token ids int32 [P])``, ``P =
    prev.shape[0]`` (the ids padded with zeros: the next step's ``prev``)."""

    def __init__(self, model, compute_logits):
        super().__init__()
        self.model = model
        self.compute_logits = compute_logits

    def forward(self, packed, prev, T: int, R: int):
        end = packed.shape[0] - T
        src = packed[end:]  # token t's id is prev[src[t]] where src[t] >= 0 (async scheduling)
        input_ids = torch.where(src >= 0, prev.index_select(0, src.clamp(min=0)), packed[:T])
        h = self.model(input_ids=input_ids, positions=packed[T:2 * T].to(torch.int64))
        rows = packed[end - 3 * R:end - 2 * R].to(torch.int64)
        logits = self.compute_logits(h[rows])
        ids = _sampling.sample(logits, packed[end - 2 * R:end - R].view(torch.float32),
                               packed[end - R:end], packed[T:2 * T][rows])
        if prev.shape[0] > R:  # one shape for every bucket: the next step's ``prev``
            ids = torch.cat([ids, ids.new_zeros(prev.shape[0] - R)])
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
        # async scheduling: the previous step's token ids stay on the device (``prev``: one
        # shape, the request bucket of max_num_seqs) and the next program reads them itself
        self.prev_rows = _buckets.pick(self.request_buckets, self.max_num_seqs)
        self._no_prev: torch.Tensor | None = None  # zeros: no id taken from a previous step
        self._step_prev: torch.Tensor | None = None  # the step's ``prev`` (_prepare_input_ids)
        self._step_src: np.ndarray | None = None  # token -> row of ``prev`` or -1
        self._host_buffers()
        _install_host_slot_mapping()
        if self.use_async_scheduling:
            _install_async_output()

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

    def _get_or_create_async_output_copy_stream(self):
        return None  # the output's read is the device's own (TpuAsyncOutput)

    def _prepare_input_ids(self, scheduler_output, num_reqs: int,
                           total_num_scheduled_tokens: int, cu_num_tokens: np.ndarray) -> None:
        """The host buffers are the inputs (nothing to copy); under async scheduling the last
        token of a request that decoded in the previous step is not known on the host yet
        (vLLM wrote a placeholder): where the previous step's ids are on the device the step's
        program takes them from there (``_step_src``: the row of ``prev`` per token, else -1),
        where they are on the host (vLLM's sampler ran there) they are written here."""
        self._step_src, self._step_prev = None, None
        prev = self.input_batch.prev_sampled_token_ids
        if prev is None:
            return
        prev_pos = self.prev_positions.np[:num_reqs]
        cur = np.nonzero(prev_pos >= 0)[0]
        if not len(cur):
            return
        flat = np.asarray(cu_num_tokens)[cur] - 1
        src = prev_pos[cur]
        ids = _program_ids(prev)
        if ids is not None:
            self._step_src = np.full(total_num_scheduled_tokens, -1, np.int32)
            self._step_src[flat] = src
            self._step_prev = ids
            return
        self.input_ids.np[flat] = prev[:, 0].cpu().numpy()[src]

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
        src = np.full(T, -1, np.int32)
        if self._step_src is not None:
            src[:len(self._step_src)] = self._step_src
        self._step_rows = np.concatenate(
            [rows, _sampling.row_params(self.input_batch, n, R, self._step_sampled), src])
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
        prev, self._step_prev = self._step_prev, None
        R = self.rows_bucket(T)
        if rows is None:  # a padding step (warm-up, dummy runs): greedy rows, no prev ids
            rows = np.concatenate([np.full(R, T - 1, np.int32), np.zeros(2 * R, np.int32),
                                   np.full(T, -1, np.int32)])
            prev = None
        if prev is None:
            if self._no_prev is None:
                self._no_prev = torch.zeros(self.prev_rows, dtype=torch.int32,
                                            device=self.device_tpu)
            prev = self._no_prev
        h, logits, ids = self._forward(self._send_inputs(input_ids, positions, rows), prev,
                                       T, R)
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
        # under async scheduling the host ids hold vLLM's placeholder (-1) where the program
        # takes the previous step's id, and padding rows past the step's tokens may hold a
        # stale one: 0 instead (padding is never attended to nor sampled)
        parts = [np.maximum(input_ids.numpy(), 0), positions.numpy()]
        if mds:
            parts += mds[0].host_parts()
        parts.append(rows)
        packed = _put_int32(np.concatenate([np.asarray(p, np.int32).reshape(-1)
                                            for p in parts]), self.device_tpu.index or 0)
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
        if self.use_async_scheduling:
            # the ids stay on the device: the next step's program reads them (``prev``) and
            # TpuAsyncOutput brings them back when the engine asks for the step's output
            return SamplerOutput(sampled_token_ids=_ids_placeholder(ids, n),
                                 logprobs_tensors=None)
        return SamplerOutput(sampled_token_ids=_read(ids)[:n].view(n, 1),
                             logprobs_tensors=None)


def _put_int32(host: np.ndarray, device_index: int = 0) -> torch.Tensor:
    """A tpu tensor holding ``host`` (a 1-D int32 array the caller made for this and never
    writes again: the device may alias it), as ``tensor_from_numpy`` makes it, with the
    transfer's fixed host cost cut: ``jax.device_put``'s argument handling (its tree walk,
    sharding inference, transfer guards) and ``tensor_from_numpy``'s torch round trip and copy
    skipped, jax's batched transfer called with the step's one shape. Every step sends one
    such array, so this is on the per-step path; on any failure of that internal call (another
    jax), ``tensor_from_numpy``."""
    fast = _FAST_PUT.get(device_index)
    if fast is None:
        fast = _FAST_PUT[device_index] = _fast_put_for(device_index)
    if fast is not False and host.dtype == np.int32 and host.ndim == 1:
        try:
            arr = fast(host)
        except Exception:  # noqa: BLE001 - jax's internals moved: the documented path
            _FAST_PUT[device_index] = False
        else:
            count("bytes_host_to_device", host.nbytes)
            count("transfers_host_to_device")
            count("vllm_inputs_fast_transfers")
            return _wrap_array(arr)
    return tensor_from_numpy(host, device_index)


_FAST_PUT: dict = {}


def _fast_put_for(device_index: int):
    """``host -> jax array`` on tpu:``device_index`` through ``pxla.batched_device_put`` (what
    ``jax.device_put`` ends in for one numpy array on one device), or False."""
    try:
        from jax._src import core as _jcore
        from jax._src.interpreters import pxla as _pxla
        from jax.sharding import SingleDeviceSharding

        from ..runtime import devices as _devices

        dev = _devices.jax_device(device_index)
        sharding = SingleDeviceSharding(dev)
        avals: dict = {}

        def put(host):
            aval = avals.get(host.shape[0])
            if aval is None:
                aval = avals[host.shape[0]] = _jcore.ShapedArray(host.shape, host.dtype)
            return _pxla.batched_device_put(aval, sharding, [host], [dev], True)

        return put
    except Exception:  # noqa: BLE001
        return False


def _wrap_array(arr) -> torch.Tensor:
    from ..runtime import buffer as _buffer

    return _buffer.wrap(arr)


def _read(t: torch.Tensor) -> torch.Tensor:
    """``t.cpu()`` for a tpu tensor that is its storage's whole array (a program's output):
    the array read directly (``copy.device_to_host``: the same sync, checks and counters),
    without the tensor copy's dispatch; any other tensor through ``.cpu()``."""
    buf = getattr(t.untyped_storage(), "_tpu_buffer", None)
    arr = getattr(buf, "array", None)
    if arr is None or tuple(arr.shape) != tuple(t.shape) or t.storage_offset() \
            or not t.is_contiguous() or t.is_conj() or t.is_neg() \
            or to_numpy_dtype(t.dtype) != arr.dtype:
        return t.cpu()
    return device_to_host(arr)


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
            return _read(_rows(logits, R))[:n]
        out = self.original(hidden_states)
        return out.cpu() if isinstance(out, torch.Tensor) else out


def _ids_placeholder(ids: torch.Tensor, n: int) -> torch.Tensor:
    """What vLLM's bookkeeping takes as the step's ``[n, 1]`` sampled ids under async
    scheduling (it reads only their shape): a meta tensor holding the program's ``ids`` (a
    device-side ``ids[:n]`` would be a program per n)."""
    t = torch.empty((n, 1), dtype=torch.int32, device="meta")
    t._tpu_program_ids = ids
    return t


def _program_ids(sampled: torch.Tensor) -> torch.Tensor | None:
    return getattr(sampled, "_tpu_program_ids", None)


class _ReadOnce:
    """The event vLLM waits on before it reads ``sampled_token_ids_cpu`` (penalties' output
    ids): waiting is reading the device's ids into it."""

    def __init__(self, fill):
        self.fill = fill

    def synchronize(self) -> None:
        fill, self.fill = self.fill, None
        if fill is not None:
            fill()

    def record(self, *a, **k) -> None:
        return None


class TpuAsyncOutput(AsyncModelRunnerOutput):
    """A step's output under async scheduling (what vLLM's ``AsyncGPUModelRunnerOutput`` is on
    CUDA, same constructor): the step's token ids stay where the step left them (the
    program's on the device, or vLLM's sampler's on the host) until the engine asks for the
    output (``get_output``), after it has scheduled and launched the next step; the read is
    the step's one host sync."""

    def __init__(self, model_runner_output, sampled_token_ids, logprobs_tensors,
                 invalid_req_indices, async_output_copy_stream=None, vocab_size=0,
                 routed_experts=None, check_ep_fault=False, num_nans=None):
        if routed_experts is not None or check_ep_fault or num_nans is not None:
            raise NotImplementedError("routed experts capture, EP fault checks and NaN "
                                      "counting are not supported on 'tpu' with async "
                                      "scheduling")
        self._output = model_runner_output
        self._invalid = invalid_req_indices
        self._logprobs = logprobs_tensors
        n = int(sampled_token_ids.shape[0])
        self.sampled_token_ids_cpu = torch.empty((n, 1), dtype=torch.int64)
        base = _program_ids(sampled_token_ids)
        if base is None:  # vLLM's sampler's, on the host
            self.sampled_token_ids_cpu.copy_(sampled_token_ids)
            self.async_copy_ready_event = _ReadOnce(None)
        else:
            self.async_copy_ready_event = _ReadOnce(lambda: self._read(base, n))

    def _read(self, base: torch.Tensor, n: int) -> None:
        # the whole program output comes back (a device-side [:n] is a program per n); the
        # host tensor was made in the step's inference mode
        with torch.inference_mode():
            self.sampled_token_ids_cpu.copy_(_read(base).reshape(-1)[:n, None])

    def get_output(self):
        self.async_copy_ready_event.synchronize()
        ids = self.sampled_token_ids_cpu.tolist()
        for i in self._invalid:
            ids[i].clear()
        out = self._output
        out.sampled_token_ids = ids
        if self._logprobs is not None:
            out.logprobs = self._logprobs.tolists()
        return out


def _install_async_output() -> None:
    """vLLM's GPU runner makes its async output with CUDA streams and events: on "tpu" it
    makes ``TpuAsyncOutput`` (a process runs one platform)."""
    import vllm.v1.worker.gpu_model_runner as _gmr

    _gmr.AsyncGPUModelRunnerOutput = TpuAsyncOutput


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

    ev, cev, st = torch.Event, torch.cuda.Event, torch.cuda.Stream
    torch.Event, torch.cuda.Event, torch.cuda.Stream = _Event, _Event, _Stream
    try:
        yield
    finally:
        torch.Event, torch.cuda.Event, torch.cuda.Stream = ev, cev, st


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
