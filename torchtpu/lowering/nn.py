"""nn lowerings: convolution, pooling, normalization, upsampling (forward and backward).

Backward ops of linear forwards (convolution, average pooling, interpolation) are the exact
transpose of the forward (``jax.vjp`` / ``jax.linear_transpose``), so they agree with the forward
by construction. Index arrays that depend only on shapes (pooling windows, interpolation
weights) are computed with numpy at trace time: they are constants of the compiled program.
"""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..runtime.dtypes import scalar_type_name as _tname
from .registry import aten, register

_HIGHEST = lax.Precision.HIGHEST


def _precision(dtype):
    return _HIGHEST if dtype in (jnp.float32, jnp.float64, jnp.complex64, jnp.complex128) else None


def _acc(dtype):
    """Accumulation dtype (PyTorch's opmath type) of a floating dtype."""
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _tup(v, n):
    if v is None:
        return None
    if isinstance(v, int):
        return (v,) * n
    v = tuple(v)
    return v * n if len(v) == 1 else v


# ---------------------------------------------------------------- convolution

_SPATIAL = {1: "H", 2: "HW", 3: "DHW"}


def _conv_fwd(x, w, stride, padding, dilation, groups):
    nd = x.ndim - 2
    sp = _SPATIAL[nd]
    dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + sp, "OI" + sp, "NC" + sp))
    out_dt = x.dtype
    pet = jnp.float32 if out_dt in (jnp.bfloat16, jnp.float16) else None
    y = lax.conv_general_dilated(
        x, w, window_strides=tuple(stride), padding=[(p, p) for p in padding],
        rhs_dilation=tuple(dilation), dimension_numbers=dn, feature_group_count=groups,
        precision=_precision(out_dt), preferred_element_type=pet)
    return y.astype(out_dt)


def _conv_transpose(x, w, stride, padding, dilation, output_padding, groups):
    """PyTorch's transposed convolution: the transpose of the forward convolution whose weight
    is ``w`` (Cin, Cout/groups, k...), evaluated at ``x``."""
    k = w.shape[2:]
    out_sp = tuple((i - 1) * s - 2 * p + d * (kk - 1) + op + 1 for i, s, p, d, kk, op in
                   zip(x.shape[2:], stride, padding, dilation, k, output_padding))
    z_shape = (x.shape[0], w.shape[1] * groups) + out_sp
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        # jax.linear_transpose has no integer cotangents (float0): the transposed convolution
        # written out instead, a stride-dilated input against the flipped, I/O-swapped weight
        nd = len(k)
        cin, cpg = w.shape[0], w.shape[1]
        wt = w.reshape((groups, cin // groups, cpg) + k)
        wt = jnp.swapaxes(wt, 1, 2).reshape((groups * cpg, cin // groups) + k)
        wt = jnp.flip(wt, axis=tuple(range(2, 2 + nd)))
        sp = _SPATIAL[nd]
        dn = lax.conv_dimension_numbers(x.shape, wt.shape, ("NC" + sp, "OI" + sp, "NC" + sp))
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
                for kk, p, d, op in zip(k, padding, dilation, output_padding)]
        return lax.conv_general_dilated(x, wt, window_strides=(1,) * nd, padding=pads,
                                        lhs_dilation=tuple(stride), rhs_dilation=tuple(dilation),
                                        dimension_numbers=dn, feature_group_count=groups)
    fwd = lambda z: _conv_fwd(z, w, stride, padding, dilation, groups)  # noqa: E731
    (y,) = jax.linear_transpose(fwd, jax.ShapeDtypeStruct(z_shape, x.dtype))(x)
    return y


def _conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    stride, padding, dilation = _tup(stride, nd), _tup(padding, nd), _tup(dilation, nd)
    if transposed:
        y = _conv_transpose(x, w, stride, padding, dilation, _tup(output_padding, nd), groups)
    else:
        y = _conv_fwd(x, w, stride, padding, dilation, groups)
    if bias is not None:
        y = y + bias.astype(y.dtype).reshape((1, -1) + (1,) * nd)
    return y


@register(aten.convolution.default, aten.convolution_overrideable.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if input.ndim == weight.ndim - 1:  # unbatched
        return _conv(input[None], weight, bias, stride, padding, dilation, transposed,
                     output_padding, groups)[0]
    return _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


def _conv_backward(grad_output, input, weight, stride, padding, dilation, transposed,
                   output_padding, groups, output_mask):
    f = lambda x, w: _conv(x, w, None, stride, padding, dilation, transposed,  # noqa: E731
                           output_padding, groups)
    gi = gw = gb = None
    if output_mask[0] or output_mask[1]:
        _, vjp = jax.vjp(f, input, weight)
        gi, gw = vjp(grad_output.astype(input.dtype))
        gi = gi if output_mask[0] else None
        gw = gw if output_mask[1] else None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        gb = jnp.sum(grad_output.astype(_acc(grad_output.dtype)), axis=axes).astype(grad_output.dtype)
    return gi, gw, gb


@register(aten.convolution_backward.default)
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask):
    if input.ndim == weight.ndim - 1:
        gi, gw, gb = _conv_backward(grad_output[None], input[None], weight, stride, padding,
                                    dilation, transposed, output_padding, groups, output_mask)
        return (gi[0] if gi is not None else None), gw, gb
    return _conv_backward(grad_output, input, weight, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask)


@register(aten.convolution_backward_overrideable.default)
def convolution_backward_overrideable(grad_output, input, weight, stride, padding, dilation,
                                      transposed, output_padding, groups, output_mask):
    return _conv_backward(grad_output, input, weight, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask)


# ---------------------------------------------------------------- pooling helpers

def _pool_out_size(n, k, s, p, d, ceil_mode):
    num = n + 2 * p - d * (k - 1) - 1
    if ceil_mode:
        o = -(-num // s) + 1
        if (o - 1) * s >= n + p:
            o -= 1
    else:
        o = num // s + 1
    return o


def _windows(in_sizes, k, s, p, d, ceil_mode):
    """Per spatial dim: (out size, index array (out, k) into the unpadded input)."""
    res = []
    for n, kk, ss, pp, dd in zip(in_sizes, k, s, p, d):
        o = _pool_out_size(n, kk, ss, pp, dd, ceil_mode)
        idx = np.arange(o)[:, None] * ss + np.arange(kk)[None, :] * dd - pp
        res.append((o, idx))
    return res


def _argmax_pool(g, valid, src, nd):
    """Max over the window (last axis) with PyTorch's choice of index: the first maximum
    among valid taps, or the last NaN if the window holds one."""
    if jnp.issubdtype(g.dtype, jnp.floating):
        isn = jnp.isnan(g)
        k = g.shape[-1]
        last_nan = k - 1 - jnp.argmax(isn[..., ::-1], -1)
        first_max = jnp.argmax((g == jnp.max(g, -1, keepdims=True)) & valid, -1)
        am = jnp.where(jnp.any(isn, -1), last_nan, first_max)
    else:
        am = jnp.argmax((g == jnp.max(g, -1, keepdims=True)) & valid, -1)
    out = jnp.take_along_axis(g, am[..., None], -1)[..., 0]
    idx = jnp.take_along_axis(jnp.broadcast_to(src, g.shape), am[..., None], -1)[..., 0]
    return out, idx.astype(jnp.int64)


def _gather_windows(x, wins, fill):
    """x (..., *sp) -> (..., o1, k1, o2, k2, ...) with out-of-range taps set to ``fill``;
    also the boolean validity mask of shape (o1, k1, o2, k2, ...)."""
    nd = len(wins)
    lead = x.ndim - nd
    valid = None
    for j, (o, idx) in enumerate(wins):
        n = x.shape[lead + 2 * j]
        ok = (idx >= 0) & (idx < n)
        safe = np.clip(idx, 0, n - 1).reshape(-1)
        x = jnp.take(x, safe, axis=lead + 2 * j)
        x = x.reshape(x.shape[:lead + 2 * j] + idx.shape + x.shape[lead + 2 * j + 1:])
        shape = [1] * (2 * nd)
        shape[2 * j], shape[2 * j + 1] = idx.shape
        okr = ok.reshape(shape)
        valid = okr if valid is None else (valid & okr)
    x = jnp.where(valid, x, jnp.asarray(fill, x.dtype))
    return x, valid


def _np_window_mask(wins, pred):
    """numpy bool (o1, o2, ..., k1*k2*...): ``pred(j, idx)`` per tap of each spatial dim."""
    nd = len(wins)
    m = np.ones([1] * (2 * nd), dtype=bool)
    for j, (o, idx) in enumerate(wins):
        shape = [1] * (2 * nd)
        shape[j], shape[nd + j] = idx.shape
        m = m & pred(j, idx).reshape(shape)
    full = [o for o, idx in wins] + [idx.shape[1] for o, idx in wins]
    return np.broadcast_to(m, full).reshape([o for o, idx in wins] + [-1])


def _slice_windows(x, wins, s, d, p, fill):
    """Regular windows as strided slices of the padded input (no gather):
    x (..., *sp) -> (..., o1, o2, ..., k1*k2*...), padding taps set to ``fill``."""
    nd = len(wins)
    lead = x.ndim - nd
    pads = [(0, 0, 0)] * lead
    for j, (o, idx) in enumerate(wins):
        pads.append((p[j], max(0, int(idx.max()) - (x.shape[lead + j] - 1)), 0))
    xp = lax.pad(x, jnp.asarray(fill, x.dtype), pads)
    taps = []
    for offs in itertools.product(*[range(idx.shape[1]) for o, idx in wins]):
        start = [0] * lead + [kk * d[j] for j, kk in enumerate(offs)]
        limit = list(xp.shape[:lead]) + [kk * d[j] + (wins[j][0] - 1) * s[j] + 1
                                         for j, kk in enumerate(offs)]
        taps.append(lax.slice(xp, start, limit, [1] * lead + list(s)))
    return jnp.stack(taps, axis=-1)


def _flat_src_index(wins, in_sizes):
    """(o1, k1, o2, k2, ...) flat index into the input plane of each tap."""
    nd = len(wins)
    flat = np.zeros([1] * (2 * nd), dtype=np.int64)
    for j, (o, idx) in enumerate(wins):
        shape = [1] * (2 * nd)
        shape[2 * j], shape[2 * j + 1] = idx.shape
        stride = int(np.prod(in_sizes[j + 1:], dtype=np.int64))
        flat = flat + np.clip(idx, 0, in_sizes[j] - 1).reshape(shape) * stride
    return flat


def _window_last(x, nd):
    """(..., o1, k1, o2, k2, ...) -> (..., o1, o2, ..., k1*k2*...)."""
    lead = x.ndim - 2 * nd
    perm = list(range(lead)) + [lead + 2 * j for j in range(nd)] + [lead + 2 * j + 1 for j in range(nd)]
    x = jnp.transpose(x, perm)
    return x.reshape(x.shape[:lead + nd] + (-1,))


def _neg_inf(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _max_pool(x, nd, kernel_size, stride, padding, dilation, ceil_mode):
    k = _tup(kernel_size, nd)
    s = _tup(stride, nd) if stride else k
    p, d = _tup(padding, nd), _tup(dilation, nd)
    in_sizes = x.shape[-nd:]
    wins = _windows(in_sizes, k, s, p, d, ceil_mode)
    g = _slice_windows(x, wins, s, d, p, _neg_inf(x.dtype))
    valid = jnp.asarray(_np_window_mask(wins, lambda j, idx: (idx >= 0) & (idx < in_sizes[j])))
    src = _window_last(jnp.asarray(_flat_src_index(wins, in_sizes)), nd)
    return _argmax_pool(g, valid, src, nd)


def _scatter_plane(grad, indices, self_shape, nd):
    """Scatter-add ``grad`` into a zero input at the flat per-plane ``indices``."""
    lead = self_shape[:-nd]
    plane = int(np.prod(self_shape[-nd:], dtype=np.int64))
    nplanes = int(np.prod(lead, dtype=np.int64))
    g = grad.reshape(nplanes, -1)
    i = indices.reshape(nplanes, -1)
    rows = jnp.arange(nplanes)[:, None]
    acc = _acc(grad.dtype)
    out = jnp.zeros((nplanes, plane), acc).at[rows, i].add(g.astype(acc))
    return out.reshape(self_shape).astype(grad.dtype)


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


@register(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


@register(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    return _scatter_plane(grad_output, indices, self.shape, 2)


@register(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    return _scatter_plane(grad_output, indices, self.shape, 3)


def _avg_pool(x, nd, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k = _tup(kernel_size, nd)
    s = _tup(stride, nd) if stride else k
    p = _tup(padding, nd)
    in_sizes = x.shape[-nd:]
    wins = _windows(in_sizes, k, s, p, (1,) * nd, ceil_mode)
    acc = _acc(x.dtype)
    g = _slice_windows(x.astype(acc), wins, s, (1,) * nd, p, 0)
    total = jnp.sum(g, -1)
    if divisor_override:
        div = np.asarray(divisor_override, dtype=np.float64)
    elif count_include_pad:
        # taps inside the padded input (not the ceil_mode overhang)
        div = _np_window_mask(wins, lambda j, idx: (idx >= -p[j]) & (idx < in_sizes[j] + p[j])
                              ).sum(-1).astype(np.float64)
    else:
        div = _np_window_mask(wins, lambda j, idx: (idx >= 0) & (idx < in_sizes[j])
                              ).sum(-1).astype(np.float64)
    return (total / jnp.asarray(div, acc)).astype(x.dtype)


def _avg_pool_nd(nd):
    def fwd(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
            divisor_override=None):
        return _avg_pool(self, nd, kernel_size, stride, padding, ceil_mode, count_include_pad,
                         divisor_override)

    def bwd(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
            divisor_override):
        f = lambda x: fwd(x, kernel_size, stride, padding, ceil_mode, count_include_pad,  # noqa: E731
                          divisor_override)
        (gi,) = jax.linear_transpose(f, jax.ShapeDtypeStruct(self.shape, self.dtype))(
            grad_output.astype(self.dtype))
        return gi

    return fwd, bwd


avg_pool2d, avg_pool2d_backward = _avg_pool_nd(2)
avg_pool3d, avg_pool3d_backward = _avg_pool_nd(3)
register(aten.avg_pool2d.default)(avg_pool2d)
register(aten.avg_pool2d_backward.default)(avg_pool2d_backward)
register(aten.avg_pool3d.default)(avg_pool3d)
register(aten.avg_pool3d_backward.default)(avg_pool3d_backward)


def _adaptive_ranges(n, o):
    start = (np.arange(o) * n) // o
    end = -((-(np.arange(o) + 1) * n) // o)
    return start, end


def _adaptive_avg(x, output_size, nd):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise NotImplementedError(f'"adaptive_avg_pool{nd}d" not implemented for \'{_tname(x.dtype)}\'')
    out_sizes = tuple(output_size)
    acc = _acc(x.dtype)
    y = x.astype(acc)
    for j in range(nd):
        axis = x.ndim - nd + j
        n = x.shape[axis]
        o = out_sizes[j] if out_sizes[j] is not None else n
        st, en = _adaptive_ranges(n, o)
        m = np.zeros((o, n), dtype=np.float64)
        for i in range(o):
            m[i, st[i]:en[i]] = 1.0 / (en[i] - st[i])
        y = jnp.moveaxis(jnp.tensordot(y, jnp.asarray(m, acc), axes=[[axis], [1]],
                                       precision=_precision(acc)), -1, axis)
    return y.astype(x.dtype)


def _adaptive_avg_nd(nd):
    def fwd(self, output_size):
        return _adaptive_avg(self, output_size, nd)

    def bwd(grad_output, self):
        out_sizes = grad_output.shape[-nd:]
        f = lambda x: _adaptive_avg(x, out_sizes, nd)  # noqa: E731
        (gi,) = jax.linear_transpose(f, jax.ShapeDtypeStruct(self.shape, self.dtype))(
            grad_output.astype(self.dtype))
        return gi

    return fwd, bwd


_aap2, _aap2b = _adaptive_avg_nd(2)
_aap3, _aap3b = _adaptive_avg_nd(3)
register(aten._adaptive_avg_pool2d.default)(_aap2)
register(aten._adaptive_avg_pool2d_backward.default)(_aap2b)
register(aten._adaptive_avg_pool3d.default)(_aap3)
register(aten._adaptive_avg_pool3d_backward.default)(_aap3b)


def _adaptive_max(x, output_size, nd):
    in_sizes = x.shape[-nd:]
    wins = []
    for n, o in zip(in_sizes, output_size):
        st, en = _adaptive_ranges(n, o)
        kmax = int((en - st).max())
        idx = st[:, None] + np.arange(kmax)[None, :]
        idx = np.where(idx < en[:, None], idx, -1)  # -1: not part of this window
        wins.append((o, idx))
    g, valid = _gather_windows(x, wins, _neg_inf(x.dtype))
    g = _window_last(g, nd)
    valid = _window_last(jnp.asarray(np.broadcast_to(valid, [v for o, idx in wins for v in idx.shape])), nd)
    src = _window_last(jnp.asarray(_flat_src_index(wins, in_sizes)), nd)
    return _argmax_pool(g, valid, src, nd)


@register(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(self, output_size):
    return _adaptive_max(self, tuple(output_size), 2)


@register(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(self, output_size):
    return _adaptive_max(self, tuple(output_size), 3)


@register(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _scatter_plane(grad_output, indices, self.shape, 2)


@register(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _scatter_plane(grad_output, indices, self.shape, 3)


# ---------------------------------------------------------------- normalization

def _bn_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _bshape(x):
    return (1, -1) + (1,) * (x.ndim - 2)


def _bn_affine(x, mean, invstd, weight, bias, acc):
    """x * alpha + beta per channel (PyTorch CPU's form, so low-precision outputs round alike)."""
    alpha = invstd * weight.astype(acc) if weight is not None else invstd
    beta = -mean * alpha
    if bias is not None:
        beta = beta + bias.astype(acc)
    return x * alpha.reshape(_bshape(x)) + beta.reshape(_bshape(x))


def _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps):
    acc = _acc(input.dtype)
    x = input.astype(acc)
    axes = _bn_axes(x)
    n = x.size // x.shape[1]
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - mean.reshape(_bshape(x))), axis=axes)
    invstd = 1 / jnp.sqrt(var + eps)
    # PyTorch CPU normalises with the saved statistics, which have the input's dtype
    m_r, i_r = mean.astype(input.dtype).astype(acc), invstd.astype(input.dtype).astype(acc)
    y = (x - m_r.reshape(_bshape(x))) * i_r.reshape(_bshape(x))
    if weight is not None:
        y = y * weight.astype(acc).reshape(_bshape(x))
    if bias is not None:
        y = y + bias.astype(acc).reshape(_bshape(x))
    new_rm = new_rv = None
    if running_mean is not None:
        new_rm = ((1 - momentum) * running_mean.astype(acc) + momentum * mean).astype(running_mean.dtype)
    if running_var is not None:
        unbiased = var * (n / (n - 1)) if n > 1 else jnp.full_like(var, jnp.inf)
        new_rv = ((1 - momentum) * running_var.astype(acc) + momentum * unbiased).astype(running_var.dtype)
    return y.astype(input.dtype), mean.astype(input.dtype), invstd.astype(input.dtype), new_rm, new_rv


def _batch_norm_eval(input, weight, bias, running_mean, running_var, eps):
    acc = _acc(input.dtype)
    x = input.astype(acc)
    invstd = 1 / jnp.sqrt(running_var.astype(acc) + eps)
    y = _bn_affine(x, running_mean.astype(acc), invstd, weight, bias, acc)
    empty = jnp.zeros((0,), input.dtype)
    return y.astype(input.dtype), empty, empty


@register(aten.native_batch_norm.default, mutates=("running_mean", "running_var"))
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        return _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)
    return _batch_norm_eval(input, weight, bias, running_mean, running_var, eps) + (None, None)


@register(aten._native_batch_norm_legit_functional.default)
def _native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training,
                                        momentum, eps):
    if training:
        return _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)
    return _batch_norm_eval(input, weight, bias, running_mean, running_var, eps) + (
        running_mean, running_var)


@register(aten._native_batch_norm_legit.default, mutates=("running_mean", "running_var"))
def _native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum,
                             eps):
    return native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@register(aten._batch_norm_with_update.default, mutates=("running_mean", "running_var"))
def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    y, m, i, rm, rv = _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)
    return y, m, i, jnp.zeros((0,), jnp.uint8), rm, rv


@register(aten._batch_norm_with_update_functional.default)
def _batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum,
                                       eps):
    y, m, i, rm, rv = _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)
    return y, m, i, jnp.zeros((0,), jnp.uint8), rm, rv


@register(aten._batch_norm_no_update.default)
def _batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None:  # no running statistics: batch statistics, as in training
        y, m, i = _batch_norm_train(input, weight, bias, None, None, momentum, eps)[:3]
        return y, m, i, jnp.zeros((0,), jnp.uint8)
    return _batch_norm_eval(input, weight, bias, running_mean, running_var, eps) + (
        jnp.zeros((0,), jnp.uint8),)


@register(aten.batch_norm_backward.default)
def batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_var,
                        update, eps, output_mask, reserve):
    # save_var holds the inverse standard deviation; train iff statistics were saved
    train = save_mean is not None and save_mean.size > 0
    return native_batch_norm_backward(grad_out, input, weight, running_mean, running_var,
                                      save_mean, save_var, train, eps, output_mask)


@register(aten._native_batch_norm_legit.no_stats)
def _native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm_train(input, weight, bias, None, None, momentum, eps)[:3]


@register(aten._native_batch_norm_legit_no_training.default)
def _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var,
                                         momentum, eps):
    return _batch_norm_eval(input, weight, bias, running_mean, running_var, eps)


@register(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask):
    acc = _acc(input.dtype)
    x = input.astype(acc)
    g = grad_out.astype(acc)
    axes = _bn_axes(x)
    bs = _bshape(x)
    if train:
        mean, invstd = save_mean.astype(acc), save_invstd.astype(acc)
    else:
        mean = running_mean.astype(acc)
        invstd = lax.rsqrt(running_var.astype(acc) + eps)
    xhat = (x - mean.reshape(bs)) * invstd.reshape(bs)
    sum_g = jnp.sum(g, axis=axes)
    sum_gx = jnp.sum(g * xhat, axis=axes)
    w = weight.astype(acc) if weight is not None else jnp.ones(x.shape[1], acc)
    gi = gw = gb = None
    if output_mask[0]:
        if train:
            n = x.size // x.shape[1]
            gi = (w * invstd).reshape(bs) * (g - (sum_g / n).reshape(bs) - xhat * (sum_gx / n).reshape(bs))
        else:
            gi = g * (w * invstd).reshape(bs)
        gi = gi.astype(input.dtype)
    if output_mask[1]:
        gw = sum_gx.astype(weight.dtype if weight is not None else input.dtype)
    if output_mask[2]:
        gb = sum_g.astype(weight.dtype if weight is not None else input.dtype)
    return gi, gw, gb


def _ln_axes(x, normalized_shape):
    return tuple(range(x.ndim - len(normalized_shape), x.ndim))


@register(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    acc = _acc(input.dtype)
    x = input.astype(acc)
    axes = _ln_axes(x, normalized_shape)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * weight.astype(acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(input.dtype), mean.astype(input.dtype), rstd.astype(input.dtype)


@register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                               output_mask):
    acc = _acc(input.dtype)
    x = input.astype(acc)
    g = grad_out.astype(acc)
    axes = _ln_axes(x, normalized_shape)
    batch_axes = tuple(range(x.ndim - len(normalized_shape)))
    mean, rstd = mean.astype(acc), rstd.astype(acc)
    xhat = (x - mean) * rstd
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * weight.astype(acc) if weight is not None else g
        m = math.prod(normalized_shape)
        gi = rstd * (gx - jnp.sum(gx, axes, keepdims=True) / m
                     - xhat * (jnp.sum(gx * xhat, axes, keepdims=True) / m))
        gi = gi.astype(input.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(g * xhat, batch_axes).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        gb = jnp.sum(g, batch_axes).astype(bias.dtype)
    return gi, gw, gb


def _group_norm(input, weight, bias, N, C, HxW, group, eps):
    acc = _acc(input.dtype)
    x = input.astype(acc).reshape(N, group, -1)
    mean = jnp.mean(x, axis=-1)
    var = jnp.mean(jnp.square(x - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    y = ((x - mean[..., None]) * rstd[..., None]).reshape(N, C, -1)
    if weight is not None:
        y = y * weight.astype(acc)[None, :, None]
    if bias is not None:
        y = y + bias.astype(acc)[None, :, None]
    return y.reshape(input.shape).astype(input.dtype), mean.astype(input.dtype), rstd.astype(input.dtype)


@register(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    return _group_norm(input, weight, bias, N, C, HxW, group, eps)


@register(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    acc = _acc(input.dtype)
    x = input.astype(acc).reshape(N, group, -1)
    g = grad_out.astype(acc).reshape(N, C, -1)
    mean, rstd = mean.astype(acc), rstd.astype(acc)
    xhat = ((x - mean[..., None]) * rstd[..., None]).reshape(N, C, -1)
    gi = gw = gb = None
    if output_mask[0]:
        gx = g * weight.astype(acc)[None, :, None] if weight is not None else g
        gx = gx.reshape(N, group, -1)
        xh = xhat.reshape(N, group, -1)
        m = gx.shape[-1]
        gi = rstd[..., None] * (gx - jnp.sum(gx, -1, keepdims=True) / m
                                - xh * (jnp.sum(gx * xh, -1, keepdims=True) / m))
        gi = gi.reshape(input.shape).astype(input.dtype)
    if output_mask[1] and weight is not None:
        gw = jnp.sum(g * xhat, (0, 2)).astype(weight.dtype)
    if output_mask[2]:
        gb = jnp.sum(g, (0, 2)).astype(weight.dtype if weight is not None else input.dtype)
    return gi, gw, gb


def _wn_axes(v, dim):
    """The axes a weight norm reduces over: all but ``dim`` (-1: none kept, a whole-tensor norm)."""
    if dim == -1:
        return tuple(range(v.ndim))
    dim = dim % v.ndim if v.ndim else 0
    return tuple(a for a in range(v.ndim) if a != dim)


@register(aten._weight_norm_interface.default)
def _weight_norm_interface(v, g, dim=0):
    """(w, norms): w = v * g / ||v|| over every axis but ``dim``; norms in the opmath dtype
    (float32 for half inputs), shaped like ``g`` as PyTorch's kernel returns them."""
    acc = _acc(v.dtype)
    x = v.astype(acc)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), _wn_axes(v, dim), keepdims=True))
    w = x * (g.astype(acc) / norm)
    return w.astype(v.dtype), norm.reshape(g.shape)


@register(aten._weight_norm_interface_backward.default)
def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """grad_g = sum(grad_w * v) / norm; grad_v = (g / norm) * (grad_w - v * sum(grad_w * v) / norm^2)."""
    acc = _acc(saved_v.dtype)
    axes = _wn_axes(saved_v, dim)
    v, gw = saved_v.astype(acc), grad_w.astype(acc)
    keep = tuple(1 if a in axes else n for a, n in enumerate(v.shape))
    norm = saved_norms.astype(acc).reshape(keep)
    g = saved_g.astype(acc).reshape(keep)
    dot = jnp.sum(gw * v, axes, keepdims=True)
    grad_g = dot / norm
    grad_v = (g / norm) * (gw - v * (grad_g / norm))
    return grad_v.astype(saved_v.dtype), grad_g.reshape(saved_g.shape).astype(saved_g.dtype)


if hasattr(aten, "_fused_rms_norm"):
    @register(aten._fused_rms_norm.default)
    def _fused_rms_norm(input, normalized_shape, weight, eps):
        acc = _acc(input.dtype)
        x = input.astype(acc)
        axes = _ln_axes(x, normalized_shape)
        if eps is None:
            eps = float(jnp.finfo(input.dtype).eps)
        rstd = lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + eps)
        y = x * rstd
        if weight is not None:
            y = y * weight.astype(acc)
        return y.astype(input.dtype), rstd.astype(acc)

    @register(aten._fused_rms_norm_backward.default)
    def _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
        acc = _acc(input.dtype)
        x = input.astype(acc)
        g = grad_out.astype(acc)
        rstd = rstd.astype(acc)
        axes = _ln_axes(x, normalized_shape)
        batch_axes = tuple(range(x.ndim - len(normalized_shape)))
        xhat = x * rstd
        gi = gw = None
        if output_mask[0]:
            gx = g * weight.astype(acc) if weight is not None else g
            m = math.prod(normalized_shape)
            gi = (rstd * (gx - xhat * jnp.sum(gx * xhat, axes, keepdims=True) / m)).astype(input.dtype)
        if output_mask[1] and weight is not None:
            gw = jnp.sum(g * xhat, batch_axes).astype(weight.dtype)
        return gi, gw


# ---------------------------------------------------------------- upsampling

def _np_dtype(dtype):
    return np.float64 if dtype == jnp.float64 else np.float32


def _scale(in_size, out_size, align_corners, scale, ftype):
    """PyTorch's area_pixel_compute_scale."""
    if align_corners:
        return ftype(in_size - 1) / ftype(out_size - 1) if out_size > 1 else ftype(0)
    if scale is not None and scale > 0:
        return ftype(1.0 / scale)
    return ftype(in_size) / ftype(out_size)


def _nearest_index(in_size, out_size, scale, exact):
    # PyTorch: compute_scales_value (in/out or 1/scale) then floor(dst * scale) in float
    s = np.float32(1.0 / scale) if scale is not None and scale > 0 else np.float32(in_size) / np.float32(out_size)
    dst = np.arange(out_size, dtype=np.float32)
    if not exact and out_size == in_size:
        return np.arange(out_size)
    if not exact and out_size == 2 * in_size:
        return np.arange(out_size) >> 1
    if exact:
        src = np.floor((dst + np.float32(0.5)) * s).astype(np.int64)
    else:
        src = np.floor(dst * s).astype(np.int64)
    return np.minimum(src, in_size - 1)


def _upsample_nearest(x, output_size, scales, exact):
    nd = len(output_size)
    for j in range(nd):
        axis = x.ndim - nd + j
        sc = scales[j] if scales is not None and j < len(scales) else None
        x = jnp.take(x, _nearest_index(x.shape[axis], output_size[j], sc, exact), axis=axis)
    return x


def _linear_taps(in_size, out_size, align_corners, scale, ftype):
    """(indices, weights), each (2, out_size): the two input pixels each output reads and their
    weights (PyTorch's compute_indices_weights_linear)."""
    s = _scale(in_size, out_size, align_corners, scale, ftype)
    dst = np.arange(out_size, dtype=ftype)
    if align_corners:
        src = dst * s
    else:
        src = np.maximum((dst + ftype(0.5)) * s - ftype(0.5), ftype(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    i1 = np.minimum(i0 + 1, in_size - 1)
    lam1 = (src - i0.astype(ftype)).astype(ftype)
    lam0 = (ftype(1) - lam1).astype(ftype)
    return np.stack([i0, i1]), np.stack([lam0, lam1])


def _cubic_taps(in_size, out_size, align_corners, scale, ftype):
    """(indices, weights), each (4, out_size): the bicubic kernel's four taps (a = -0.75),
    indices clamped to the border (PyTorch's upsample_bicubic2d)."""
    A = ftype(-0.75)
    s = _scale(in_size, out_size, align_corners, scale, ftype)
    dst = np.arange(out_size, dtype=ftype)
    if align_corners:
        src = dst * s
    else:
        src = (dst + ftype(0.5)) * s - ftype(0.5)
    fl = np.floor(src)
    t = (src - fl).astype(ftype)
    i = fl.astype(np.int64)

    def c1(x):  # |x| <= 1
        return ((A + 2) * x - (A + 3)) * x * x + 1

    def c2(x):  # 1 < |x| < 2
        return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A

    ws = [c2(t + 1), c1(t), c1(1 - t), c2(2 - t)]
    return (np.stack([np.clip(i - 1 + k, 0, in_size - 1) for k in range(4)]),
            np.stack([w.astype(ftype) for w in ws]))


def _gather_taps(y, axis, idx, w, dtype, valid=None):
    """sum_k w[k] * y.take(idx[k], axis): each output along ``axis`` reads only its own taps, so
    the cost grows with outputs x taps (a dense (out x in) weight matrix grew with out x in, and
    0 * inf spread one inf pixel over the whole row). Taps add left to right, as CPU's kernel.
    ``valid`` (taps, out_size) marks the taps an output really has (antialias windows are
    shorter at the borders): a padding tap adds an exact 0, never 0 * inf. Each tap is cast
    to ``dtype`` after its gather (uint8 pixels into int32 sums without an int32 copy of the
    whole image)."""
    shape = [1] * y.ndim
    shape[axis] = idx.shape[1]
    if idx.shape[0] > _UNROLLED_TAPS:
        return _scan_taps(y, axis, idx, w, dtype, valid, shape)
    out = None
    for k in range(idx.shape[0]):
        t = jnp.take(y, jnp.asarray(idx[k], jnp.int32), axis=axis, mode="clip").astype(dtype)
        t = t * jnp.asarray(w[k], dtype).reshape(shape)
        if valid is not None and not valid[k].all():
            t = jnp.where(jnp.asarray(valid[k]).reshape(shape), t, jnp.zeros((), t.dtype))
        out = t if out is None else out + t
    return out


# past this many taps per output (an antialiased downscale by more than ~8x: 1080 rows to 4 is
# 961 taps) the taps are summed by a loop instead of unrolled: XLA compiled the unrolled 961
# gathers in ~30 s
_UNROLLED_TAPS = 24


def _scan_taps(y, axis, idx, w, dtype, valid, shape):
    """``_gather_taps`` as a loop over the taps (same order, same sums)."""
    if valid is None:
        valid = np.ones(idx.shape, bool)
    oshape = list(y.shape)
    oshape[axis] = idx.shape[1]

    def body(acc, tap):
        i, wk, vk = tap
        t = jnp.take(y, i, axis=axis, mode="clip").astype(dtype) * wk.reshape(shape)
        return acc + jnp.where(vk.reshape(shape), t, jnp.zeros((), dtype)), None

    first = jnp.take(y, jnp.asarray(idx[0], jnp.int32), axis=axis, mode="clip").astype(dtype)
    first = jnp.where(jnp.asarray(valid[0]).reshape(shape),
                      first * jnp.asarray(w[0], dtype).reshape(shape), jnp.zeros((), dtype))
    out, _ = lax.scan(body, first, (jnp.asarray(idx[1:], jnp.int32), jnp.asarray(w[1:], dtype),
                                    jnp.asarray(valid[1:])))
    return out


def _int16_weights(taps, out_size):
    """PyTorch's uint8 interpolation weights: the float weight of each (output, input) pair
    rounded to a fixed-point integer at the largest precision (< 22 bits) whose doubled largest
    weight stays below 2**15 (``_compute_index_ranges_int16_weights``). ``taps`` is (rows,
    columns, weights) per tap; taps clamped onto the same input pixel add up first. Returns
    (indices, integer weights), each (taps, out_size) (a padding tap has weight 0), and the
    precision."""
    rows = np.concatenate([r for r, _, _ in taps]).astype(np.int64)
    cols = np.concatenate([c for _, c, _ in taps]).astype(np.int64)
    ws = np.concatenate([w for _, _, w in taps]).astype(np.float64)
    n = int(cols.max()) + 1 if cols.size else 1
    pairs, inv = np.unique(rows * n + cols, return_inverse=True)
    merged = np.zeros(pairs.size, np.float64)
    np.add.at(merged, inv.reshape(-1), ws)
    prow, pcol = pairs // n, pairs % n
    wmax = max(float(merged.max()), 0.0) if merged.size else 0.0
    prec = 0
    while prec < 22 and int(0.5 + wmax * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    v = merged * (1 << prec)
    iw = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int64)
    # pairs are sorted by row: the k-th pair of each row goes to tap slot k
    count = np.bincount(prow, minlength=out_size)
    first = np.concatenate([[0], np.cumsum(count)[:-1]])
    slot = np.arange(pairs.size) - first[prow]
    k = max(int(count.max()) if count.size else 1, 1)
    idx = np.zeros((k, out_size), np.int64)
    wt = np.zeros((k, out_size), np.int64)
    idx[slot, prow] = pcol
    wt[slot, prow] = iw
    return idx, wt, prec


def _uint8_linear_taps(in_size, out_size, align_corners, scale):
    # upsample_bilinear2d on uint8 (CPU's separable uint8 kernel): the antialias helper's taps
    # without antialiasing, shifted by half a pixel under align_corners; taps that fall outside
    # the input are dropped and the rest renormalized
    s = float(_scale(in_size, out_size, align_corners, scale, float))
    delta = 0.5 if align_corners else 0.0
    rows, cols, ws = [], [], []
    for i in range(out_size):
        c = s * (i + 0.5 - delta)
        xmin = max(int(c - 1.0 + 0.5 + delta), 0)
        xs = min(max(min(int(c + 1.0 + 0.5 + delta), in_size) - xmin, 0), 2)
        w = [max(0.0, 1.0 - abs(j + xmin - c + 0.5 - delta)) for j in range(xs)]
        t = sum(w)
        for j, wj in enumerate(w):
            rows.append(i)
            cols.append(xmin + j)
            ws.append(wj / t if t != 0.0 else wj)
    return [(np.asarray(rows, np.int64), np.asarray(cols, np.int64), np.asarray(ws, np.float64))]


def _uint8_cubic_taps(in_size, out_size, align_corners, scale):
    # upsample_bicubic2d on uint8: the float kernel's four taps (a = -0.75, indices clamped to
    # the border), each rounded on its own
    A = -0.75
    s = float(_scale(in_size, out_size, align_corners, scale, float))
    dst = np.arange(out_size, dtype=np.float64)
    src = dst * s if align_corners else (dst + 0.5) * s - 0.5
    fl = np.floor(src)
    t = src - fl
    i = fl.astype(np.int64)
    c1 = lambda x: ((A + 2) * x - (A + 3)) * x * x + 1  # noqa: E731
    c2 = lambda x: ((A * x - 5 * A) * x + 8 * A) * x - 4 * A  # noqa: E731
    ws = [c2(t + 1), c1(t), c1(1 - t), c2(2 - t)]
    rows = np.arange(out_size)
    return [(rows, np.clip(i - 1 + k, 0, in_size - 1), w) for k, w in enumerate(ws)]


def _separable_uint8(x, output_size, make, align_corners, scales):
    """PyTorch CPU's uint8 bilinear/bicubic kernel, bit for bit: one pass per dimension, the last
    first, skipping a dimension whose size does not change; each pass sums integer weights times
    the pixels' taps, adds half a unit, shifts the precision away and clamps to [0, 255]."""
    taps_of = _uint8_cubic_taps if make is _cubic_taps else _uint8_linear_taps
    y = x  # uint8 between passes (each pass clamps to [0, 255]); the sums are int32
    for axis, n, o, sc in _resized_dims(x, output_size, scales):
        y = _uint8_pass(y, axis, *_int16_weights(taps_of(n, o, align_corners, sc), o))
    return y


def _resized_dims(x, output_size, scales):
    """(axis, input size, output size, scale) of each resized dimension whose size changes, the
    last first (CPU's separable kernels' order)."""
    nd = len(output_size)
    for j in reversed(range(nd)):
        axis = x.ndim - nd + j
        n, o = x.shape[axis], output_size[j]
        if n != o:
            yield axis, n, o, (scales[j] if scales is not None and j < len(scales) else None)


def _uint8_pass(y, axis, idx, wt, prec):
    """One uint8 pass: the integer weights times the taps, half a unit added, the precision
    shifted away, clamped to [0, 255]."""
    y = _gather_taps(y, axis, idx, wt, jnp.int32)
    return jnp.clip((y + (1 << (prec - 1) if prec > 0 else 0)) >> prec, 0, 255).astype(jnp.uint8)


def _separable(x, output_size, make, align_corners, scales):
    nd = len(output_size)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        # CPU computes uint8 bilinear/bicubic with fixed-point weights and refuses every other
        # integer or bool dtype (and uint8 in 1-d and 3-d)
        if x.dtype == jnp.uint8 and nd == 2:
            return _separable_uint8(x, output_size, make, align_corners, scales)
        what = "compute_indices_weights_cubic" if make is _cubic_taps else "compute_indices_weights_linear"
        raise NotImplementedError(f'"{what}" not implemented for \'{_tname(x.dtype)}\'')
    acc = _acc(x.dtype)
    ftype = _np_dtype(acc)
    y = x.astype(acc)
    for j in reversed(range(nd)):  # the last dimension first, as CPU's nested kernel sums
        axis = x.ndim - nd + j
        if make is _linear_taps and x.shape[axis] == output_size[j]:
            # CPU's linear kernels leave a dimension whose size does not change as it is, even
            # under a scale_factor other than 1 (scale_factor=(1.09, 2) on 10 rows: 10 rows)
            continue
        sc = scales[j] if scales is not None and j < len(scales) else None
        idx, w = make(x.shape[axis], output_size[j], align_corners, sc, ftype)
        y = _gather_taps(y, axis, idx, w, acc)
    return y.astype(x.dtype)



def _aa_filter(x, cubic, ftype):
    """PyTorch's antialias filters (HelperInterpLinear/Cubic::aa_filter): the triangle, and the
    cubic convolution with a = -0.5 (PIL's, not the -0.75 of plain bicubic)."""
    x = np.abs(x)
    if not cubic:
        return np.where(x < 1, (1.0 - x.astype(np.float64)).astype(ftype), ftype(0)).astype(ftype)
    A = ftype(-0.5)
    c1 = ((A + 2) * x - (A + 3)) * x * x + 1
    c2 = ((A * x - 5 * A) * x + 8 * A) * x - 4 * A
    return np.where(x < 1, c1, np.where(x < 2, c2, ftype(0))).astype(ftype)


def _aa_window(in_size, out_size, align_corners, scale, cubic, ftype):
    """PyTorch's antialias taps (``_compute_indices_min_size_weights_aa``): output i reads the
    inputs [xmin, xmin + xsize) around its centre scale * (i + 0.5), the filter stretched by the
    downscale factor (support 1 or 2 input pixels times max(scale, 1)), weights normalized per
    output. ``ftype`` is CPU's scalar type: float32 or float64 (float64 for uint8's integer
    weights), with the double-precision steps of the C++ expressions kept in float64. Returns
    (indices, weights, valid), each (taps, out_size); taps past xsize are padding (weight 0)."""
    interp = 4 if cubic else 2
    s = ftype(_scale(in_size, out_size, align_corners, scale, ftype))
    support = ftype(interp * 0.5 * np.float64(s)) if s >= 1 else ftype(interp * 0.5)
    k = int(np.ceil(support)) * 2 + 1
    invscale = ftype(1.0 / np.float64(s)) if s >= 1 else ftype(1.0)
    i = np.arange(out_size, dtype=np.float64)
    center = (np.float64(s) * (i + 0.5)).astype(ftype)
    xmin = np.maximum(np.trunc((center - support).astype(np.float64) + 0.5), 0).astype(np.int64)
    xend = np.minimum(np.trunc((center + support).astype(np.float64) + 0.5).astype(np.int64), in_size)
    xsize = np.clip(xend - xmin, 0, k)
    j = np.arange(k)[:, None]
    valid = j < xsize[None, :]
    arg = (((j + xmin[None, :]).astype(ftype) - center[None, :]).astype(np.float64) + 0.5)
    w = _aa_filter((arg * np.float64(invscale)).astype(ftype), cubic, ftype)
    w = np.where(valid, w, ftype(0)).astype(ftype)
    total = np.zeros(out_size, ftype)
    for r in range(k):  # summed tap by tap in CPU's scalar type
        total = (total + w[r]).astype(ftype)
    w = np.where(total != 0, w / np.where(total != 0, total, ftype(1)), w).astype(ftype)
    idx = np.where(valid, j + xmin[None, :], np.minimum(xmin, in_size - 1)[None, :])
    return idx, w, valid


def _separable_aa(x, output_size, cubic, align_corners, scales):
    """F.interpolate(..., antialias=True) on 2-d images, as CPU's separable kernel: one pass per
    dimension whose size changes, the last first; float32/float64 sum each window's taps in
    order in their own dtype, uint8 rounds the float64 weights to CPU's int16 fixed point
    (``_int16_weights``) and clamps after each pass, bit for bit."""
    if x.dtype not in (jnp.float32, jnp.float64, jnp.uint8):
        raise NotImplementedError(
            f'"compute_index_ranges_weights" not implemented for \'{_tname(x.dtype)}\'')
    u8 = x.dtype == jnp.uint8
    ftype = np.float64 if u8 or x.dtype == jnp.float64 else np.float32
    y = x  # uint8 stays uint8 between passes (each clamps to [0, 255]); the sums are int32
    for axis, n, o, sc in _resized_dims(x, output_size, scales):
        idx, w, valid = _aa_window(n, o, align_corners, sc, cubic, ftype)
        if u8:
            rows = np.broadcast_to(np.arange(o), idx.shape)
            y = _uint8_pass(y, axis, *_int16_weights([(rows[valid], idx[valid], w[valid])], o))
        else:
            y = _gather_taps(y, axis, idx, w, x.dtype, valid)
    return y.astype(x.dtype)


def _transpose_of(f, input_size, dtype, grad_output):
    (gi,) = jax.linear_transpose(f, jax.ShapeDtypeStruct(tuple(input_size), dtype))(grad_output)
    return gi


def _nearest_ops(nd, exact):
    def fwd(self, output_size, *scales):
        return _upsample_nearest(self, tuple(output_size), scales, exact)

    def bwd(grad_output, output_size, input_size, *scales):
        f = lambda x: _upsample_nearest(x, tuple(output_size), scales, exact)  # noqa: E731
        return _transpose_of(f, input_size, grad_output.dtype, grad_output)

    return fwd, bwd


for _nd, _name in ((1, "1d"), (2, "2d"), (3, "3d")):
    for _exact, _prefix in ((False, "upsample_nearest"), (True, "_upsample_nearest_exact")):
        _f, _b = _nearest_ops(_nd, _exact)
        register(getattr(aten, _prefix + _name).default)(_f)
        register(getattr(aten, _prefix + _name + "_backward").default)(_b)


def _aligned_ops(resize):
    """The forward and backward lowerings of a resize op taking ``align_corners``:
    ``resize(x, output_size, align_corners, scales)``; the backward is its linear transpose."""
    def fwd(self, output_size, align_corners, *scales):
        return resize(self, tuple(output_size), align_corners, scales)

    def bwd(grad_output, output_size, input_size, align_corners, *scales):
        f = lambda x: resize(x, tuple(output_size), align_corners, scales)  # noqa: E731
        return _transpose_of(f, input_size, grad_output.dtype, grad_output)

    return fwd, bwd


def _interp_ops(make):
    return _aligned_ops(lambda x, o, ac, sc: _separable(x, o, make, ac, sc))


def _aa_ops(cubic):
    return _aligned_ops(lambda x, o, ac, sc: _separable_aa(x, o, cubic, ac, sc))


for _name, _make in (("upsample_linear1d", _linear_taps), ("upsample_bilinear2d", _linear_taps),
                     ("upsample_trilinear3d", _linear_taps), ("upsample_bicubic2d", _cubic_taps)):
    _f, _b = _interp_ops(_make)
    register(getattr(aten, _name).default)(_f)
    register(getattr(aten, _name + "_backward").default)(_b)

for _name, _cubic in (("_upsample_bilinear2d_aa", False), ("_upsample_bicubic2d_aa", True)):
    _f, _b = _aa_ops(_cubic)
    register(getattr(aten, _name).default)(_f)
    register(getattr(aten, _name + "_backward").default)(_b)


# ---------------------------------------------------------------- grid sampling

def _gs_unnormalize(coord, size, align_corners):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _gs_reflect(x, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(x)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    x = jnp.abs(x - lo)
    extra = jnp.fmod(x, span)
    flips = jnp.floor(x / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _gs_coordinates(x, size, padding_mode, align_corners):
    if padding_mode == 1:  # border
        return jnp.clip(x, 0, size - 1)
    if padding_mode == 2:  # reflection
        if align_corners:
            x = _gs_reflect(x, 0, 2 * (size - 1))
        else:
            x = _gs_reflect(x, -1, 2 * size - 1)
        return jnp.clip(x, 0, size - 1)
    return x


def _gs_read(inp, ix, iy):
    """inp (N, C, H, W); integer-valued ix, iy (N, Ho, Wo): (N, C, Ho, Wo), zero outside."""
    N, C, H, W = inp.shape
    ok = (ix >= 0) & (ix <= W - 1) & (iy >= 0) & (iy <= H - 1)
    xi = jnp.clip(ix, 0, W - 1).astype(jnp.int32)
    yi = jnp.clip(iy, 0, H - 1).astype(jnp.int32)
    flat = inp.reshape(N, C, H * W)
    idx = (yi * W + xi).reshape(N, 1, -1)
    v = jnp.take_along_axis(flat, jnp.broadcast_to(idx, (N, C, idx.shape[-1])), axis=2)
    v = v.reshape((N, C) + ix.shape[1:])
    return jnp.where(ok[:, None], v, jnp.zeros((), inp.dtype))


def _grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    acc = _acc(input.dtype)
    inp = input.astype(acc)
    g = grid.astype(acc)
    H, W = input.shape[2], input.shape[3]
    x = _gs_unnormalize(g[..., 0], W, align_corners)
    y = _gs_unnormalize(g[..., 1], H, align_corners)
    if interpolation_mode == 2:  # bicubic: padding applies to each tap
        x0, y0 = jnp.floor(x), jnp.floor(y)
        tx, ty = x - x0, y - y0
        A = -0.75

        def coeffs(t):
            c1 = lambda s: ((A + 2) * s - (A + 3)) * s * s + 1  # noqa: E731
            c2 = lambda s: ((A * s - 5 * A) * s + 8 * A) * s - 4 * A  # noqa: E731
            return [c2(t + 1), c1(t), c1(1 - t), c2(2 - t)]

        wx, wy = coeffs(tx), coeffs(ty)
        out = 0
        for j in range(4):
            row = 0
            yy = _gs_coordinates(y0 - 1 + j, H, padding_mode, align_corners)
            for i in range(4):
                xx = _gs_coordinates(x0 - 1 + i, W, padding_mode, align_corners)
                row = row + _gs_read(inp, xx, yy) * wx[i][:, None]
            out = out + row * wy[j][:, None]
        return out.astype(input.dtype)
    x = _gs_coordinates(x, W, padding_mode, align_corners)
    y = _gs_coordinates(y, H, padding_mode, align_corners)
    if interpolation_mode == 1:  # nearest (round half to even, as nearbyint)
        return _gs_read(inp, jnp.round(x), jnp.round(y)).astype(input.dtype)
    x0, y0 = jnp.floor(x), jnp.floor(y)
    x1, y1 = x0 + 1, y0 + 1
    wx1, wy1 = x - x0, y - y0
    wx0, wy0 = x1 - x, y1 - y
    out = (_gs_read(inp, x0, y0) * (wx0 * wy0)[:, None] + _gs_read(inp, x1, y0) * (wx1 * wy0)[:, None]
           + _gs_read(inp, x0, y1) * (wx0 * wy1)[:, None] + _gs_read(inp, x1, y1) * (wx1 * wy1)[:, None])
    return out.astype(input.dtype)


@register(aten.grid_sampler_2d.default)
def grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(grad_output, input, grid, interpolation_mode, padding_mode,
                             align_corners, output_mask):
    f = lambda i, g: _grid_sampler_2d(i, g, interpolation_mode, padding_mode, align_corners)  # noqa: E731
    _, vjp = jax.vjp(f, input, grid)
    gi, gg = vjp(grad_output.astype(input.dtype))
    return (gi if output_mask[0] else None), gg


def _gs_read3(inp, ix, iy, iz):
    """inp (N, C, D, H, W); integer-valued ix, iy, iz (N, Do, Ho, Wo), zero outside."""
    N, C, D, H, W = inp.shape
    ok = (ix >= 0) & (ix <= W - 1) & (iy >= 0) & (iy <= H - 1) & (iz >= 0) & (iz <= D - 1)
    xi = jnp.clip(ix, 0, W - 1).astype(jnp.int32)
    yi = jnp.clip(iy, 0, H - 1).astype(jnp.int32)
    zi = jnp.clip(iz, 0, D - 1).astype(jnp.int32)
    flat = inp.reshape(N, C, D * H * W)
    idx = ((zi * H + yi) * W + xi).reshape(N, 1, -1)
    v = jnp.take_along_axis(flat, jnp.broadcast_to(idx, (N, C, idx.shape[-1])), axis=2)
    v = v.reshape((N, C) + ix.shape[1:])
    return jnp.where(ok[:, None], v, jnp.zeros((), inp.dtype))


def _grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    acc = _acc(input.dtype)
    inp = input.astype(acc)
    g = grid.astype(acc)
    D, H, W = input.shape[2:]
    x = _gs_coordinates(_gs_unnormalize(g[..., 0], W, align_corners), W, padding_mode, align_corners)
    y = _gs_coordinates(_gs_unnormalize(g[..., 1], H, align_corners), H, padding_mode, align_corners)
    z = _gs_coordinates(_gs_unnormalize(g[..., 2], D, align_corners), D, padding_mode, align_corners)
    if interpolation_mode == 1:  # nearest
        return _gs_read3(inp, jnp.round(x), jnp.round(y), jnp.round(z)).astype(input.dtype)
    if interpolation_mode != 0:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    x0, y0, z0 = jnp.floor(x), jnp.floor(y), jnp.floor(z)
    out = 0
    for dz in (0, 1):
        wz = (z - z0) if dz else (z0 + 1 - z)
        for dy in (0, 1):
            wy = (y - y0) if dy else (y0 + 1 - y)
            for dx in (0, 1):
                wx = (x - x0) if dx else (x0 + 1 - x)
                out = out + _gs_read3(inp, x0 + dx, y0 + dy, z0 + dz) * (wx * wy * wz)[:, None]
    return out.astype(input.dtype)


@register(aten.grid_sampler_3d.default)
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners)


@register(aten.grid_sampler_3d_backward.default)
def grid_sampler_3d_backward(grad_output, input, grid, interpolation_mode, padding_mode,
                             align_corners, output_mask):
    f = lambda i, g: _grid_sampler_3d(i, g, interpolation_mode, padding_mode, align_corners)  # noqa: E731
    _, vjp = jax.vjp(f, input, grid)
    gi, gg = vjp(grad_output.astype(input.dtype))
    return (gi if output_mask[0] else None), gg


# ---------------------------------------------------------------- max pooling without indices
# (torch.tpu.ops.max_pool: ops/pooling.py registers these for torch.ops.tpu.max_pool{,_backward})

def max_pool_values(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Max over each window of the last ``len(kernel_size)`` dims: the values only, no index
    computation (a NaN in a window gives NaN, as PyTorch's max pooling does)."""
    nd = len(kernel_size)
    k = _tup(kernel_size, nd)
    s = _tup(stride, nd) if stride else k
    p, d = _tup(padding, nd), _tup(dilation, nd)
    wins = _windows(x.shape[-nd:], k, s, p, d, ceil_mode)
    return jnp.max(_slice_windows(x, wins, s, d, p, _neg_inf(x.dtype)), axis=-1)


def max_pool_grad(grad_output, x, kernel_size, stride=(), padding=0, dilation=1,
                  ceil_mode=False):
    """The gradient of ``max_pool_values``: each window's gradient goes to the tap PyTorch's
    max pooling picks (the first maximum, or the last NaN)."""
    nd = len(kernel_size)
    _, idx = _max_pool(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
    return _scatter_plane(grad_output, idx, x.shape, nd)
