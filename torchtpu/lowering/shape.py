"""Shape, copy and view lowerings: concatenation, padding, triangles, scatters into slices and
diagonals, the ``*_copy`` ops and the view ops (for the graph executors; eager binds views to
PyTorch's metadata kernels, see registry).

Everything here is static-shape: shapes come from the arrays and the static arguments only.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..runtime.buffer import _contiguous_strides
from ._util import canonical_dim, cast, result_type, to_jax
from .registry import aten, register


# ---- helpers (trace time) ----

def _dim(dim, ndim):
    return canonical_dim(dim, ndim)


def _slice_bounds(size, start, end, step):
    """PyTorch's slice.Tensor normalisation of (start, end) on a dim of ``size``."""
    if step <= 0:
        raise RuntimeError("slice step must be positive")
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


def _index_tuple(ndim, dim, idx):
    return (slice(None),) * dim + (idx,)


def _infer_size(size, numel):
    size = list(size)
    if -1 in size:
        i = size.index(-1)
        rest = math.prod(s for j, s in enumerate(size) if j != i)
        if rest == 0 or numel % rest:
            raise RuntimeError(f"shape '{list(size)}' is invalid for input of size {numel}")
        size[i] = numel // rest
    if math.prod(size) != numel:
        raise RuntimeError(f"shape '{list(size)}' is invalid for input of size {numel}")
    return tuple(size)


# ---- concatenation ----

def _cat_inputs(tensors):
    # Legacy behaviour: 1-D empty tensors are skipped (whatever the other shapes are).
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    return kept


@register(aten.cat.default)
def cat(tensors, dim=0):
    if not tensors:
        raise ValueError("torch.cat(): expected a non-empty list of Tensors")
    for i, t in enumerate(tensors):
        if t.ndim == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    dt = result_type(*tensors)
    kept = _cat_inputs(tensors)
    if not kept:
        return jnp.zeros((0,), to_jax(dt))
    d = _dim(dim, kept[0].ndim)
    ref = kept[0].shape
    for i, t in enumerate(tensors):
        if t.ndim == 1 and t.shape[0] == 0:
            continue
        if t.ndim != len(ref):
            raise RuntimeError(f"Tensors must have same number of dimensions: got {len(ref)} and "
                               f"{t.ndim}")
        for k in range(t.ndim):
            if k != d and t.shape[k] != ref[k]:
                raise RuntimeError(f"Sizes of tensors must match except in dimension {d}. "
                                   f"Expected size {ref[k]} but got size {t.shape[k]} for tensor "
                                   f"number {i} in the list.")
    return jnp.concatenate([cast(t, dt) for t in kept], axis=d)


@register(aten.stack.default)
def stack(tensors, dim=0):
    dt = result_type(*tensors)
    d = _dim(dim, tensors[0].ndim + 1)
    return jnp.stack([cast(t, dt) for t in tensors], axis=d)


# ---- copies ----

@register(aten.clone.default)
def clone(self, *, memory_format=None):
    return self


@register(aten.flip.default)
def flip(self, dims):
    if self.ndim == 0:
        return self
    return jnp.flip(self, axis=tuple(_dim(d, self.ndim) for d in dims))


@register(aten.roll.default)
def roll(self, shifts, dims=()):
    shifts = list(shifts)
    dims = list(dims)
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), axis=tuple(_dim(d, self.ndim) for d in dims))


@register(aten.repeat.default)
def repeat(self, repeats):
    repeats = tuple(repeats)
    if len(repeats) < self.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of "
                           "dimensions of tensor")
    x = self.reshape((1,) * (len(repeats) - self.ndim) + tuple(self.shape))
    return jnp.tile(x, repeats)


def _repeat_interleave_dynamic(args, kwargs):
    return kwargs.get("output_size") is None


def _repeats_ok(repeats, **kwargs):
    return jnp.all(repeats >= 0)


@register(aten.repeat_interleave.Tensor, dynamic_shape=_repeat_interleave_dynamic,
          check=(_repeats_ok, RuntimeError, "repeats can not be negative"))
def repeat_interleave_tensor(repeats, *, output_size=None):
    r = repeats.reshape(-1)
    idx = jnp.arange(r.shape[0], dtype=repeats.dtype)
    if output_size is None:
        return jnp.repeat(idx, r)
    return jnp.repeat(idx, r, total_repeat_length=output_size)


# ---- padding ----

@register(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    pad = list(pad)
    n = len(pad) // 2
    if len(pad) % 2 or n > self.ndim:
        raise RuntimeError(f"Length of pad must be even but instead it equals {len(pad)}"
                           if len(pad) % 2 else
                           f"Length of pad should be no more than twice the number of dimensions "
                           f"of the input. Pad length is {len(pad)} while the input has "
                           f"{self.ndim} dimensions.")
    cfg = [(0, 0, 0)] * self.ndim
    for i in range(n):
        cfg[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value).astype(self.dtype), cfg)


def _mode_pad(x, padding, mode, nd):
    """reflect / edge padding of the last ``nd`` dims as a gather with static indices: output
    j of a dim reads input ``f(j - left)`` (negative pads crop, as in PyTorch)."""
    padding = list(padding)
    for i in range(nd):
        d = x.ndim - 1 - i
        lo, hi = padding[2 * i], padding[2 * i + 1]
        n = x.shape[d]
        if mode == "reflect" and (lo >= n or hi >= n):
            raise RuntimeError(f"Argument #4: Padding size should be less than the corresponding "
                               f"input dimension, but got: padding ({lo}, {hi}) at dimension {d} "
                               f"of input {list(x.shape)}")
        out = n + lo + hi
        if out <= 0:
            raise RuntimeError(f"input tensor of size {list(x.shape)} with padding {padding} "
                               f"gives a non-positive output size {out} at dimension {d}")
        j = np.arange(out) - lo
        if mode == "edge":
            j = np.clip(j, 0, n - 1)
        else:
            j = np.abs(j)
            j = (n - 1) - np.abs((n - 1) - j)
        x = jnp.take(x, j, axis=d)
    return x


def _pad_family(nd, mode):
    def fwd(self, padding):
        return _mode_pad(self, padding, mode, nd)

    def bwd(grad_output, self, padding):
        _, vjp = jax.vjp(lambda x: _mode_pad(x, padding, mode, nd), self)
        return vjp(grad_output.astype(self.dtype))[0]

    return fwd, bwd


for _nd in (1, 2, 3):
    for _name, _mode in (("reflection", "reflect"), ("replication", "edge")):
        _f, _b = _pad_family(_nd, _mode)
        register(getattr(aten, f"{_name}_pad{_nd}d").default)(_f)
        register(getattr(aten, f"{_name}_pad{_nd}d_backward").default)(_b)


# ---- triangles and diagonals ----

def _triangle(x, diagonal, upper: bool):
    """``diagonal`` may be traced (a changing offset, as in attention masks, compiles once)."""
    n, m = x.shape[-2:]
    d = lax.broadcasted_iota(jnp.int64, (n, m), 1) - lax.broadcasted_iota(jnp.int64, (n, m), 0)
    keep = d >= diagonal if upper else d <= diagonal
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


@register(aten.tril.default, scalar_args=("diagonal",))
def tril(self, diagonal=0):
    return _triangle(self, diagonal, upper=False)


@register(aten.triu.default, scalar_args=("diagonal",))
def triu(self, diagonal=0):
    return _triangle(self, diagonal, upper=True)


def _diag_rc(n, offset):
    idx = np.arange(n)
    return idx + max(-offset, 0), idx + max(offset, 0)


def _diag_len(s1, s2, offset):
    if offset >= 0:
        return max(0, min(s1, s2 - offset))
    return max(0, min(s1 + offset, s2))


@register(aten.diag_embed.default)
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    nd = self.ndim + 1
    d1, d2 = _dim(dim1, nd), _dim(dim2, nd)
    if d1 == d2:
        raise RuntimeError("diagonal dimensions cannot be identical " f"{dim1}, {dim2}")
    n = self.shape[-1]
    m = n + abs(offset)
    rows, cols = _diag_rc(n, offset)
    z = jnp.zeros(self.shape[:-1] + (m, m), self.dtype)
    z = z.at[..., rows, cols].set(self)
    return jnp.moveaxis(z, (-2, -1), (d1, d2))


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    d1, d2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    return jnp.diagonal(self, offset, d1, d2)


@register(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    d1, d2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    x = jnp.moveaxis(self, (d1, d2), (-2, -1))
    n = _diag_len(self.shape[d1], self.shape[d2], offset)
    rows, cols = _diag_rc(n, offset)
    x = x.at[..., rows, cols].set(src.astype(self.dtype))
    return jnp.moveaxis(x, (-2, -1), (d1, d2))


@register(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    d = _dim(dim, self.ndim)
    s, e = _slice_bounds(self.shape[d], start, end, step)
    return self.at[_index_tuple(self.ndim, d, slice(s, e, step))].set(src.astype(self.dtype))


@register(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    d = _dim(dim, self.ndim)
    i = _select_index(self.shape[d], index, d)
    return self.at[_index_tuple(self.ndim, d, i)].set(src.astype(self.dtype))


def _strided_index(size, stride, offset):
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, st) in enumerate(zip(size, stride)):
        shp = [1] * len(size)
        shp[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * st).reshape(shp)
    return idx


def _elements_at(shape, layout, positions, op):
    """Flat (logical, row-major) indices of the elements of a tensor of ``shape`` laid out as
    ``layout`` = (strides, storage offset) that sit at the storage ``positions``: static."""
    strides, offset = layout
    where = _strided_index(shape, strides, offset).reshape(-1)
    order = np.argsort(where, kind="stable")
    ordered = where[order]
    j = np.clip(np.searchsorted(ordered, positions), 0, max(len(ordered) - 1, 0))
    if positions.size and (len(ordered) == 0 or not np.array_equal(ordered[j], positions)):
        # the storage elements outside the tensor are not part of a graph's values
        raise RuntimeError(f"{op}: the requested view reaches storage elements outside its input "
                           "tensor; on device tpu it must stay within the input's elements")
    return order[j]


def _dense(shape, strides) -> bool:
    """Non-overlapping and dense: ``clone()`` keeps such strides (memory_format=preserve)."""
    dims = sorted((st, n) for n, st in zip(shape, strides) if n != 1)
    acc = 1
    for st, n in dims:
        if st != acc:
            return False
        acc *= n
    return True


@register(aten.as_strided_scatter.default, reads_layout=True)
def as_strided_scatter(self, src, size, stride, storage_offset=None, *, layout=None):
    # PyTorch: out = self.clone(); out.as_strided(size, stride, storage_offset).copy_(src); the
    # clone keeps self's strides when they are dense, at storage offset 0
    strides = tuple(layout[0]) if layout is not None else _contiguous_strides(self.shape)
    if not _dense(self.shape, strides):
        strides = _contiguous_strides(self.shape)
    pos = _strided_index(size, stride, storage_offset or 0).reshape(-1)
    idx = _elements_at(self.shape, (strides, 0), pos, "as_strided_scatter")
    flat = self.reshape(-1)
    return flat.at[idx].set(src.astype(self.dtype).reshape(-1)).reshape(self.shape)


@register(aten.as_strided.default, aten.as_strided_copy.default, reads_layout=True)
def as_strided(self, size, stride, storage_offset=None, *, layout=None):
    if layout is None:
        layout = (_contiguous_strides(self.shape), 0)
    offset = layout[1] if storage_offset is None else storage_offset
    pos = _strided_index(size, stride, offset).reshape(-1)
    if pos.size == 0:
        return jnp.zeros(tuple(size), self.dtype)
    return self.reshape(-1)[_elements_at(self.shape, layout, pos, "as_strided")].reshape(tuple(size))


# ---- view ops (graph executors) and their *_copy twins (eager) ----

@register(aten.view.default, aten.view_copy.default, aten.reshape.default,
          aten._reshape_copy.default)
def view(self, size):
    return self.reshape(_infer_size(size, self.size))


# ``_unsafe_view`` (matmul's and reshape's last step) is a view without autograd's view
# tracking: PyTorch's own kernel (CompositeExplicitAutograd) aliases the storage in eager, as on
# CPU, so it runs no program; graphs reshape.
register(aten._unsafe_view.default, graph_only=True)(view)


@register(aten._reshape_alias.default, aten._reshape_alias_copy.default)
def reshape_alias(self, size, stride):
    return self.reshape(tuple(size))


@register(aten.permute.default, aten.permute_copy.default)
def permute(self, dims):
    return jnp.transpose(self, tuple(_dim(d, self.ndim) for d in dims))


@register(aten.transpose.int, aten.transpose_copy.int)
def transpose(self, dim0, dim1):
    if self.ndim == 0:
        return self
    return jnp.swapaxes(self, _dim(dim0, self.ndim), _dim(dim1, self.ndim))


@register(aten.t.default, aten.t_copy.default)
def t(self):
    if self.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {self.ndim}D")
    return self.T if self.ndim == 2 else self


def _expand_shape(shape, size):
    size = list(size)
    lead = len(size) - len(shape)
    if lead < 0:
        raise RuntimeError(f"expand: the number of sizes provided ({len(size)}) must be greater "
                           f"or equal to the number of dimensions in the tensor ({len(shape)})")
    out = []
    for i, s in enumerate(size):
        if s == -1:
            if i < lead:
                raise RuntimeError("expand: -1 is not allowed in a leading, non-existing dimension")
            s = shape[i - lead]
        out.append(s)
    return tuple(out)


@register(aten.expand.default, aten.expand_copy.default)
def expand(self, size, *, implicit=False):
    return jnp.broadcast_to(self, _expand_shape(self.shape, size))


@register(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(self, dim=0, start=None, end=None, step=1):
    d = _dim(dim, self.ndim)
    s, e = _slice_bounds(self.shape[d], start, end, step)
    if e <= s:
        return jnp.zeros(self.shape[:d] + (0,) + self.shape[d + 1:], self.dtype)
    return lax.slice_in_dim(self, s, e, step, axis=d)


def _select_index(size, index, dim):
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size "
                         f"[{size}] at dimension {dim}")
    return index % size


@register(aten.select.int, aten.select_copy.int)
def select(self, dim, index):
    d = _dim(dim, self.ndim)
    return lax.index_in_dim(self, _select_index(self.shape[d], index, d), d, keepdims=False)


@register(aten.narrow.default, aten.narrow_copy.default)
def narrow(self, dim, start, length):
    d = _dim(dim, self.ndim)
    if start < 0:
        start += self.shape[d]
    if start < 0 or start + length > self.shape[d] or length < 0:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size "
                           f"({self.shape[d]}).")
    return lax.slice_in_dim(self, start, start + length, axis=d)


@register(aten.squeeze.default, aten.squeeze_copy.default)
def squeeze(self):
    return jnp.squeeze(self, tuple(i for i, s in enumerate(self.shape) if s == 1))


@register(aten.squeeze.dim, aten.squeeze_copy.dim)
def squeeze_dim(self, dim):
    return squeeze_dims(self, [dim])


@register(aten.squeeze.dims, aten.squeeze_copy.dims)
def squeeze_dims(self, dim):
    if self.ndim == 0:
        return self
    ds = {_dim(d, self.ndim) for d in dim}
    return jnp.squeeze(self, tuple(d for d in sorted(ds) if self.shape[d] == 1))


@register(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, _dim(dim, self.ndim + 1))


def _split_sizes(n, split_size):
    if split_size == 0:
        return [0] if n == 0 else None
    k = max(1, -(-n // split_size))
    return [min(split_size, n - i * split_size) for i in range(k)]


@register(aten.split.Tensor, aten.split_copy.Tensor)
def split(self, split_size, dim=0):
    d = _dim(dim, self.ndim)
    sizes = _split_sizes(self.shape[d], split_size)
    return split_with_sizes(self, sizes, d)


@register(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def split_with_sizes(self, split_sizes, dim=0):
    d = _dim(dim, self.ndim)
    if sum(split_sizes) != self.shape[d]:
        raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to "
                           f"{self.shape[d]} (input tensor's size at dimension {d}), but got "
                           f"split_sizes={list(split_sizes)}")
    out, s = [], 0
    for n in split_sizes:
        out.append(lax.slice_in_dim(self, s, s + n, axis=d))
        s += n
    return out


@register(aten.unbind.int, aten.unbind_copy.int)
def unbind(self, dim=0):
    d = _dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, d, keepdims=False) for i in range(self.shape[d])]


@register(aten.unfold.default, aten.unfold_copy.default)
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(1)[:size]
    d = _dim(dimension, self.ndim)
    n = self.shape[d]
    if size > n:
        raise RuntimeError(f"maximum size for tensor at dimension {d} is {n} but size is {size}")
    if step <= 0:
        raise RuntimeError(f"step is {step} but must be > 0")
    count = (n - size) // step + 1
    idx = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    out = jnp.take(self, idx, axis=d)
    return jnp.moveaxis(out, d + 1, -1)


@register(aten.unfold_backward.default)
def unfold_backward(grad_in, input_sizes, dim, size, step):
    zero = jnp.zeros(tuple(input_sizes), grad_in.dtype)
    _, vjp = jax.vjp(lambda x: unfold(x, dim, size, step), zero)
    return vjp(grad_in)[0]


@register(aten.alias.default, aten.alias_copy.default, aten.detach.default,
          aten.detach_copy.default, aten.lift_fresh.default, aten.lift_fresh_copy.default)
def alias(self):
    return self


@register(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@register(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@register(aten.view.dtype, aten.view_copy.dtype)
def view_dtype(self, dtype):
    jd = jnp.dtype(to_jax(dtype))
    src = self
    if src.dtype == jnp.bool_:
        src = src.astype(jnp.uint8)
    tgt = jnp.uint8 if jd == jnp.bool_ else jd
    a, b = src.dtype.itemsize, jnp.dtype(tgt).itemsize
    if a == b:
        out = lax.bitcast_convert_type(src, tgt)
    elif a > b:  # each element becomes a // b elements of the last dim
        out = lax.bitcast_convert_type(src, tgt)
        out = out.reshape(src.shape[:-1] + (src.shape[-1] * (a // b),)) if src.ndim else \
            out.reshape(a // b)
    else:
        r = b // a
        if src.ndim == 0 or src.shape[-1] % r:
            raise RuntimeError(f"self.size(-1) must be divisible by {r} to view "
                               f"{src.dtype} as {jd} (different element sizes)")
        out = lax.bitcast_convert_type(src.reshape(src.shape[:-1] + (src.shape[-1] // r, r)), tgt)
    if jd == jnp.bool_:
        out = out != 0
    return out


# ---- im2col / col2im, pixel shuffle ----

def _pair(v):
    v = list(v)
    return v * 2 if len(v) == 1 else v


def _im2col(x, kernel_size, dilation, padding, stride):
    kh, kw = _pair(kernel_size)
    dh, dw = _pair(dilation)
    ph, pw = _pair(padding)
    sh, sw = _pair(stride)
    batched = x.ndim == 4
    if not batched:
        x = x[None]
    n, c, h, w = x.shape
    x = jnp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cols = []
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dh, j * dw
            patch = x[:, :, r0: r0 + sh * (oh - 1) + 1: sh, c0: c0 + sw * (ow - 1) + 1: sw]
            cols.append(patch)
    out = jnp.stack(cols, axis=2).reshape(n, c * kh * kw, oh * ow)
    return out if batched else out[0]


@register(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, kernel_size, dilation, padding, stride)


@register(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    kh, kw = _pair(kernel_size)
    batched = self.ndim == 3
    c = self.shape[-2] // (kh * kw)
    oh, ow = _pair(output_size)
    shape = (self.shape[0], c, oh, ow) if batched else (c, oh, ow)
    zero = jnp.zeros(shape, self.dtype)
    _, vjp = jax.vjp(lambda x: _im2col(x, kernel_size, dilation, padding, stride), zero)
    return vjp(self)[0]


@register(aten.pixel_shuffle.default)
def pixel_shuffle(self, upscale_factor):
    r = upscale_factor
    *b, c, h, w = self.shape
    oc = c // (r * r)
    x = self.reshape(tuple(b) + (oc, r, r, h, w))
    nb = len(b)
    perm = tuple(range(nb)) + tuple(nb + i for i in (0, 3, 1, 4, 2))
    return jnp.transpose(x, perm).reshape(tuple(b) + (oc, h * r, w * r))


@register(aten.pixel_unshuffle.default)
def pixel_unshuffle(self, downscale_factor):
    r = downscale_factor
    *b, c, h, w = self.shape
    x = self.reshape(tuple(b) + (c, h // r, r, w // r, r))
    nb = len(b)
    perm = tuple(range(nb)) + tuple(nb + i for i in (0, 2, 4, 1, 3))
    return jnp.transpose(x, perm).reshape(tuple(b) + (c * r * r, h // r, w // r))
