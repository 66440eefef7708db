"""Token and request buckets: the shapes every compiled program of a vLLM engine on "tpu" has.

A step's tokens are padded up to a *token bucket* (``compilation_config.compile_sizes`` when the
user gives them, else powers of two from 16 up to ``max_num_batched_tokens``, which is always
the last bucket), and the rows whose logits are computed up to a *request bucket* (powers of two
from 8 up to ``max_num_seqs``). Every bucket is compiled and run once at start-up, so serving
requests of any length afterwards compiles nothing.
"""
from __future__ import annotations

import bisect


def _powers(lo: int, hi: int) -> list[int]:
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return sorted(set(out))


def token_buckets(vllm_config) -> list[int]:
    top = int(vllm_config.scheduler_config.max_num_batched_tokens)
    sizes = getattr(vllm_config.compilation_config, "compile_sizes", None) or []
    sizes = sorted({int(s) for s in sizes if isinstance(s, int) or str(s).isdigit()})
    if sizes:
        return sorted({s for s in sizes if s < top} | {top})
    return _powers(min(16, top), top)


def request_buckets(vllm_config) -> list[int]:
    top = int(vllm_config.scheduler_config.max_num_seqs)
    return _powers(min(8, top), top)


def pick(buckets: list[int], n: int) -> int:
    """The smallest bucket holding ``n``."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} is above the largest bucket {buckets[-1]}")
    return buckets[i]
