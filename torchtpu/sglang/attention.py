"""The "torchtpu" attention backend for SGLang: paged attention over ``torch.tpu.ops``.

Every forward (prefill/extend and decode) writes the step's keys and values into the layer's
``kv_pages`` with ``torch.tpu.ops.kv_cache_update_`` and attends with
``torch.tpu.ops.ragged_paged_attention``, the op the vLLM backend uses (torchtpu/ops/
paged_attention.py): one op for the whole batch, no per-request loop. The KV pool is
``TpuPagedKVPool`` (kv_pool.py, the platform's MHA pool). Its page table is SGLang's own
``req_to_token`` (slot indices) divided by the page size, so the metadata is built on the
device from the batch's tensors, without reading anything back to the host:

- ``page_indices`` = ``req_to_token[req_pool_indices][:, ::page_size] // page_size``
- ``kv_lens`` = ``seq_lens`` (prefix + new tokens), ``cu_q_lens`` = cumulative new tokens
  (1 per request in decode), ``num_seqs`` = the batch size.

That is also what lets the decode graph runner (graph_runner.py) build the metadata inside its
compiled program. Layers the op does not cover (cross attention, sliding-window KV pools,
encoder attention, keys and values of different head sizes) run ``torch_native``'s SDPA over
the same pool (its key/value views). Selected with ``--attention-backend torchtpu`` (the
platform's default).
"""
from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from .kv_pool import TpuPagedKVPool
from .names import ATTENTION_BACKEND as NAME


class _Metadata:
    __slots__ = ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")

    def __init__(self, kv_lens, page_indices, cu_q_lens, num_seqs):
        self.kv_lens, self.page_indices = kv_lens, page_indices
        self.cu_q_lens, self.num_seqs = cu_q_lens, num_seqs


MIN_KV_WIDTH = 64


def kv_width(forward_batch, page_size: int, full: int) -> int | None:
    """The page-table width a compiled program needs for ``forward_batch``: the longest
    sequence (SGLang's host copy of the lengths, so no sync) rounded up to a power of two
    (at least ``MIN_KV_WIDTH``) and to whole pages, at most the table's ``full`` width; None
    (the full table) without the host lengths. The paged attention op's cost grows with the
    page table's width, which is SGLang's maximum context length otherwise."""
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    if lens is None or lens.numel() == 0:
        return None
    w = MIN_KV_WIDTH
    top = int(lens.max())
    while w < top:
        w *= 2
    w = -(-w // page_size) * page_size
    return w if w < full else None


class TpuPagedAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.page_size = int(model_runner.page_size)
        self.paged = isinstance(self.token_to_kv_pool, TpuPagedKVPool)
        self.md = None

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.md = self.metadata(forward_batch) if self.paged else None

    def metadata(self, fb) -> _Metadata | None:
        """The op's metadata from the batch's device tensors (traceable: no host reads)."""
        mode = fb.forward_mode
        if mode.is_idle() or fb.req_pool_indices is None:
            return None
        P = self.page_size
        table = self.req_to_token_pool.req_to_token
        width = getattr(fb, "torchtpu_kv_width", None)
        if width is not None:  # a compiled bucket's KV width (kv_width): no longer than that
            table = table[:, :width]
        rows = table[fb.req_pool_indices]
        if P > 1:
            rows = rows[:, ::P]
        page_indices = torch.div(rows, P, rounding_mode="floor").to(torch.int32)
        kv_lens = fb.seq_lens.to(torch.int32)
        b = kv_lens.shape[0]
        if mode.is_decode():
            cu = torch.arange(b + 1, dtype=torch.int32, device=kv_lens.device)
        elif mode.is_extend() and fb.extend_seq_lens is not None:
            cu = torch.nn.functional.pad(torch.cumsum(fb.extend_seq_lens, 0).to(torch.int32),
                                         (1, 0))
        else:
            return None
        num_seqs = torch.full((1,), b, dtype=torch.int32, device=kv_lens.device)
        return _Metadata(kv_lens, page_indices, cu, num_seqs)

    def _covered(self, layer) -> bool:
        return (self.paged and self.md is not None and not layer.is_cross_attention
                and not self.use_sliding_window_kv_pool
                and layer.attn_type == AttentionType.DECODER
                and layer.qk_head_dim == layer.v_head_dim
                and (layer.sliding_window_size is None or layer.sliding_window_size < 0))

    def _paged(self, q, k, v, layer, forward_batch, save_kv_cache):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        pool = self.token_to_kv_pool
        kv = pool.kv_pages[layer.layer_id - pool.start_layer]
        md = self.md
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        cap = float(layer.logit_cap) if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0 \
            else None
        out = torch.ops.tpu.ragged_paged_attention(
            q.reshape(-1, hq, d).to(kv.dtype), kv, md.kv_lens, md.page_indices, md.cu_q_lens,
            md.num_seqs, float(layer.scaling), None, cap, "auto")
        return out.reshape(-1, hq * layer.v_head_dim).to(q.dtype)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not self._covered(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._paged(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not self._covered(layer):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self._paged(q, k, v, layer, forward_batch, save_kv_cache)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1


def register() -> None:
    """Make the backend SGLang's ``--attention-backend torchtpu`` (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(TpuPagedAttnBackend)
