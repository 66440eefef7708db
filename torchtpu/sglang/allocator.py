"""The KV-cache slot allocator SGLang's scheduler uses on "tpu" (page size 1)."""
from __future__ import annotations

from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator


class TpuTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """SGLang's token allocator under the constructor an out-of-tree platform is called with
    (it passes ``page_size``). SGLang's paged allocator computes slot indices with Triton
    kernels; page size 1 needs none."""

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort):
        if page_size != 1:
            raise ValueError(f"SGLang on 'tpu' supports page_size=1, got {page_size}")
        super().__init__(size, dtype, device, kvcache, need_sort)
