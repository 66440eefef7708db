"""Reading and writing tensors that are views of a storage's array.

A tensor's view of its storage array is described by a hashable *spec* that goes into the
compile-cache key; the storage offset of a strided view is a traced argument, so walking
``x[i]`` over i does not recompile.

spec None           the tensor is the array exactly
spec ("r", shape)   contiguous over the whole storage: a reshape
spec ("c", shape[, row])  a contiguous run at a traced offset (``x[i]``, a narrow along dim 0):
                    a dynamic slice / update; with ``row`` (the run and its offset are whole
                    rows of the array, ``row`` elements each) in the array's own shape, so a
                    write is an in-place dynamic-update-slice even when several are chained in
                    one program (on the flattened array XLA:CPU copied the whole buffer for
                    each chained write: a reshape around the update defeats its in-place rule)
spec ("s", shape, strides)   anything else: a gather at offset + sum(i_k * stride_k)
spec ("b", dtype, inner, off)  the tensor's dtype differs from the array's (``x.view(torch.int32)``,
                    a raw uint8 view of a storage): the storage's bytes are reinterpreted as a
                    flat array of ``dtype``, then ``inner`` applies at static offset ``off``
                    (these views are rare: the offset is part of the key, no traced offset)
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..runtime.dtypes import TORCH_TO_JAX

_NP = {k: np.dtype(v) for k, v in TORCH_TO_JAX.items()}


def spec_of(t, arr):
    """(spec, offset-or-None) of tensor ``t`` over storage array ``arr``.

    A tensor with PyTorch's lazy conjugate or negative bit set (``x.conj()``, its ``.imag``)
    gets ("x", conj, neg, inner): the read applies them, a write stores their inverse.
    """
    conj, neg = t.is_conj(), t.is_neg()
    if conj or neg:
        inner, off = _spec_plain(t, arr)
        return ("x", conj, neg, inner), off
    return _spec_plain(t, arr)


def _spec_plain(t, arr):
    shape = t.shape
    off = t.storage_offset()
    want = _NP.get(t.dtype)
    have = arr.dtype
    if want is not have and want != have and want is not None:
        inner, ioff = _spec_flat(t, arr.size * have.itemsize // want.itemsize)
        return ("b", want, inner, ioff), None
    contiguous = t.is_contiguous()
    if off == 0 and contiguous:
        if arr.shape == shape:
            return None, None
        if t.numel() == arr.size:
            return ("r", tuple(shape)), None
    if contiguous and t.numel() > 0:
        # a contiguous run (x[i], a narrow along dim 0): a dynamic slice at a traced offset
        if arr.ndim >= 1:
            row = arr.size // arr.shape[0] if arr.shape[0] else 0
            if row and t.numel() % row == 0 and off % row == 0:
                return ("c", tuple(shape), row), off
        return ("c", tuple(shape)), off
    key = (shape, t.stride(), off, arr.size)
    spec = _STRIDED.get(key)
    if spec is None:
        if len(_STRIDED) >= _STRIDED_MAX:
            _STRIDED.clear()
        spec = _STRIDED[key] = _strided_spec(tuple(shape), tuple(t.stride()), off, arr.size)
    return spec, off


# a strided view's spec is a function of (shape, strides, offset, storage size) alone; views
# recur (a transpose per attention head per token), and planning one cost ~10 us per op
_STRIDED: dict = {}
_STRIDED_MAX = 4096


def _strided_spec(shape, strides, off, n):
    plan = _box_plan(shape, strides, off, n)
    if plan is not None:
        box, starts, limits, perm, inter = plan
        sizes = tuple(b - a for a, b in zip(starts, limits))
        st = tuple(sorted((s_ for m, s_ in zip(shape, strides) if m != 1 and s_ != 0),
                          reverse=True))
        return ("k", shape, strides, box, st, sizes, perm, inter)
    return ("s", shape, strides)


def has_offset(spec) -> bool:
    """Whether a spec reads at a traced storage offset (spec_of returned one with it)."""
    if spec is None:
        return False
    if spec[0] == "x":
        return has_offset(spec[3])
    return spec[0] in ("s", "c", "k")


def _box_plan(shape, strides, off, n):
    """Read a strided view as slices of the storage seen as a box, instead of a gather.

    When the view's strides (sorted) divide each other, the padded flat storage reshaped to
    (rows, s0/s1, ..., s_{k-2}/s_{k-1}, s_{k-1}) holds the view as a plain slice of that box,
    then a transpose back to the view's dimension order and a broadcast for stride-0 dims.
    Transposes, splits of a fused qkv projection and narrowed/step-sliced views all qualify.
    The offset is baked into the plan (the view's place in its storage rarely varies). When
    the smallest stride is 1 the box has no trailing unit dim, so a column block of a matrix
    (``x[:, :8]``, a q/k/v split) is a slice of the array in its own shape: reads and writes
    then need no reshape (XLA:CPU copies a whole buffer written through one).
    Returns (box_shape, starts, limits, perm, inter_shape) or None.
    """
    dims = sorted(((st, m, i) for i, (m, st) in enumerate(zip(shape, strides))
                   if m != 1 and st != 0), key=lambda d: -d[0])
    if not dims:
        return None
    st = [d[0] for d in dims]
    if any(a <= b or a % b for a, b in zip(st, st[1:])):
        return None
    rows = -(-n // st[0])
    box = [rows] + [a // b for a, b in zip(st, st[1:])] + ([st[-1]] if st[-1] != 1 else [])
    rem, starts = off, []
    for s_ in st:
        starts.append(rem // s_)
        rem -= starts[-1] * s_
    limits = [c + d[1] for c, d in zip(starts, dims)]
    if st[-1] != 1:
        starts.append(rem)
        limits.append(rem + 1)
    if any(lim > b for lim, b in zip(limits, box)):
        return None
    order = [d[2] for d in dims]
    perm = tuple(sorted(range(len(order)), key=lambda k: order[k]))
    inter = tuple(m if (m != 1 and s_ != 0) else 1 for m, s_ in zip(shape, strides))
    return tuple(box), tuple(starts), tuple(limits), perm, inter


def _spec_flat(t, n):
    """spec_of over a flat array of ``n`` elements of ``t``'s dtype."""
    if t.storage_offset() == 0 and t.is_contiguous() and t.numel() == n:
        return ("r", tuple(t.shape)), None
    return ("s", tuple(t.shape), tuple(t.stride())), t.storage_offset()


def _raw(arr):
    """``arr`` flattened, as a real non-bool dtype that bitcasts (complex -> float pairs)."""
    flat = arr.reshape(-1)
    if flat.dtype == np.bool_:
        return flat.astype(jnp.uint8)
    if jnp.issubdtype(flat.dtype, jnp.complexfloating):
        part = jnp.float32 if flat.dtype == np.complex64 else jnp.float64
        return jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1).astype(part)
    return flat


def bitcast_flat(arr, dtype):
    """The bytes of ``arr`` reinterpreted as a flat array of ``dtype`` (traceable)."""
    dtype = np.dtype(dtype)
    if arr.dtype == dtype:
        return arr.reshape(-1)
    flat = _raw(arr)
    if dtype == np.bool_:
        return bitcast_flat(flat, np.uint8) != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = np.float32 if dtype == np.complex64 else np.float64
        pairs = bitcast_flat(flat, part).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    src, dst = flat.dtype.itemsize, dtype.itemsize
    if src == dst:
        return lax.bitcast_convert_type(flat, dtype)
    if src > dst:
        return lax.bitcast_convert_type(flat, dtype).reshape(-1)
    return lax.bitcast_convert_type(flat.reshape(-1, dst // src), dtype)


def _flat_index(shape, strides, offset):
    idx = jnp.asarray(offset, dtype=jnp.int64)
    for d, (n, st) in enumerate(zip(shape, strides)):
        if n == 1 or st == 0:
            continue
        iota = lax.broadcasted_iota(jnp.int64, shape, d)
        idx = idx + iota * st
    return jnp.broadcast_to(idx, shape)


def read(arr, spec, offset):
    """The value of a view (traced)."""
    if spec is None:
        return arr
    if spec[0] == "r":
        return arr.reshape(spec[1])
    if spec[0] == "b":
        return read(bitcast_flat(arr, spec[1]), spec[2], spec[3])
    if spec[0] == "c":
        shape = spec[1]
        size = 1
        for m in shape:
            size *= m
        if len(spec) == 3:  # whole rows of the array, in its own shape
            row = spec[2]
            start = (offset // row,) + (0,) * (arr.ndim - 1)
            return lax.dynamic_slice(arr, start, (size // row,) + arr.shape[1:]).reshape(shape)
        return lax.dynamic_slice(arr.reshape(-1), (offset,), (size,)).reshape(shape)
    if spec[0] == "k":
        shape, _, box, st, sizes, perm, inter = spec[1:]
        # a dynamic slice at traced starts: XLA keeps a write of the same window in place
        # (constant starts fold into a slice, and a fusion that reads a slice of the buffer it
        # updates is emitted as a pass over the whole buffer)
        v = lax.dynamic_slice(_as_box(arr, box), _box_starts(offset, st, box), sizes)
        if len(box) > len(perm):  # the trailing unit dim of a smallest stride > 1
            v = v.reshape(v.shape[:-1])
        v = v.transpose(perm)
        return jnp.broadcast_to(v.reshape(inter), shape)
    if spec[0] == "x":
        v = read(arr, spec[3], offset)
        if spec[1]:
            v = jnp.conj(v)
        return -v if spec[2] else v
    _, shape, strides = spec
    flat = arr.reshape(-1)
    if 0 in shape:
        return jnp.zeros(shape, arr.dtype)
    return flat[_flat_index(shape, strides, offset)]


def _as_box(arr, box):
    """The storage array seen as ``box`` (padded at the end): itself when it has that shape."""
    if tuple(box) == tuple(arr.shape):
        return arr
    flat = arr.reshape(-1)
    total = 1
    for b in box:
        total *= b
    if total != flat.shape[0]:
        flat = jnp.pad(flat, (0, total - flat.shape[0]))
    return flat.reshape(box)


def _box_starts(offset, st, box):
    """The box coordinates of storage offset ``offset`` (traced): per sorted stride, then the
    remainder when the box has a trailing dim."""
    rem = offset
    starts = []
    for s_ in st:
        q = rem // s_
        starts.append(q)
        rem = rem - q * s_
    if len(box) > len(st):  # a trailing dim: the smallest stride is > 1
        starts.append(rem)
    return tuple(starts)


def _write_box(arr, spec, offset, value):
    """A strided view's write. Where the box is the array's own shape (a column block
    ``x[:, :8]``), a dynamic-update-slice of the array, in place when it is donated. Otherwise
    a write through a reshape, which XLA:CPU performs on a copy of the whole buffer: a view
    that is a small part of its storage (under 1/8) is scattered in the array's own shape
    instead (cost ~ its size), a larger one (``x[::2]``) is written into the box."""
    shape, strides, box, st, sizes, perm, inter = spec[1:]
    total = 1
    for b in box:
        total *= b
    n = 1
    for m in shape:
        n *= m
    if tuple(inter) != tuple(shape) or (tuple(box) != tuple(arr.shape) and
                                        (total != arr.size or 8 * n <= arr.size)):
        return write(arr, ("s", shape, strides), offset, value)
    dims = [m for m, s_ in zip(shape, strides) if m != 1 and s_ != 0]
    inv = tuple(sorted(range(len(perm)), key=lambda k: perm[k]))
    v = value.reshape(dims).transpose(inv)  # the view's dims in the box's order
    v = v.reshape(sizes)
    new = lax.dynamic_update_slice(_as_box(arr, box), v.astype(arr.dtype),
                                   _box_starts(offset, st, box))
    return new if new.shape == arr.shape else new.reshape(arr.shape)


def write(arr, spec, offset, value):
    """The storage array after assigning ``value`` (already cast/broadcast) into the view."""
    if spec is not None and spec[0] == "b":
        new = write(bitcast_flat(arr, spec[1]), spec[2], spec[3], value)
        return bitcast_flat(new, arr.dtype).reshape(arr.shape)
    if spec is not None and spec[0] == "x":
        if spec[2]:
            value = -value
        if spec[1]:
            value = jnp.conj(value)
        return write(arr, spec[3], offset, value)
    value = value.astype(arr.dtype)
    if spec is None:
        return jnp.broadcast_to(value, arr.shape)
    if spec[0] == "r":
        return jnp.broadcast_to(value, spec[1]).reshape(arr.shape)
    if spec[0] == "c":
        shape = spec[1]
        value = jnp.broadcast_to(value, shape)
        if len(spec) == 3:  # whole rows: an update in the array's own shape
            row = spec[2]
            rows = value.size // row
            start = (offset // row,) + (0,) * (arr.ndim - 1)
            return lax.dynamic_update_slice(arr, value.reshape((rows,) + arr.shape[1:]), start)
        return lax.dynamic_update_slice(arr.reshape(-1), value.reshape(-1),
                                        (offset,)).reshape(arr.shape)
    if spec[0] == "k":
        return _write_box(arr, spec, offset, value)
    _, shape, strides = spec
    if 0 in shape:
        return arr
    value = jnp.broadcast_to(value, shape).reshape(-1)
    idx = _flat_index(shape, strides, offset).reshape(-1)
    if arr.ndim <= 1:
        return arr.reshape(-1).at[idx].set(value, unique_indices=True).reshape(arr.shape)
    # scattered in the array's own shape (unravelled indices): no reshape around the update,
    # which XLA:CPU would perform on a copy of the whole buffer
    native = []
    for d in range(arr.ndim - 1, -1, -1):
        native.append(idx % arr.shape[d])
        idx = idx // arr.shape[d]
    return arr.at[tuple(native[::-1])].set(value, unique_indices=True)
