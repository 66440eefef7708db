"""The "torchtpu" attention backend for SGLang: decode attention as one batched, padded SDPA.

SGLang's ``torch_native`` backend loops over the requests of a batch and runs SDPA on each
request's KV slots, whose length grows by one every decode step: on "tpu" every op of that
loop is a new program shape at every step (a compile per op, per request length). Here a
decode step gathers each request's KV slots up to a bucket length (the batch's longest
sequence rounded up to a power of two, at least ``MIN_BUCKET``, at most the request pool's
width), masks the slots past each request's length, and runs one SDPA for the batch: the
shapes change only when the bucket does. Prefill (extend) keeps ``torch_native``'s
per-request SDPA. Selected with ``--attention-backend torchtpu`` (the platform's default).
"""
from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from .platform import ATTENTION_BACKEND as NAME
MIN_BUCKET = 64


def kv_bucket(longest: int, width: int, minimum: int = MIN_BUCKET) -> int:
    """The padded KV length for a batch whose longest sequence is ``longest`` slots."""
    b = minimum
    while b < longest:
        b *= 2
    return min(b, width)


class TpuNativeAttnBackend(TorchNativeAttnBackend):
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if (layer.is_cross_attention or self.use_sliding_window_kv_pool
                or (layer.sliding_window_size is not None and layer.sliding_window_size > -1)):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        hq, hk = layer.tp_q_head_num, layer.tp_k_head_num
        q = q.reshape(-1, hq, layer.qk_head_dim)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        req_to_token = self.req_to_token_pool.req_to_token
        seq_lens_cpu = forward_batch.seq_lens_cpu
        longest = (int(seq_lens_cpu.max()) if seq_lens_cpu is not None
                   else int(forward_batch.seq_lens.max()))  # a host sync without the cpu copy
        width = kv_bucket(longest, req_to_token.shape[1])
        slots = req_to_token[forward_batch.req_pool_indices, :width]           # (b, L)
        keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id)[slots]     # (b, L, hk, d)
        values = self.token_to_kv_pool.get_value_buffer(layer.layer_id)[slots]
        live = (torch.arange(width, device=slots.device)[None, :]
                < forward_batch.seq_lens[:, None])                             # (b, L)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2),                                                    # (b, hq, 1, d)
            keys.transpose(1, 2), values.transpose(1, 2),                      # (b, hk, L, d)
            attn_mask=live[:, None, None, :], scale=layer.scaling, enable_gqa=hq != hk)
        return out.reshape(q.shape[0], hq * layer.v_head_dim)


def register() -> None:
    """Make the backend SGLang's ``--attention-backend torchtpu`` (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if NAME not in ATTENTION_BACKENDS:
        register_attention_backend(NAME)(TpuNativeAttnBackend)
