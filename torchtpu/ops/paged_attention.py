"""Paged attention over a paged KV cache: ``torch.tpu.ops.ragged_paged_attention`` and the KV
cache write ``torch.tpu.ops.kv_cache_update_``.

Both are torch custom ops in the ``tpu`` namespace (``torch.ops.tpu.*``) with fake kernels, and
their lowerings (``lowering/paged_attention.py``, pure JAX) are entries of the one lowering
table: Strict and Fused eager run them as any aten op, and graphs compiled with
``torch.compile(backend="tpu")`` lower them inline (the write arrives there functionalized as
``auto_functionalized_v2``, lowered by ``lowering/hops.py``; the cache is a graph input that the
program overwrites, so its buffer is donated and XLA updates it in place). The layout is the one
of JAX's Pallas TPU kernel (see the lowering module): a vLLM or SGLang attention backend, or a
long-context model, calls them the same way::

    torch.tpu.ops.kv_cache_update_(kv_pages, k, v, slot_mapping)     # writes the new tokens
    out = torch.tpu.ops.ragged_paged_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=d ** -0.5)

- ``q`` ``[tokens, q_heads, head_dim]``; ``kv_pages`` ``[pages, page_size, 2 * kv_heads,
  head_dim]`` (keys and values interleaved by head); ``kv_lens`` int32 ``[max_seqs]`` (lengths
  including the new tokens); ``page_indices`` int32 ``[max_seqs, pages_per_seq]``;
  ``cu_q_lens`` int32 ``[max_seqs + 1]``; ``num_seqs`` int32 ``[1]``. Tokens past the last
  sequence (bucket padding) get zeros. Causal within each sequence; ``sliding_window`` and
  ``soft_cap`` as in JAX's kernel.
- ``key``/``value`` ``[tokens, kv_heads, head_dim]``, ``slot_mapping`` ``[tokens]``: token t
  goes to page ``slot // page_size``, row ``slot % page_size``; a negative slot is skipped.
- ``impl``: ``"auto"`` (the Pallas kernel JAX ships for the device's platform where it applies,
  else the portable XLA lowering), ``"xla"``, ``"pallas_tpu"``, ``"pallas_gpu"``.

CPU tensors run the same JAX functions on JAX's CPU backend (references, tests).
"""
from __future__ import annotations

import jax
import numpy as np
import torch

from ..lowering import paged_attention as _low
from ..lowering import registry

__all__ = ["ragged_paged_attention", "kv_cache_update_"]

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define(
    "ragged_paged_attention(Tensor q, Tensor kv_pages, Tensor kv_lens, Tensor page_indices, "
    "Tensor cu_q_lens, Tensor num_seqs, float sm_scale=1.0, SymInt? sliding_window=None, "
    "float? soft_cap=None, str impl='auto') -> Tensor")
_lib.define(
    "kv_cache_update_(Tensor(a!) kv_pages, Tensor key, Tensor value, Tensor slot_mapping) -> ()")

_RPA = torch.ops.tpu.ragged_paged_attention.default
_KVU = torch.ops.tpu.kv_cache_update_.default


def _rpa_lowering(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0,
                  sliding_window=None, soft_cap=None, impl="auto"):
    return _low.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                       sm_scale=sm_scale, sliding_window=sliding_window,
                                       soft_cap=soft_cap, impl=impl)


def _kvu_lowering(kv_pages, key, value, slot_mapping):
    return _low.kv_cache_update(kv_pages, key, value, slot_mapping)


registry.register(_RPA, reads_precision=True)(_rpa_lowering)
registry.register(_KVU, check=(_low.kv_cache_update_check, IndexError,
                               "kv_cache_update_: slot_mapping out of range of the KV cache"))(
    _kvu_lowering)


def _check_args(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    if q.dim() != 3 or kv_pages.dim() != 4:
        raise RuntimeError(
            "ragged_paged_attention: expected q [tokens, q_heads, head_dim] and kv_pages [pages, "
            f"page_size, 2 * kv_heads, head_dim], got {list(q.shape)} and {list(kv_pages.shape)}")
    if kv_pages.shape[2] % 2 or q.shape[2] != kv_pages.shape[3] \
            or q.shape[1] % (kv_pages.shape[2] // 2):
        raise RuntimeError(
            f"ragged_paged_attention: q {list(q.shape)} does not fit kv_pages "
            f"{list(kv_pages.shape)} (head_dim must agree, q_heads a multiple of kv_heads)")
    S = page_indices.shape[0]
    if kv_lens.shape != (S,) or cu_q_lens.shape != (S + 1,) or num_seqs.numel() != 1:
        raise RuntimeError(
            f"ragged_paged_attention: expected kv_lens [{S}], cu_q_lens [{S + 1}] and num_seqs "
            f"[1] for page_indices {list(page_indices.shape)}, got {list(kv_lens.shape)}, "
            f"{list(cu_q_lens.shape)}, {list(num_seqs.shape)}")
    for name, t in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        if t.dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"ragged_paged_attention: {name} must be an integer tensor, "
                               f"got {t.dtype}")


@torch.library.register_fake("tpu::ragged_paged_attention")
def _rpa_fake(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0,
              sliding_window=None, soft_cap=None, impl="auto"):
    _check_args(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    return torch.empty_like(q)


@torch.library.register_fake("tpu::kv_cache_update_")
def _kvu_fake(kv_pages, key, value, slot_mapping):
    return None


# ---- kernels: tpu tensors through the eager executors, CPU tensors through JAX's CPU backend ----

def _np(t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _cpu_rpa(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0,
             sliding_window=None, soft_cap=None, impl="auto"):
    _check_args(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(_np(t), cpu) for t in
            (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)]
    out = jax.jit(_rpa_lowering, static_argnums=(6, 7, 8, 9))(
        *args, float(sm_scale), sliding_window, soft_cap, impl if impl != "auto" else "xla")
    return _to_torch(np.asarray(out), q.dtype)


def _cpu_kvu(kv_pages, key, value, slot_mapping):
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(_np(t), cpu) for t in (kv_pages, key, value, slot_mapping)]
    if not bool(_low.kv_cache_update_check(*args)):
        raise IndexError("kv_cache_update_: slot_mapping out of range of the KV cache")
    new = jax.jit(_kvu_lowering)(*args)
    kv_pages.copy_(_to_torch(np.asarray(new), kv_pages.dtype))


def _to_torch(a, dtype):
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))


_lib.impl("ragged_paged_attention", _cpu_rpa, "CPU")
_lib.impl("kv_cache_update_", _cpu_kvu, "CPU")


def _bind_device_kernels():
    from ..eager import kernels

    kernels.bind_lowering(registry.get(_RPA))
    kernels.bind_lowering(registry.get(_KVU))


_bind_device_kernels()


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: float = 1.0, sliding_window: int | None = None,
                           soft_cap: float | None = None, impl: str = "auto"):
    """Attention of each token's query over its sequence's pages (see the module docstring)."""
    return _RPA(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, float(sm_scale),
                sliding_window, None if soft_cap is None else float(soft_cap), impl)


def kv_cache_update_(kv_pages, key, value, slot_mapping):
    """Write ``key``/``value`` into ``kv_pages`` at ``slot_mapping`` in place (returns None)."""
    _KVU(kv_pages, key, value, slot_mapping)
