"""vLLM's attention backend on "tpu": paged attention over ``torch.tpu.ops``.

The KV cache of a layer is one tpu tensor ``[num_blocks, block_size, 2 * kv_heads, head_dim]``
(keys and values interleaved by head, the layout of JAX's Pallas ragged paged attention
kernel). Each forward writes the step's keys and values with ``torch.tpu.ops.kv_cache_update_``
(in place; in a compiled program the cache buffer is donated, so a write costs the tokens
written, not the cache) and attends with ``torch.tpu.ops.ragged_paged_attention``.

The metadata is built on the host from vLLM's ``CommonAttentionMetadata`` (CPU tensors: this
runner prepares inputs on the host) as int32 arrays of fixed shapes: ``slot_mapping`` padded to
the step's token bucket (padding slots are -1: not written), and ``kv_lens`` / ``cu_q_lens`` /
``page_indices`` padded to ``max_num_seqs`` rows. The runner sends them with the step's token
ids and positions as one int32 array (one host-to-device transfer a step; the fields are
slices of it inside the compiled program). Shapes and offsets therefore depend on the bucket
only, so a compiled program serves every step of its bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from . import buckets as _buckets


class TpuPagedAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16,
                                                      torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM's enum member for an out-of-tree backend

    @staticmethod
    def get_impl_cls():
        return TpuPagedAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TpuPagedAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [MultipleOf(1)]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, 2 * num_kv_heads, head_size)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


@dataclass
class TpuPagedAttentionMetadata:
    """The step's metadata: numpy arrays on the host (``host``, see ``host_metadata``) and,
    once the runner has sent the step's inputs, one int32 device array ``packed`` holding
    ``[prefix | slot_mapping (T) | kv_lens (S) | cu_q_lens (S + 1) | num_seqs (1) |
    page_indices (S * pages_per_seq)]`` from offset ``base`` (the runner puts the step's token
    ids and positions first: one transfer a step). The fields are slices of it, taken inside
    the compiled program; the offsets depend on the token bucket only."""
    host: dict
    T: int  # token bucket
    S: int  # max_num_seqs
    pps: int  # pages per sequence
    packed: torch.Tensor | None = None
    base: int = 0

    def _part(self, start: int, n: int) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("tpu attention metadata used before the step's inputs were "
                               "sent to the device (TpuModelRunner._model_forward sends them)")
        b = self.base + start
        return self.packed[b:b + n]

    @property
    def slot_mapping(self) -> torch.Tensor:  # int32 [token bucket]
        return self._part(0, self.T)

    @property
    def kv_lens(self) -> torch.Tensor:  # int32 [max_num_seqs]
        return self._part(self.T, self.S)

    @property
    def cu_q_lens(self) -> torch.Tensor:  # int32 [max_num_seqs + 1]
        return self._part(self.T + self.S, self.S + 1)

    @property
    def num_seqs(self) -> torch.Tensor:  # int32 [1]
        return self._part(self.T + 2 * self.S + 1, 1)

    @property
    def page_indices(self) -> torch.Tensor:  # int32 [max_num_seqs, pages_per_seq]
        return self._part(self.T + 2 * self.S + 2, self.S * self.pps).view(self.S, self.pps)

    def host_parts(self) -> list[np.ndarray]:
        """The host arrays in ``packed``'s order (after the prefix)."""
        h = self.host
        return [h["slot_mapping"], h["kv_lens"], h["cu_q_lens"], h["num_seqs"],
                h["page_indices"].reshape(-1)]


def host_metadata(num_tokens_padded: int, max_seqs: int, pages_per_seq: int,
                  query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                  slot_mapping: np.ndarray) -> dict:
    """The metadata arrays on the host, padded to their fixed shapes."""
    n = len(seq_lens)
    slots = np.full(num_tokens_padded, -1, np.int32)
    slots[:len(slot_mapping)] = slot_mapping
    kv_lens = np.zeros(max_seqs, np.int32)
    kv_lens[:n] = seq_lens
    cu = np.empty(max_seqs + 1, np.int32)
    cu[:n + 1] = query_start_loc[:n + 1]
    cu[n + 1:] = cu[n]
    pages = np.zeros((max_seqs, pages_per_seq), np.int32)
    w = min(pages_per_seq, block_table.shape[1])
    pages[:n, :w] = block_table[:n, :w]
    return dict(slot_mapping=slots, kv_lens=kv_lens, page_indices=pages, cu_q_lens=cu,
                num_seqs=np.array([n], np.int32))


def metadata(host: dict) -> TpuPagedAttentionMetadata:
    """The step's metadata from ``host_metadata``'s arrays (sent to the device with the
    step's token ids and positions by the runner)."""
    S, pps = host["page_indices"].shape
    return TpuPagedAttentionMetadata(host=host, T=len(host["slot_mapping"]), S=S, pps=pps)


class TpuPagedAttentionMetadataBuilder(AttentionMetadataBuilder[TpuPagedAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.vllm_config = vllm_config
        self.block_size = kv_cache_spec.block_size
        self.max_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        max_len = int(vllm_config.model_config.max_model_len)
        self.pages_per_seq = -(-max_len // self.block_size)
        self.token_buckets = _buckets.token_buckets(vllm_config)
        self.device = torch.device("tpu")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpuPagedAttentionMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        T = _buckets.pick(self.token_buckets, m.num_actual_tokens)
        host = host_metadata(
            T, self.max_seqs, self.pages_per_seq,
            m.query_start_loc_cpu.numpy()[:n + 1], _np(m.seq_lens)[:n],
            _np(m.block_table_tensor)[:n], _np(m.slot_mapping)[:m.num_actual_tokens])
        return metadata(host)


def _np(t):
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


class TpuPagedAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None, **kwargs) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("ALiBi is not supported by the tpu attention backend")
        if sinks is not None:
            raise NotImplementedError("attention sinks are not supported by the tpu "
                                      "attention backend")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{attn_type} attention is not supported by the tpu "
                                      "attention backend")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the tpu "
                                      "attention backend")
        if attn_metadata is None:  # a profiling run without a cache
            return output
        md = attn_metadata
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            torch.ops.tpu.kv_cache_update_(kv_cache, key, value, md.slot_mapping)
        out = torch.ops.tpu.ragged_paged_attention(
            query, kv_cache, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            self.scale, self.sliding_window, self.logits_soft_cap, "auto")
        output.copy_(out.view(output.shape))
        return output
