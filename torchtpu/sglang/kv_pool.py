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

On XLA:CPU a bf16/f16 model's pool is stored as float32 (``ops/_kv_storage.py``: XLA:CPU
would convert the whole 16-bit pool to float32 and back in every step's program); the values
are the model dtype's, widened exactly. SGLang's ``dtype``/``store_dtype`` stay the model's;
``kv_pages`` (and the ``k_buffer``/``v_buffer`` views) are float32, and the key/value buffers
SGLang code reads are narrowed back to the model's dtype. ``budget_bytes`` halves SGLang's
profiled KV byte budget accordingly (a hook after ``KVCacheConfigurator.
_profile_available_bytes``, installed by the plugin), so the pool holds its size in bytes.
"""
from __future__ import annotations

import weakref

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

import torchtpu.ops  # noqa: F401  (torch.ops.tpu.kv_cache_update_)
from torchtpu.ops._kv_storage import kv_storage_dtype


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
        stored = kv_storage_dtype(self.store_dtype)
        self.kv_pages = [torch.zeros(shape, dtype=stored, device=self.device)
                         for _ in range(self.layer_num)]
        flat = [kv.view(pages * self.page_size, 2 * self.head_num, self.head_dim)[:rows]
                for kv in self.kv_pages]
        self.k_buffer = [f[:, 0::2] for f in flat]
        self.v_buffer = [f[:, 1::2] for f in flat]

    def _get_key_buffer(self, layer_id):
        return self._narrow(super()._get_key_buffer(layer_id))

    def _get_value_buffer(self, layer_id):
        return self._narrow(super()._get_value_buffer(layer_id))

    def _narrow(self, t):
        # a pool stored wider than the model's dtype (kv_storage_dtype) is read in the model's
        # dtype by SGLang's code (the torch_native fallback for layers the paged op does
        # not cover); the paged attention op reads kv_pages as stored
        return t if t.dtype == self.dtype or self.store_dtype != self.dtype else t.to(self.dtype)

    def _store_kv_layer(self, layer_idx, loc, cache_k, cache_v):
        torch.ops.tpu.kv_cache_update_(
            self.kv_pages[layer_idx], cache_k.reshape(-1, self.head_num, self.head_dim),
            cache_v.reshape(-1, self.head_num, self.head_dim), loc)

    def get_kv_size_bytes(self):
        n = sum(t.numel() * t.element_size() for t in self.kv_pages)
        return n // 2, n - n // 2


def budget_bytes(result, configurator, *args, **kwargs):
    """After SGLang's ``KVCacheConfigurator._profile_available_bytes``: the KV byte budget in
    bytes of the model's KV dtype, scaled down where this pool stores it wider (float32 for a
    16-bit model on XLA:CPU), so the pool SGLang sizes from it takes the bytes profiled. MLA
    models use SGLang's own pools (no ``TpuPagedKVPool``): unchanged."""
    if getattr(configurator, "use_mla_backend", False):
        return None
    dtype = configurator.kv_cache_dtype
    stored = kv_storage_dtype(dtype)
    if stored == dtype:
        return None
    return int(result) * dtype.itemsize // stored.itemsize
