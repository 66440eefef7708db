"""Indexing lowerings: gathers, scatters, advanced indexing, masks, embeddings, and the ops
whose output shape depends on data (nonzero, masked_select, unique: registry flag
``dynamic_shape``; they run un-jitted on concrete arrays and count as host syncs).

Index bounds need the data, so they are not checked before the op as on CPU: the gathers and
scatters below carry a ``check`` (registry.py), computed inside the op's program and raised at
the next host sync, like CUDA's device-side asserts (eager/checks.py; every executor).
The value computed with a bad index is JAX's (clamped or filled reads, dropped writes), and is
never returned without the error being raised at that sync. Negative indices wrap, as in
PyTorch's advanced indexing.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ._util import canonical_dim, cast, jdtype, result_type
from . import registry
from .registry import aten, register


_MASK_DTYPES = (torch.bool, torch.uint8)


def _dim(dim, ndim):
    return canonical_dim(dim, ndim)


def _is_concrete(x):
    return not isinstance(x, jax.core.Tracer)


def _at(arr, tup, src, how, mode=None):
    """``arr.at[tup].<how>(src)``; bool arrays combine like PyTorch (add = or, multiply = and,
    max = or, min = and), which jax's scatter-add/mul do not accept for bool."""
    if arr.dtype == jnp.bool_ and how != "set":
        res = getattr(arr.astype(jnp.int32).at[tup], how)(jnp.asarray(src).astype(jnp.int32),
                                                          mode=mode)
        return res != 0
    return getattr(arr.at[tup], how)(src, mode=mode)


# ---- bounds checks (registry ``check``: True when every index is in range) ----

def _in_range(index, size, negative_ok=False):
    index = jnp.asarray(index)
    lo = -size if negative_ok else 0
    return jnp.all((index >= lo) & (index < size))


def _size_along(self, dim):
    return 1 if self.ndim == 0 else self.shape[_dim(dim, self.ndim)]


def _dim_index_ok(self, dim, index, *args, **kwargs):
    return _in_range(index, _size_along(self, dim))


def _take_ok(self, index):
    return _in_range(index, max(self.size, 0), negative_ok=True)


def _embedding_ok(weight, indices, *args, **kwargs):
    return _in_range(indices, weight.shape[0])


def _index_ok(self, indices, *args, **kwargs):
    """Advanced indexing: each integer index tensor within its dim (negatives allowed)."""
    ok = jnp.asarray(True)
    d = 0
    for ix in indices:
        if ix is None:
            d += 1
        elif ix.dtype in (jnp.bool_, jnp.uint8):
            d += ix.ndim
        else:
            if d < self.ndim:
                ok = ok & _in_range(ix, self.shape[d], negative_ok=True)
            d += 1
    return ok


_OUT_OF_RANGE = (_dim_index_ok, IndexError, "index out of range in self")
_GATHER_BOUNDS = (_dim_index_ok, RuntimeError, "gather(): index out of bounds for the gathered "
                  "dimension")
_SCATTER_BOUNDS = (_dim_index_ok, RuntimeError, "scatter(): index out of bounds for the "
                   "scattered dimension")
_INDEX_BOUNDS = (_index_ok, IndexError, "index is out of bounds for the indexed dimension")


# ---- index_select / gather / take ----

@register(aten.index_select.default, check=_OUT_OF_RANGE)
def index_select(self, dim, index):
    if index.ndim > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    if self.ndim == 0:
        return jnp.take(self.reshape(1), index.reshape(-1), axis=0).reshape(())
    d = _dim(dim, self.ndim)
    return jnp.take(self, index.reshape(-1), axis=d)


def _gather_along(self, dim, index):
    """torch.gather: ``index`` may be smaller than ``self`` in every dim but ``dim``."""
    if self.ndim == 0 or index.ndim == 0:
        s = self.reshape(1) if self.ndim == 0 else self
        out = jnp.take_along_axis(s.reshape(-1), index.reshape(-1), axis=0)
        return out.reshape(index.shape)
    d = _dim(dim, self.ndim)
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    part = self[tuple(slice(None) if i == d else slice(0, n) for i, n in enumerate(index.shape))]
    return jnp.take_along_axis(part, index, axis=d)


@register(aten.gather.default, check=_GATHER_BOUNDS)
def gather(self, dim, index, *, sparse_grad=False):
    return _gather_along(self, dim, index)


@register(aten.take.default,
          check=(_take_ok, IndexError, "take(): index out of range for the tensor's elements"))
def take(self, index):
    return self.reshape(-1)[index]


@register(aten.put.default)
def put(self, index, source, accumulate=False):
    flat = self.reshape(-1)
    upd = flat.at[index.reshape(-1)]
    src = source.reshape(-1).astype(self.dtype)
    flat = _at(flat, index.reshape(-1), src, "add") if accumulate else upd.set(src)
    return flat.reshape(self.shape)


# ---- scatter family ----

def _scatter_index(index, dim):
    """The full index tuple addressing ``self`` for each element of ``index`` along ``dim``."""
    return tuple(index if d == dim else lax.broadcasted_iota(index.dtype, index.shape, d)
                 for d in range(index.ndim))


def _src_part(src, index):
    if not hasattr(src, "shape"):
        return src
    if src.ndim == 0:
        return src
    return src[tuple(slice(0, n) for n in index.shape)]


def _identity(reduce, dtype):
    jd = jnp.dtype(dtype)
    if reduce in ("sum", "mean", "add"):
        return jnp.zeros((), jd)
    if reduce in ("prod", "multiply"):
        return jnp.ones((), jd)
    big = reduce == "amin"
    if jd == jnp.bool_:
        return jnp.asarray(big, jd)
    if jnp.issubdtype(jd, jnp.floating):
        return jnp.asarray(jnp.inf if big else -jnp.inf, jd)
    info = jnp.iinfo(jd)
    return jnp.asarray(info.max if big else info.min, jd)


def _reduce_at(self, tup, src, reduce, include_self=True):
    """``self`` with ``src`` reduced into the positions ``self[tup]`` (duplicates combine)."""
    src = jnp.asarray(src).astype(self.dtype) if not hasattr(src, "astype") else src.astype(self.dtype)
    base = self
    if not include_self:
        base = self.at[tup].set(_identity(reduce, self.dtype))
    if reduce in ("sum", "add"):
        return _at(base, tup, src, "add")
    if reduce in ("prod", "multiply"):
        return _at(base, tup, src, "multiply")
    if reduce == "amax":
        return _at(base, tup, src, "max")
    if reduce == "amin":
        return _at(base, tup, src, "min")
    if reduce == "mean":
        total = _at(base, tup, src, "add")
        ones = jnp.ones(jnp.broadcast_shapes(jnp.shape(src), self[tup].shape), jnp.int64)
        count = jnp.full(self.shape, 1 if include_self else 0, jnp.int64).at[tup].add(ones)
        count = jnp.maximum(count, 1)
        if jnp.issubdtype(self.dtype, jnp.floating) or jnp.issubdtype(self.dtype, jnp.complexfloating):
            return (total / count.astype(self.dtype)).astype(self.dtype)
        return jnp.floor_divide(total, count.astype(self.dtype)).astype(self.dtype)
    raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")


def _scatter(self, dim, index, src, reduce=None, include_self=True):
    if self.ndim == 0:
        out = _scatter(self.reshape(1), 0, index.reshape(1) if index.ndim == 0 else index,
                       src.reshape(1) if hasattr(src, "ndim") and src.ndim == 0 else src,
                       reduce, include_self)
        return out.reshape(())
    d = _dim(dim, self.ndim)
    if index.ndim == 0:
        index = index.reshape((1,) * self.ndim)
    if index.size == 0:
        return self
    tup = _scatter_index(index, d)
    part = _src_part(src, index)
    if reduce is None:
        return self.at[tup].set(jnp.asarray(part).astype(self.dtype))
    return _reduce_at(self, tup, part, reduce, include_self)


@register(aten.scatter.src, aten.scatter.value, check=_SCATTER_BOUNDS)
def scatter(self, dim, index, src):
    return _scatter(self, dim, index, src)


@register(aten.scatter.reduce, aten.scatter.value_reduce, check=_SCATTER_BOUNDS)
def scatter_reduce_legacy(self, dim, index, src, *, reduce):
    if reduce not in ("add", "multiply"):
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce}")
    return _scatter(self, dim, index, src, reduce)


@register(aten.scatter_add.default, check=_SCATTER_BOUNDS)
def scatter_add(self, dim, index, src):
    return _scatter(self, dim, index, src, "sum")


@register(aten.scatter_reduce.two, check=_SCATTER_BOUNDS)
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    return _scatter(self, dim, index, src, reduce, include_self)


# ---- index_add / index_copy / index_fill / index_reduce ----

def _index_dim(self, dim, index, source, fn):
    """Apply ``fn(array, tup, src)`` where ``tup`` selects ``index`` along ``dim``."""
    idx = index.reshape(-1)
    if self.ndim == 0:
        src = source.reshape(-1) if hasattr(source, "ndim") else source
        return fn(self.reshape(1), (idx,), src).reshape(())
    d = _dim(dim, self.ndim)
    src = source
    if hasattr(source, "ndim") and source.ndim > 0:
        src = source.reshape(self.shape[:d] + (idx.shape[0],) + self.shape[d + 1:])
    elif hasattr(source, "ndim") and source.ndim == 0 and fn is not _fill_fn:
        src = source.reshape((1,) * self.ndim)
    return fn(self, (slice(None),) * d + (idx,), src)


def _fill_fn(a, tup, v):
    return a.at[tup].set(jnp.asarray(v).astype(a.dtype))


@register(aten.index_add.default, check=_OUT_OF_RANGE)
def index_add(self, dim, index, source, *, alpha=1):
    def fn(a, tup, src):
        src = src.astype(a.dtype)
        if alpha != 1:
            src = src * jnp.asarray(alpha).astype(a.dtype)
        return _at(a, tup, src, "add")
    return _index_dim(self, dim, index, source, fn)


@register(aten.index_copy.default,
          check=(_dim_index_ok, IndexError, "index_copy_(): index out of bounds for the dimension"))
def index_copy(self, dim, index, source):
    return _index_dim(self, dim, index, source, lambda a, tup, src: a.at[tup].set(src.astype(a.dtype)))


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor,
          check=(_dim_index_ok, IndexError, "index_fill_(): index out of bounds for the dimension"))
def index_fill(self, dim, index, value):
    return _index_dim(self, dim, index, value, _fill_fn)


@register(aten.index_reduce.default, check=_OUT_OF_RANGE)
def index_reduce(self, dim, index, source, reduce, *, include_self=True):
    return _index_dim(self, dim, index, source,
                      lambda a, tup, src: _reduce_at(a, tup, src, reduce, include_self))


# ---- advanced indexing: index.Tensor, index_put ----

def _has_mask(indices):
    """Any boolean/byte mask among the indices (torch tensors in eager, arrays in a graph)."""
    for i in indices:
        if i is None:
            continue
        dt = i.dtype if isinstance(i, torch.Tensor) else jdtype(i)
        if dt in _MASK_DTYPES:
            return True
    return False


def _index_dynamic(args, kwargs):
    """index.Tensor with a boolean mask: the result's length is the mask's count."""
    return _has_mask(args[1])


def _index_put_dynamic(args, kwargs):
    """index_put with a mask, unless the mask is the only index and one value is written."""
    values = args[2] if len(args) > 2 else kwargs["values"]
    if not _has_mask(args[1]):
        return False
    # jitted only for one mask and one value (a padded static-size nonzero, padding dropped);
    # a mask next to other index tensors must broadcast with its (data-dependent) count
    n_index = sum(1 for i in args[1] if i is not None)
    return n_index != 1 or math.prod(values.shape) != 1


def _index_tuple(x, indices, for_write=False):
    """numpy-style index tuple for aten's ``indices`` (None = whole dim, masks expanded)."""
    tup = []
    drop = False
    d = 0
    for ix in indices:
        if ix is None:
            tup.append(slice(None))
            d += 1
            continue
        if ix.dtype in (jnp.bool_, jnp.uint8):
            m = ix.astype(jnp.bool_)
            for k in range(m.ndim):
                if m.shape[k] != x.shape[d + k]:
                    raise IndexError(f"The shape of the mask {list(m.shape)} at index {k} does "
                                     f"not match the shape of the indexed tensor "
                                     f"{list(x.shape)} at index {d + k}")
            if _is_concrete(m):
                nz = np.nonzero(np.asarray(m))
            else:  # jitted write of one value: padded nonzero, padding dropped
                fill = tuple(x.shape[d + k] for k in range(m.ndim))
                nz = jnp.nonzero(m, size=m.size, fill_value=fill)
                drop = True
            if m.ndim == 0:
                # x[True] / x[False]: a new leading dim of size 1 / 0
                if sum(1 for i in indices if i is not None) != 1:
                    raise NotImplementedError("index with a 0-dim boolean mask next to other "
                                              "index tensors is not supported on tpu")
                return None, m
            tup.extend(jnp.asarray(z, jnp.int64) for z in nz)
            d += m.ndim
        else:
            tup.append(ix)
            d += 1
    if d > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim} "
                         f"(got {d})")
    return tuple(tup), drop


def _index(self, indices):
    tup, extra = _index_tuple(self, indices)
    if tup is None:  # 0-d mask
        return self[None][: int(np.asarray(extra))]
    return self[tup]


@register(aten.index.Tensor, dynamic_shape=_index_dynamic, check=_INDEX_BOUNDS)
def index(self, indices):
    return _index(self, indices)


@register(aten._unsafe_index.Tensor, dynamic_shape=_index_dynamic)
def unsafe_index(self, indices):
    return _index(self, indices)


def _index_put(self, indices, values, accumulate):
    tup, drop = _index_tuple(self, indices, True)
    values = values.astype(self.dtype)
    if tup is None:  # 0-d mask
        m = drop
        upd = (self + values) if accumulate else jnp.broadcast_to(values, self.shape)
        return jnp.where(m, upd, self)
    mode = "drop" if drop else None
    return _at(self, tup, values, "add" if accumulate else "set", mode)


@register(aten.index_put.default, dynamic_shape=_index_put_dynamic, check=_INDEX_BOUNDS)
def index_put(self, indices, values, accumulate=False):
    return _index_put(self, indices, values, accumulate)


@register(aten._index_put_impl.default, dynamic_shape=_index_put_dynamic,
          check=_INDEX_BOUNDS)
def index_put_impl(self, indices, values, accumulate=False, unsafe=False):
    return _index_put(self, indices, values, accumulate)


@register(aten._unsafe_index_put.default, dynamic_shape=_index_put_dynamic)
def unsafe_index_put(self, indices, values, accumulate=False):
    return _index_put(self, indices, values, accumulate)


# ---- masks and where ----

@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    if mask.dtype != jnp.bool_:
        raise RuntimeError(f"masked_fill_ only supports boolean masks, but got mask with dtype "
                           f"{str(jdtype(mask)).replace('torch.', '')}")
    v = jnp.asarray(value).astype(self.dtype)
    return jnp.where(mask, v, self)


@register(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    x = jnp.broadcast_to(self, shape).reshape(-1)
    m = jnp.broadcast_to(mask.astype(jnp.bool_), shape).reshape(-1)
    src = source.reshape(-1).astype(self.dtype)
    if src.shape[0] == 0:
        return jnp.broadcast_to(self, shape)
    pos = jnp.clip(jnp.cumsum(m.astype(jnp.int64)) - 1, 0, src.shape[0] - 1)
    return jnp.where(m, src[pos], x).reshape(shape)


@register(aten.where.self)
def where(condition, self, other):
    dt = result_type(self, other)
    return jnp.where(condition.astype(jnp.bool_), cast(self, dt), cast(other, dt))


# ---- embeddings ----

@register(aten.embedding.default,
          check=(_embedding_ok, IndexError, "index out of range in self"))
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@register(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    """Rows of ``self`` named in ``indices`` whose norm exceeds ``max_norm`` are rescaled to it."""
    x = self.astype(jnp.float32) if self.dtype in (jnp.bfloat16, jnp.float16) else self
    if norm_type == float("inf"):
        norm = jnp.max(jnp.abs(x), axis=1)
    else:
        norm = jnp.sum(jnp.abs(x) ** norm_type, axis=1) ** (1.0 / norm_type)
    hit = jnp.zeros((self.shape[0],), jnp.bool_).at[indices.reshape(-1)].set(True)
    scale = jnp.where(hit & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
    return (x * scale[:, None].astype(x.dtype)).astype(self.dtype)


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = grad_output.reshape(idx.shape[0], -1) if idx.shape[0] else \
        grad_output.reshape(0, grad_output.shape[-1])
    if padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), g.dtype), g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), jnp.int64).at[idx].add(1)
        g = g / counts[idx][:, None].astype(g.dtype)
    out = jnp.zeros((num_weights, g.shape[1]), g.dtype)
    return out.at[idx].add(g)


# embedding_bag: mode 0 = sum, 1 = mean, 2 = max. offset2bag is always the full bag id of each
# index (the backward lowerings below read it); bag_size counts the non-padding entries.

def _bags(indices, offsets, include_last_offset):
    n = indices.shape[0]
    b = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    starts = offsets[:b]
    bag = jnp.searchsorted(starts, jnp.arange(n, dtype=starts.dtype), side="right") - 1
    return jnp.clip(bag, 0, max(b - 1, 0)).astype(jnp.int64), b


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    idx = indices.reshape(-1)
    bag, b = _bags(idx, offsets, include_last_offset)
    d = weight.shape[1]
    valid = idx != padding_idx
    if include_last_offset:  # indices past the last offset belong to no bag (offset2bag = b)
        inside = jnp.arange(idx.shape[0]) < offsets[-1]
        valid = valid & inside
        bag = jnp.where(inside, bag, b)
    out_dtype = weight.dtype
    if weight.dtype in (jnp.bfloat16, jnp.float16):  # accumulate in float32, like CPU
        weight = weight.astype(jnp.float32)
    rows = jnp.take(weight, idx, axis=0)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(rows.dtype)[:, None]
    count = jnp.zeros((b,), jnp.int64).at[bag].add(valid.astype(jnp.int64), mode="drop")
    zero = jnp.zeros((), weight.dtype)
    if mode == 2:
        neg = jnp.asarray(-jnp.inf, weight.dtype)
        out = jnp.full((b, d), neg).at[bag].max(jnp.where(valid[:, None], rows, neg), mode="drop")
        out = jnp.where(count[:, None] > 0, out, zero)
        # the row that gave each max: first position holding it
        n = idx.shape[0]
        is_max = valid[:, None] & (rows == out[jnp.minimum(bag, b - 1)])
        pos = jnp.where(is_max, jnp.arange(n)[:, None], n)
        first = jnp.full((b, d), n).at[bag].min(pos, mode="drop")
        max_idx = jnp.where(first < n, jnp.take(idx, jnp.minimum(first, max(n - 1, 0))), 0)
        return out.astype(out_dtype), bag, count, max_idx.astype(jnp.int64)
    out = jnp.zeros((b, d), weight.dtype).at[bag].add(jnp.where(valid[:, None], rows, zero),
                                                       mode="drop")
    if mode == 1:
        out = out / jnp.maximum(count, 1).astype(weight.dtype)[:, None]
        return out.astype(out_dtype), bag, count, count
    return out.astype(out_dtype), bag, jnp.zeros((b,), jnp.int64), jnp.zeros((b,), jnp.int64)


@register(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    idx = indices.reshape(-1)
    nb = grad.shape[0]
    valid = (idx != padding_idx) & (offset2bag < nb)  # offset2bag == nb: in no bag
    offset2bag = jnp.minimum(offset2bag, max(nb - 1, 0))
    zero = jnp.zeros((), grad.dtype)
    gw = jnp.zeros((num_weights, grad.shape[1]), grad.dtype)
    if mode == 2:
        nonempty = (bag_size > 0)[:, None]
        cols = jnp.broadcast_to(jnp.arange(grad.shape[1]), grad.shape)
        return gw.at[maximum_indices, cols].add(jnp.where(nonempty, grad, zero))
    g = grad[offset2bag]
    if mode == 1:
        g = g / jnp.maximum(bag_size[offset2bag], 1).astype(grad.dtype)[:, None]
    if per_sample_weights is not None:
        g = g * per_sample_weights.astype(grad.dtype)[:, None]
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), jnp.int64).at[idx].add(1)
        g = g / freq[idx].astype(grad.dtype)[:, None]
    return gw.at[idx].add(jnp.where(valid[:, None], g, zero))


@register(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                           num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights,
                           padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag with sparse=True: sparse gradients are not "
                                  "supported on the 'tpu' backend")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                        num_weights, scale_grad_by_freq, mode,
                                        per_sample_weights, padding_idx)


@register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
                                              padding_idx=-1):
    if mode != 0:
        raise RuntimeError("embedding_bag_backward: per_sample_weights only supported for "
                           "mode='sum'")
    idx = indices.reshape(-1)
    nb = grad.shape[0]
    rows = jnp.take(weight, idx, axis=0).astype(grad.dtype)
    out = jnp.sum(grad[jnp.minimum(offset2bag, max(nb - 1, 0))] * rows, axis=1)
    return jnp.where((idx != padding_idx) & (offset2bag < nb), out, jnp.zeros((), grad.dtype))


@register(aten.nonzero_static.default)
def nonzero_static(self, *, size, fill_value=-1):
    """nonzero padded (with ``fill_value``) or truncated to ``size`` rows: a static shape."""
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    idx = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(idx, axis=1).astype(jnp.int64)


# ---- data-dependent shapes (run un-jitted on concrete arrays) ----

@register(aten.nonzero.default, dynamic_shape=True)
def nonzero(self):
    a = np.asarray(self)
    if a.ndim == 0:
        return jnp.zeros((int(a != 0), 0), jnp.int64)
    return jnp.asarray(np.stack(np.nonzero(a), axis=1).astype(np.int64))


@register(aten.masked_select.default, dynamic_shape=True)
def masked_select(self, mask):
    if mask.dtype != jnp.bool_:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask")
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    x = jnp.broadcast_to(self, shape)
    m = np.asarray(jnp.broadcast_to(mask, shape))
    return x[m] if m.ndim else x.reshape(1)[m.reshape(1)]


_EMPTY_I64 = np.zeros((0,), np.int64)


def _unique_flat(x, return_inverse, return_counts):
    a = np.asarray(x)
    # NaNs are all distinct in PyTorch
    u, inv, cnt = np.unique(a.reshape(-1), return_inverse=True, return_counts=True,
                            equal_nan=False)
    inv = inv.reshape(a.shape).astype(np.int64) if return_inverse else _EMPTY_I64
    cnt = cnt.astype(np.int64) if return_counts else _EMPTY_I64
    return jnp.asarray(u.astype(a.dtype)), jnp.asarray(inv), jnp.asarray(cnt)


@register(aten._unique2.default, dynamic_shape=True)
def unique2(self, sorted=True, return_inverse=False, return_counts=False):
    return _unique_flat(self, return_inverse, return_counts)


@register(aten._unique.default, dynamic_shape=True)
def unique_legacy(self, sorted=True, return_inverse=False):
    u, inv, _ = _unique_flat(self, return_inverse, False)
    return u, inv


def _consecutive(a, axis):
    """Start flags of runs of equal consecutive slices of ``a`` along ``axis`` (numpy)."""
    n = a.shape[axis]
    if n == 0:
        return np.zeros((0,), bool)
    moved = np.moveaxis(a, axis, 0).reshape(n, -1)
    diff = np.any(moved[1:] != moved[:-1], axis=1) if moved.shape[1] else np.zeros(n - 1, bool)
    return np.concatenate([[True], diff])


@register(aten.unique_consecutive.default, dynamic_shape=True)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    a = np.asarray(self)
    if dim is None:
        flat = a.reshape(-1)
        start = _consecutive(flat, 0)
        out = flat[start]
        inv = (np.cumsum(start) - 1).reshape(a.shape)
    else:
        d = _dim(dim, a.ndim)
        start = _consecutive(a, d)
        out = np.compress(start, a, axis=d)
        inv = np.cumsum(start) - 1
    cnt = np.diff(np.append(np.nonzero(start)[0], start.shape[0]))
    return (jnp.asarray(out),
            jnp.asarray(inv.astype(np.int64) if return_inverse else _EMPTY_I64),
            jnp.asarray(cnt.astype(np.int64) if return_counts else _EMPTY_I64))


@register(aten.unique_dim_consecutive.default, dynamic_shape=True)
def unique_dim_consecutive(self, dim, return_inverse=False, return_counts=False):
    return unique_consecutive(self, return_inverse, return_counts, dim)


@register(aten.unique_dim.default, dynamic_shape=True)
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    a = np.asarray(self)
    d = _dim(dim, a.ndim)
    n = a.shape[d]
    if n == 0:
        return (jnp.asarray(a), jnp.asarray(_EMPTY_I64), jnp.asarray(_EMPTY_I64))
    moved = np.moveaxis(a, d, 0).reshape(n, -1)
    # lexicographic order of the slices (first element most significant), stable
    order = np.lexsort(moved.T[::-1]) if moved.shape[1] else np.arange(n)
    srt = moved[order]
    start = _consecutive(srt, 0)
    groups = np.cumsum(start) - 1
    inv = np.empty(n, np.int64)
    inv[order] = groups
    cnt = np.diff(np.append(np.nonzero(start)[0], n))
    out = np.moveaxis(srt[start].reshape((-1,) + np.moveaxis(a, d, 0).shape[1:]), 0, d)
    return jnp.asarray(out), jnp.asarray(inv), jnp.asarray(cnt.astype(np.int64))


# Index tensors may live on the CPU (CUDA accepts that too): the kernels move them to the
# device first (registry meta ``host_tensors``, read by eager/kernels.py).
for _op in (aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default,
            aten._index_put_impl.default, aten._unsafe_index_put.default):
    registry.LOWERINGS[_op].meta["host_tensors"] = True
