"""The KV pool of SGLang on "tpu": one paged tensor per layer in the layout of
``torch.tpu.ops.ragged_paged_attention``.

SGLang's ``MHATokenToKVPool`` keeps a key and a value buffer per layer, ``[slots, heads,
head_dim]`` each. ``TpuPagedKVPool`` keeps one ``kv_pages`` tensor per layer, ``[pages,
page_size, 2 * heads, head_dim]`` (keys and values interleaved by head, JAX's Pallas kernel
layout), so the attention backend (``attention.py``) hands it to the paged attention op as is.
``k_buffer`` / ``v_buffer`` stay what SGLang expects (``[slots, heads, head_dim]`` per layer):
strided views of the same storage (``[:, 0::2]`` and ``[:, 1::2]`` of the pages flattened to
slots), for SGLang code that reads them (the ``torch_native`` fallback, host offload). The
slot ``s`` is page ``s // page_size``, row ``s % page_size``: SGLang's slot indices (its
``req_to_token`` table) are the op's page table, divided by the page size.

Writes go through ``torch.tpu.ops.kv_cache_update_`` (in place; compiled, the cache buffer is
donated, so a write costs the tokens written).
"""
from __future__ import annotations

import weakref

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

import torchtpu.ops  # noqa: F401  (torch.ops.tpu.kv_cache_update_)


class TpuPagedKVPool(MHATokenToKVPool):
    kv_pages: list[torch.Tensor]
    _current = None  # a weak reference to the process's latest pool (disagg.py)

    @classmethod
    def current(cls):
        return None if cls._current is None else cls._current()

    def _create_buffers_normal(self):
        TpuPagedKVPool._current = weakref.ref(self)
        if self.head_dim != self.v_head_dim or self.use_hnd:
            raise NotImplementedError(
                "TpuPagedKVPool: keys and values of one head size in SGLang's NHD layout only "
                f"(head_dim {self.head_dim}, v_head_dim {self.v_head_dim}, hnd {self.use_hnd})")
        rows = self.size + self.page_size
        pages = -(-rows // self.page_size)
        shape = (pages, self.page_size, 2 * self.head_num, self.head_dim)
        self.kv_pages = [torch.zeros(shape, dtype=self.store_dtype, device=self.device)
                         for _ in range(self.layer_num)]
        flat = [kv.view(pages * self.page_size, 2 * self.head_num, self.head_dim)[:rows]
                for kv in self.kv_pages]
        self.k_buffer = [f[:, 0::2] for f in flat]
        self.v_buffer = [f[:, 1::2] for f in flat]

    def _store_kv_layer(self, layer_idx, loc, cache_k, cache_v):
        torch.ops.tpu.kv_cache_update_(
            self.kv_pages[layer_idx], cache_k.reshape(-1, self.head_num, self.head_dim),
            cache_v.reshape(-1, self.head_num, self.head_dim), loc)

    def get_kv_size_bytes(self):
        n = sum(t.numel() * t.element_size() for t in self.kv_pages)
        return n // 2, n - n // 2
