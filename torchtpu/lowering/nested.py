"""Jagged (nested) tensors <-> padded dense tensors.

``torch.nested`` jagged tensors (``layout=torch.jagged``) keep their rows as one ``values``
tensor ``(total, *D)`` cut by ``offsets`` ``(B + 1,)``; ``to_padded_tensor`` and the
no-padding paths of training libraries (VeRL's ``use_remove_padding``) convert with
``_jagged_to_padded_dense_forward`` and its inverse ``_padded_dense_to_jagged_forward`` (the
backward of the first). Both are gathers with a mask: the padded size (``max_lengths``, and
``total_L`` when it is given) is an argument, so the shapes are static; a missing ``total_L``
makes the jagged length the data (``offsets[-1]``), a data-dependent shape.

CPU raises for offsets that do not fit (decreasing, outside ``values``, a row longer than the
padded size, a final offset other than ``total_L``); here that is a device-side check.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .registry import aten, register


def _one_jagged_dim(name, offsets, lengths=None):
    if len(offsets) != 1 or (lengths is not None and len(lengths) != 1):
        raise RuntimeError(f"{name}(): only a single jagged dim is supported for now")
    if offsets[0].ndim != 1:
        raise RuntimeError(f"{name}(): expected 1-dimensional offsets, got {offsets[0].ndim} dims")


def _row_spans(offsets):
    """(starts, lengths) of the B rows, int64."""
    o = offsets.astype(jnp.int64)
    return o[:-1], o[1:] - o[:-1]


def _to_padded_ok(values, offsets, max_lengths, padding_value=0.0):
    starts, lens = _row_spans(offsets[0])
    used = jnp.minimum(lens, max_lengths[0])
    inside = (starts >= 0) & (starts + used <= values.shape[0])
    return jnp.all((lens >= 0) & ((used == 0) | inside))


@register(aten._jagged_to_padded_dense_forward.default,
          check=(_to_padded_ok, RuntimeError,
                 "_jagged_to_padded_dense_forward(): offsets do not fit the values "
                 "(decreasing, or a row outside the values)"))
def jagged_to_padded_dense(values, offsets, max_lengths, padding_value=0.0):
    _one_jagged_dim("_jagged_to_padded_dense_forward", offsets, max_lengths)
    s = int(max_lengths[0])
    starts, lens = _row_spans(offsets[0])
    b = starts.shape[0]
    pos = jnp.arange(s, dtype=jnp.int64)
    rows = starts[:, None] + pos[None, :]  # (B, S)
    keep = pos[None, :] < lens[:, None]
    n = values.shape[0]
    if n == 0 or s == 0 or b == 0:
        gathered = jnp.zeros((b, s) + values.shape[1:], values.dtype)
    else:
        gathered = jnp.take(values, jnp.clip(rows, 0, n - 1).reshape(-1), axis=0)
        gathered = gathered.reshape((b, s) + values.shape[1:])
    keep = keep.reshape(keep.shape + (1,) * (values.ndim - 1))
    # the padding value is cast to the values' dtype as CPU's fill does (2.5 -> 2 for ints)
    pad = np.asarray(padding_value).astype(np.dtype(values.dtype)) if values.dtype != jnp.bool_ \
        else np.asarray(bool(padding_value))
    return jnp.where(keep, gathered, jnp.asarray(pad, values.dtype))


def _total_l(dense, offsets, total_L):
    return int(np.asarray(offsets[0][-1])) if total_L is None else int(total_L)


def _to_jagged_ok(dense, offsets, total_L=None):
    starts, lens = _row_spans(offsets[0])
    ok = jnp.all((lens >= 0) & (lens <= dense.shape[1]))
    if total_L is not None:
        ok = ok & (offsets[0][-1].astype(jnp.int64) == int(total_L))
    return ok


def _to_jagged_dynamic(args, kwargs):
    """No ``total_L``: the jagged length is ``offsets[-1]``, read from the data."""
    total = args[2] if len(args) > 2 else kwargs.get("total_L")
    return total is None


@register(aten._padded_dense_to_jagged_forward.default, dynamic_shape=_to_jagged_dynamic,
          check=(_to_jagged_ok, RuntimeError,
                 "_padded_dense_to_jagged_forward(): offsets do not fit the padded input "
                 "(a row longer than its padded length, decreasing offsets, or a final "
                 "offset other than total_L)"))
def padded_dense_to_jagged(dense, offsets, total_L=None):
    _one_jagged_dim("_padded_dense_to_jagged_forward", offsets)
    if dense.ndim < 2:
        raise RuntimeError("_padded_dense_to_jagged_forward(): expected a padded input with "
                           f"at least 2 dims, got {dense.ndim}")
    length = _total_l(dense, offsets, total_L)
    nb = offsets[0].shape[0] - 1
    if nb > dense.shape[0]:
        raise IndexError(f"select(): index {dense.shape[0]} out of range for tensor of size "
                         f"{list(dense.shape)} at dimension 0")
    s = dense.shape[1]
    tail = dense.shape[2:]
    if length == 0 or nb == 0 or s == 0:
        return jnp.zeros((length,) + tail, dense.dtype)
    o = offsets[0].astype(jnp.int64)
    j = jnp.arange(length, dtype=jnp.int64)
    # the row holding position j: the first row whose end is past j (empty rows skipped)
    row = jnp.clip(jnp.searchsorted(o[1:], j, side="right"), 0, nb - 1)
    pos = j - o[row]
    keep = (pos >= 0) & (pos < s) & (j < o[-1])
    flat = dense[:nb].reshape((nb * s,) + tail)
    picked = jnp.take(flat, row * s + jnp.clip(pos, 0, s - 1), axis=0)
    keep = keep.reshape(keep.shape + (1,) * len(tail))
    return jnp.where(keep, picked, jnp.zeros((), dense.dtype))
