"""Reductions, scans, sorting and softmax lowerings (PyTorch semantics).

Conventions shared by this module:
- ``dim`` lists are canonicalised with ``_dims``; ``None`` (and, for most ops, ``[]``) means
  every dimension, like PyTorch. A 0-d tensor accepts dim 0 / -1.
- Half-precision floats (float16, bfloat16) accumulate in float32 and are cast back, which is
  what PyTorch's CPU kernels do.
- Index outputs are int64. Ties and NaNs follow PyTorch's CPU kernels (first occurrence for
  max/min/argmax, NaN treated as larger than every number by sort/topk/kthvalue/median).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ._util import canonical_dim, jdtype, to_jax, to_torch
from ._util import real_dtype as _real_dtype
from ..runtime.dtypes import scalar_type_name as _tname
from . import registry
from .registry import aten, register


_LOW = (jnp.float16, jnp.bfloat16)
_I64 = jnp.int64


# ---------------------------------------------------------------- helpers

def _dims(dim, ndim, empty_means_all=True):
    """Canonical tuple of reduced dims (sorted, unique)."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    dim = list(dim)
    if not dim and empty_means_all:
        return tuple(range(ndim))
    out = []
    for d in dim:
        c = canonical_dim(d, ndim)
        if c in out:
            raise RuntimeError(f"dim {c} appears multiple times in the list of dims")
        out.append(c)
    if ndim == 0:
        return ()
    return tuple(sorted(out))


def _acc(x):
    """Upcast half-precision floats for accumulation."""
    if x.dtype in _LOW:
        return x.astype(jnp.float32)
    return x


def _is_float(x):
    return jnp.issubdtype(x.dtype, jnp.floating)


def _is_complex(x):
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


def _is_intlike(x):
    return not (_is_float(x) or _is_complex(x))


def _keep(r, x_ndim, dims, keepdim):
    """Re-insert reduced dims (size 1) into ``r`` when keepdim."""
    if keepdim and x_ndim > 0:
        return jnp.expand_dims(r, dims)
    return r


def _numel_check(x, name, dims):
    if x.size == 0:
        if not dims and x.ndim != 0:
            raise IndexError(
                f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                "Specify the reduction dim with the 'dim' argument.")
        for d in dims:
            if x.shape[d] == 0:
                raise IndexError(
                    f"{name}(): Expected reduction dim {d} to have non-zero size.")


def _to_axis_last(x, dim):
    return jnp.moveaxis(x, dim, -1)


def _from_axis_last(x, dim):
    return jnp.moveaxis(x, -1, dim)


# ---------------------------------------------------------------- sum / mean / prod

def _sum_dtype(x, dtype):
    if dtype is not None:
        return to_jax(dtype)
    if _is_intlike(x):
        return _I64
    return x.dtype


@register(aten.sum.default)
def sum_default(self, *, dtype=None):
    return sum_dim(self, None, False, dtype=dtype)


@register(aten.sum.dim_IntList)
def sum_dim(self, dim, keepdim=False, *, dtype=None):
    od = _sum_dtype(self, dtype)
    x = self.astype(od)
    dims = _dims(dim, self.ndim)
    r = jnp.sum(_acc(x), axis=dims, keepdims=keepdim)
    return r.astype(od)


@register(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    if _is_complex(self):
        raise RuntimeError("nansum does not support complex inputs")
    od = _sum_dtype(self, dtype)
    x = self.astype(od)
    if _is_float(x):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    dims = _dims(dim, self.ndim)
    return jnp.sum(_acc(x), axis=dims, keepdims=keepdim).astype(od)


def _mean_dtype(self, dtype, name="mean"):
    od = to_jax(dtype) if dtype is not None else self.dtype
    if not (jnp.issubdtype(od, jnp.floating) or jnp.issubdtype(od, jnp.complexfloating)):
        raise RuntimeError(
            f"{name}(): could not infer output dtype. "
            f"{'Input' if dtype is None else 'Optional'} dtype must be either a floating point "
            f"or complex dtype. Got: {_tname(od)}")
    return od


@register(aten.mean.default)
def mean_default(self, *, dtype=None):
    return mean_dim(self, None, False, dtype=dtype)


@register(aten.mean.dim)
def mean_dim(self, dim, keepdim=False, *, dtype=None):
    od = _mean_dtype(self, dtype)
    x = _acc(self.astype(od))
    dims = _dims(dim, self.ndim)
    n = 1
    for d in dims:
        n *= self.shape[d]
    s = jnp.sum(x, axis=dims, keepdims=keepdim)
    return (s / jnp.asarray(n, s.dtype) if n else s * jnp.asarray(np.nan, s.dtype)).astype(od)


@register(aten.prod.default)
def prod_default(self, *, dtype=None):
    od = _sum_dtype(self, dtype)
    return jnp.prod(_acc(self.astype(od))).astype(od)


@register(aten.prod.dim_int)
def prod_dim(self, dim, keepdim=False, *, dtype=None):
    od = _sum_dtype(self, dtype)
    dims = _dims([dim], self.ndim)
    return jnp.prod(_acc(self.astype(od)), axis=dims, keepdims=keepdim).astype(od)


# ---------------------------------------------------------------- var / std

def _var_core(self, dim, correction, keepdim, name):
    if _is_intlike(self):
        raise RuntimeError("std and var only support floating point and complex dtypes")
    if correction is None:
        correction = 1
    dims = _dims(dim, self.ndim)
    x = _acc(self)
    n = 1
    for d in dims:
        n *= self.shape[d]
    if n:
        mean = jnp.sum(x, axis=dims, keepdims=True) / jnp.asarray(n, x.dtype)
    else:
        mean = jnp.sum(x, axis=dims, keepdims=True) * jnp.asarray(np.nan, x.dtype)
    d = x - mean
    sq = jnp.real(d * jnp.conj(d)) if _is_complex(d) else d * d
    s = jnp.sum(sq, axis=dims, keepdims=keepdim)
    denom = max(0, n - correction)
    var = s / jnp.asarray(denom, s.dtype)
    mean_out = mean if keepdim else jnp.squeeze(mean, dims) if dims else mean
    if self.ndim == 0:
        mean_out = mean.reshape(())
    return var, mean_out


@register(aten.var.correction)
def var_correction(self, dim=None, *, correction=None, keepdim=False):
    v, _ = _var_core(self, dim, correction, keepdim, "var")
    return v.astype(_real_dtype(self.dtype))


@register(aten.std.correction)
def std_correction(self, dim=None, *, correction=None, keepdim=False):
    v, _ = _var_core(self, dim, correction, keepdim, "std")
    return jnp.sqrt(v).astype(_real_dtype(self.dtype))


@register(aten.var_mean.correction)
def var_mean_correction(self, dim=None, *, correction=None, keepdim=False):
    v, m = _var_core(self, dim, correction, keepdim, "var_mean")
    return v.astype(_real_dtype(self.dtype)), m.astype(self.dtype)


@register(aten.std_mean.correction)
def std_mean_correction(self, dim=None, *, correction=None, keepdim=False):
    v, m = _var_core(self, dim, correction, keepdim, "std_mean")
    return jnp.sqrt(v).astype(_real_dtype(self.dtype)), m.astype(self.dtype)


# The legacy ``unbiased`` overloads (var.dim, std.default, ...) and nanmean, argsort,
# max.other / min.other are CompositeImplicitAutograd: they decompose before reaching the
# backend. Registering a PrivateUse1 kernel for them would replace that decomposition and
# silently drop autograd, so they are deliberately not in the table.


# ---------------------------------------------------------------- max / min family

def _check_not_complex(x, name):
    if _is_complex(x):
        raise RuntimeError(f"{name}(): does not support complex input")


@register(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    _check_not_complex(self, "amax")
    dims = _dims(dim, self.ndim)
    _numel_check(self, "amax", dims if dim else ())
    return jnp.max(self, axis=dims, keepdims=keepdim)


@register(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    _check_not_complex(self, "amin")
    dims = _dims(dim, self.ndim)
    _numel_check(self, "amin", dims if dim else ())
    return jnp.min(self, axis=dims, keepdims=keepdim)


@register(aten.max.default)
def max_default(self):
    _check_not_complex(self, "max")
    if self.size == 0:
        raise RuntimeError("max(): Expected reduction dim to be specified for input.numel() == 0. "
                           "Specify the reduction dim with the 'dim' argument.")
    return jnp.max(self)


@register(aten.min.default)
def min_default(self):
    _check_not_complex(self, "min")
    if self.size == 0:
        raise RuntimeError("min(): Expected reduction dim to be specified for input.numel() == 0. "
                           "Specify the reduction dim with the 'dim' argument.")
    return jnp.min(self)


def _not_impl(kernel, x):
    return NotImplementedError(f"\"{kernel}\" not implemented for '{_tname(x.dtype)}'")


def _arg_extreme(x, axis, largest):
    """First index of the max (min); NaN counts as the extreme (first NaN wins)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int8)
    return (jnp.argmax if largest else jnp.argmin)(x, axis=axis).astype(_I64)


def _minmax_dim(self, dim, keepdim, largest, name):
    _check_not_complex(self, name)
    d = canonical_dim(dim, self.ndim)
    if self.ndim == 0:
        return self, jnp.zeros((), _I64)
    if self.shape[d] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
    idx = _arg_extreme(self, d, largest)
    vals = jnp.take_along_axis(self, jnp.expand_dims(idx, d), axis=d)
    if not keepdim:
        vals = jnp.squeeze(vals, d)
    else:
        idx = jnp.expand_dims(idx, d)
    return vals, idx


@register(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _minmax_dim(self, dim, keepdim, True, "max")


@register(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _minmax_dim(self, dim, keepdim, False, "min")


@register(aten.aminmax.default)
def aminmax(self, *, dim=None, keepdim=False):
    _check_not_complex(self, "aminmax")
    if dim is None:
        if self.size == 0:
            raise RuntimeError("aminmax(): cannot compute aminmax over an empty dimension as the "
                               "operation has no identity.")
        lo, hi = jnp.min(self), jnp.max(self)
        if keepdim:
            shp = (1,) * self.ndim
            lo, hi = lo.reshape(shp), hi.reshape(shp)
        return lo, hi
    d = canonical_dim(dim, self.ndim)
    if self.ndim and self.shape[d] == 0:
        raise IndexError(f"aminmax(): Expected reduction dim {d} to have non-zero size.")
    axes = (d,) if self.ndim else ()
    return (jnp.min(self, axis=axes, keepdims=keepdim), jnp.max(self, axis=axes, keepdims=keepdim))


def _argminmax(self, dim, keepdim, largest, name):
    _check_not_complex(self, name)
    if self.dtype == jnp.bool_:
        raise RuntimeError(f"{name}(): does not support bool input")
    if dim is None:
        if self.size == 0:
            raise IndexError(f"{name}(): Expected reduction dim to be specified for "
                             "input.numel() == 0.")
        r = _arg_extreme(self.reshape(-1), 0, largest)
        return r.reshape((1,) * self.ndim) if keepdim else r
    d = canonical_dim(dim, self.ndim)
    if self.ndim == 0:
        return jnp.zeros((), _I64)
    if self.shape[d] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
    r = _arg_extreme(self, d, largest)
    return jnp.expand_dims(r, d) if keepdim else r


@register(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _argminmax(self, dim, keepdim, True, "argmax")


@register(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _argminmax(self, dim, keepdim, False, "argmin")


# ---------------------------------------------------------------- all / any

def _bool_out(x, r):
    return r.astype(jnp.uint8) if x.dtype == jnp.uint8 else r


def _truthy(x):
    return x if x.dtype == jnp.bool_ else (x != 0)


@register(aten.all.default)
def all_default(self):
    return _bool_out(self, jnp.all(_truthy(self)))


@register(aten.any.default)
def any_default(self):
    return _bool_out(self, jnp.any(_truthy(self)))


@register(aten.all.dim)
def all_dim(self, dim, keepdim=False):
    return _bool_out(self, jnp.all(_truthy(self), axis=_dims([dim], self.ndim), keepdims=keepdim))


@register(aten.any.dim)
def any_dim(self, dim, keepdim=False):
    return _bool_out(self, jnp.any(_truthy(self), axis=_dims([dim], self.ndim), keepdims=keepdim))


@register(aten.all.dims)
def all_dims(self, dim=None, keepdim=False):
    dims = _dims(dim, self.ndim, empty_means_all=False)
    return _bool_out(self, jnp.all(_truthy(self), axis=dims, keepdims=keepdim))


@register(aten.any.dims)
def any_dims(self, dim=None, keepdim=False):
    dims = _dims(dim, self.ndim, empty_means_all=False)
    return _bool_out(self, jnp.any(_truthy(self), axis=dims, keepdims=keepdim))


@register(aten.count_nonzero.default)
def count_nonzero(self, dim=None):
    dims = _dims(dim, self.ndim)
    return jnp.sum(_truthy(self), axis=dims, dtype=_I64)


@register(aten.count_nonzero.dim_IntList)
def count_nonzero_dims(self, dim):
    dims = _dims(dim, self.ndim)
    return jnp.sum(_truthy(self), axis=dims, dtype=_I64)


# ---------------------------------------------------------------- logsumexp / norms

def _float_in(x):
    """Integer inputs compute in the default float dtype (PyTorch's int -> float promotion)."""
    if _is_intlike(x):
        return x.astype(to_jax(torch.get_default_dtype()))
    return x


@register(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    x = _float_in(self)
    od = x.dtype
    x = _acc(x)
    dims = _dims(dim, self.ndim)
    if self.size == 0:
        return jnp.log(jnp.sum(jnp.exp(x), axis=dims, keepdims=keepdim)).astype(od)
    m = jnp.max(jnp.real(x) if _is_complex(x) else x, axis=dims, keepdims=True)
    m = jnp.where(jnp.isinf(m), jnp.zeros((), m.dtype), m)
    m = lax.stop_gradient(m)
    s = jnp.sum(jnp.exp(x - m), axis=dims, keepdims=True)
    r = jnp.log(s) + m
    if not keepdim:
        r = jnp.squeeze(r, dims) if dims else r
    if self.ndim == 0:
        r = r.reshape(())
    return r.astype(od)


def _vector_norm(x, ord, dims, keepdim, name="linalg.vector_norm"):
    if _is_intlike(x):
        raise RuntimeError(f"{name}: Expected a floating point or complex tensor as input. "
                           f"Got {_tname(x.dtype)}")
    od = _real_dtype(x.dtype)
    a = jnp.abs(_acc(x)) if not _is_complex(x) else jnp.abs(x)
    a = _acc(a)
    ord = float(ord)
    if x.size == 0 and ord < 0 or (x.size == 0 and math.isinf(ord)):
        zero_dims = [d for d in dims if x.shape[d] == 0] if x.ndim else []
        if zero_dims or not dims:
            raise RuntimeError(
                f"{name} cannot compute the {ord:g} norm on an empty tensor because the "
                "operation does not have an identity" if not math.isinf(ord) else
                f"{name} cannot compute the {'inf' if ord > 0 else '-inf'} norm on an empty "
                "tensor because the operation does not have an identity")
    if ord == math.inf:
        r = jnp.max(a, axis=dims, keepdims=keepdim)
    elif ord == -math.inf:
        r = jnp.min(a, axis=dims, keepdims=keepdim)
    elif ord == 0:
        r = jnp.sum((a != 0).astype(a.dtype), axis=dims, keepdims=keepdim)
    elif ord == 1:
        r = jnp.sum(a, axis=dims, keepdims=keepdim)
    elif ord == 2:
        r = jnp.sqrt(jnp.sum(a * a, axis=dims, keepdims=keepdim))
    else:
        r = jnp.power(jnp.sum(jnp.power(a, ord), axis=dims, keepdims=keepdim), 1.0 / ord)
    return r.astype(od)


@register(aten.linalg_vector_norm.default)
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = self
    if dtype is not None:
        x = x.astype(to_jax(dtype))
    return _vector_norm(x, ord, _dims(dim, self.ndim), keepdim)


@register(aten.norm.Scalar)
def norm_scalar(self, p=2):
    return _vector_norm(self, 2 if p is None else p, _dims(None, self.ndim), False, "norm")


@register(aten.norm.ScalarOpt_dim)
def norm_dim(self, p, dim, keepdim=False):
    return _vector_norm(self, 2 if p is None else p, _dims(dim, self.ndim), keepdim, "norm")


@register(aten.norm.ScalarOpt_dim_dtype)
def norm_dim_dtype(self, p, dim, keepdim, *, dtype):
    return _vector_norm(self.astype(to_jax(dtype)), 2 if p is None else p,
                        _dims(dim, self.ndim), keepdim, "norm")


@register(aten.norm.ScalarOpt_dtype)
def norm_dtype(self, p, *, dtype):
    return _vector_norm(self.astype(to_jax(dtype)), 2 if p is None else p,
                        _dims(None, self.ndim), False, "norm")


@register(aten.dist.default)
def dist(self, other, p=2):
    from ._util import result_type

    dt = to_jax(result_type(self, other))
    d = self.astype(dt) - other.astype(dt)
    return _vector_norm(d, p, _dims(None, d.ndim), False, "dist")


@register(aten.renorm.default)
def renorm(self, p, dim, maxnorm):
    if _is_intlike(self):
        raise RuntimeError("renorm: expected a floating point or complex tensor as input")
    d = canonical_dim(dim, self.ndim)
    dims = tuple(i for i in range(self.ndim) if i != d)
    norm = _vector_norm(self, p, dims, True).astype(_acc(jnp.zeros((), _real_dtype(self.dtype))).dtype)
    factor = jnp.where(norm > maxnorm, maxnorm / (norm + 1e-7), jnp.ones((), norm.dtype))
    return (_acc(self) * factor).astype(self.dtype)


# ---------------------------------------------------------------- scans

def _scan_prep(self, dim, dtype, name):
    if dtype == torch.bool:  # PyTorch's scan kernels have no bool instance
        raise NotImplementedError(f"\"{name}_out_cpu\" not implemented for 'Bool'")
    return canonical_dim(dim, self.ndim), _sum_dtype(self, dtype)


@register(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    d, od = _scan_prep(self, dim, dtype, "cumsum")
    x = self.astype(od)
    if self.ndim == 0:
        return x
    return jnp.cumsum(_acc(x), axis=d).astype(od)


@register(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    d, od = _scan_prep(self, dim, dtype, "cumprod")
    x = self.astype(od)
    if self.ndim == 0:
        return x
    return jnp.cumprod(_acc(x), axis=d).astype(od)


def _cum_extreme(self, dim, largest):
    d = canonical_dim(dim, self.ndim)
    if self.ndim == 0:
        return self, jnp.zeros((), _I64)
    if self.shape[d] == 0:
        return self, jnp.zeros(self.shape, _I64)
    idx = lax.broadcasted_iota(_I64, self.shape, d)
    isf = _is_float(self)

    def combine(a, b):
        av, ai = a
        bv, bi = b
        if isf:
            a_nan, b_nan = jnp.isnan(av), jnp.isnan(bv)
            better = (bv >= av) if largest else (bv <= av)
            take_b = b_nan | (~a_nan & better)
        else:
            x, y = (av, bv) if av.dtype != jnp.bool_ else (av.astype(jnp.int8), bv.astype(jnp.int8))
            take_b = (y >= x) if largest else (y <= x)
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    v, i = lax.associative_scan(combine, (self, idx), axis=d)
    return v, i


@register(aten.cummax.default)
def cummax(self, dim):
    return _cum_extreme(self, dim, True)


@register(aten.cummin.default)
def cummin(self, dim):
    return _cum_extreme(self, dim, False)


def _logaddexp_c(a, b):
    ra, rb = jnp.real(a), jnp.real(b)
    m = jnp.where(ra >= rb, a, b)
    o = jnp.where(ra >= rb, b, a)
    inf = jnp.isinf(jnp.real(m)) & (jnp.real(m) < 0)
    return jnp.where(inf, m, m + jnp.log1p(jnp.exp(o - m)))


@register(aten.logcumsumexp.default, aten._logcumsumexp.default)
def logcumsumexp(self, dim):
    d = canonical_dim(dim, self.ndim)
    if _is_intlike(self):
        raise _not_impl("logcumsumexp_out_cpu", self)
    x = self
    od = x.dtype
    if self.ndim == 0 or self.shape[d] == 0:
        return x
    x = _acc(x)
    if _is_complex(x):
        r = lax.associative_scan(_logaddexp_c, x, axis=d)
    else:
        r = lax.cumlogsumexp(x, axis=d)
    return r.astype(od)


# ---------------------------------------------------------------- sort family

def _sort_key(x):
    """Key whose order is PyTorch's: -0.0 == 0.0, every NaN above +inf."""
    if _is_float(x):
        x = jnp.where(x == 0, jnp.zeros((), x.dtype), x)
        x = jnp.where(jnp.isnan(x), jnp.asarray(np.nan, x.dtype), x)
    return x


def _sort_last(x, descending):
    """Stable sort along the last axis: (values, int64 indices)."""
    idx = lax.broadcasted_iota(_I64, x.shape, x.ndim - 1)
    key = _sort_key(x)
    if descending:
        key = jnp.flip(key, -1)
        idx = jnp.flip(idx, -1)
    _, si = lax.sort((key, idx), dimension=x.ndim - 1, is_stable=True, num_keys=1)
    if descending:
        si = jnp.flip(si, -1)
    return jnp.take_along_axis(x, si, axis=-1), si


def _sort(self, dim, descending):
    if _is_complex(self):
        raise RuntimeError("sort(): input tensor must be of non-complex type")
    d = canonical_dim(dim, self.ndim)
    if self.ndim == 0:
        return self, jnp.zeros((), _I64)
    x = _to_axis_last(self, d)
    v, i = _sort_last(x, descending)
    return _from_axis_last(v, d), _from_axis_last(i, d)


@register(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return _sort(self, dim, descending)


@register(aten.sort.stable)
def sort_stable(self, *, stable, dim=-1, descending=False):
    return _sort(self, dim, descending)


@register(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.dtype == jnp.bool_:
        raise RuntimeError("topk does not support bool dtypes on CPU")
    d = canonical_dim(dim, self.ndim)
    size = self.shape[d] if self.ndim else 1
    if not 0 <= k <= size:
        raise RuntimeError("selected index k out of range")
    if self.ndim == 0:
        return self, jnp.zeros((), _I64)
    chunk = _topk_chunk(size, k)
    if chunk:
        x = _to_axis_last(self, d)
        v, i = _topk_by_chunks(x, k, largest, chunk)
        return _from_axis_last(v, d), _from_axis_last(i, d)
    v, i = _sort(self, d, largest)
    return lax.slice_in_dim(v, 0, k, axis=d), lax.slice_in_dim(i, 0, k, axis=d)


def _topk_chunk(n, k):
    """The chunk length of ``_topk_by_chunks`` for k of n (a power of two near sqrt(n / k)), or
    0 where sorting the whole axis costs little more (short axes, k near n)."""
    if n < (1 << 16) or k == 0:
        return 0
    c = 1 << max(8, round(math.log2(max(n / k, 1)) / 2))
    return c if 8 * k * c <= n else 0


def _order_key(x):
    """An integer with the order of ``_sort_key(x)`` (every NaN above +inf, -0.0 == 0.0), for a
    plain max/min reduction: a float's bits, the magnitude bits flipped where negative."""
    if not _is_float(x):
        return x
    bits = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(x.dtype).itemsize]
    b = lax.bitcast_convert_type(_sort_key(x), bits)
    return b ^ ((b >> (8 * jnp.dtype(bits).itemsize - 1)) & jnp.iinfo(bits).max)


def _topk_by_chunks(x, k, largest, c):
    """topk along the last axis in about one pass over ``x``: the axis in chunks of ``c``, each
    chunk's extreme (one plain reduction), the k chunks with the best extremes (ties: the lower
    chunk), then a stable sort of only those chunks' elements plus the tail. Every element of
    the top k lies in those chunks: each chunk left out ranks behind k chosen chunks, whose
    extremes all rank ahead of its elements (sorting the whole axis for k = 5 of 2**26 int8
    took ~2 minutes; 2**31 did not finish in 400 s)."""
    n = x.shape[-1]
    m = n // c
    lead = x.shape[:-1]
    body = x[..., :m * c].reshape(lead + (m, c))
    key = _order_key(body)
    ext = jnp.max(key, -1) if largest else jnp.min(key, -1)
    _, best = _sort_last(ext, largest)
    best = jnp.sort(best[..., :k], axis=-1)  # chosen chunks in index order: ties stay stable
    pos = (best[..., None] * c + jnp.arange(c, dtype=_I64)).reshape(lead + (k * c,))
    if m * c < n:
        tail = jnp.broadcast_to(jnp.arange(m * c, n, dtype=_I64), lead + (n - m * c,))
        pos = jnp.concatenate([pos, tail], -1)
    cand = jnp.take_along_axis(x, pos, axis=-1)
    v, i = _sort_last(cand, largest)
    return v[..., :k], jnp.take_along_axis(pos, i[..., :k], axis=-1)


@register(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    if self.dtype == jnp.bool_:
        raise _not_impl("kthvalue_cpu", self)
    d = canonical_dim(dim, self.ndim)
    size = self.shape[d] if self.ndim else 1
    if not 1 <= k <= size:
        raise IndexError(f"kthvalue(): selected number k out of range for dimension {d}")
    if self.ndim == 0:
        return self, jnp.zeros((), _I64)
    v, i = _sort(self, d, False)
    v = lax.index_in_dim(v, k - 1, axis=d, keepdims=keepdim)
    i = lax.index_in_dim(i, k - 1, axis=d, keepdims=keepdim)
    return v, i


def _median_last(x, ignore_nan):
    """Lower median along the last axis of x: (values, indices)."""
    n = x.shape[-1]
    v, i = _sort_last(x, False)
    if _is_float(x):
        nnan = jnp.sum(jnp.isnan(x), axis=-1, keepdims=True)
        if ignore_nan:
            m = n - nnan
            pos = jnp.where(m > 0, (m - 1) // 2, 0)
        else:
            pos = jnp.where(nnan > 0, n - nnan, (n - 1) // 2)
    else:
        pos = jnp.full(x.shape[:-1] + (1,), (n - 1) // 2, _I64)
    pos = pos.astype(_I64)
    return (jnp.take_along_axis(v, pos, axis=-1)[..., 0],
            jnp.take_along_axis(i, pos, axis=-1)[..., 0])


def _median_all(self, ignore_nan, name):
    if self.dtype == jnp.bool_:
        raise _not_impl("median_cpu", self)
    if self.size == 0:
        if _is_float(self):
            return jnp.asarray(np.nan, self.dtype)
        raise RuntimeError(f"{name}() input tensor cannot be empty")
    return _median_last(self.reshape(-1), ignore_nan)[0]


def _median_dim(self, dim, keepdim, ignore_nan, name):
    if self.dtype == jnp.bool_:
        raise _not_impl("median_out", self)
    d = canonical_dim(dim, self.ndim)
    if self.ndim == 0:
        return self, jnp.zeros((), _I64)
    if self.shape[d] == 0:
        raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
    v, i = _median_last(_to_axis_last(self, d), ignore_nan)
    if keepdim:
        v, i = jnp.expand_dims(v, d), jnp.expand_dims(i, d)
    return v, i


@register(aten.median.default)
def median(self):
    return _median_all(self, False, "median")


@register(aten.nanmedian.default)
def nanmedian(self):
    return _median_all(self, True, "nanmedian")


@register(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    return _median_dim(self, dim, keepdim, False, "median")


@register(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    return _median_dim(self, dim, keepdim, True, "nanmedian")


@register(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    d = canonical_dim(dim, self.ndim)
    if self.ndim == 0:
        return self, jnp.zeros((), _I64)
    if self.shape[d] == 0:
        raise IndexError(f"mode(): Expected reduction dim {d} to have non-zero size.")
    x = _to_axis_last(self, d)
    v, i = _sort_last(x, False)
    pos = lax.broadcasted_iota(_I64, v.shape, v.ndim - 1)
    same = jnp.concatenate([jnp.zeros(v.shape[:-1] + (1,), bool), v[..., 1:] == v[..., :-1]], -1)
    start = lax.cummax(jnp.where(same, jnp.zeros((), _I64), pos), axis=v.ndim - 1)
    count = pos - start + 1
    best = jnp.argmax(count, axis=-1, keepdims=True)
    val = jnp.take_along_axis(v, best, axis=-1)[..., 0]
    ind = jnp.take_along_axis(i, best, axis=-1)[..., 0]
    if keepdim:
        val, ind = jnp.expand_dims(val, d), jnp.expand_dims(ind, d)
    return val, ind


# ---------------------------------------------------------------- softmax

def _softmax_prep(self, dim, half_to_float, kernel):
    if _is_intlike(self):
        raise _not_impl(kernel, self)
    d = canonical_dim(dim, self.ndim)
    od = self.dtype
    if half_to_float:
        if self.dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
            raise RuntimeError("conversion is supported for Half type only")
        od = jnp.float32
    return d, od


@register(aten._softmax.default)
def _softmax(self, dim, half_to_float):
    d, od = _softmax_prep(self, dim, half_to_float, "softmax_lastdim_kernel_impl")
    if self.ndim == 0:
        return jnp.ones((), od)
    if self.size == 0:
        return self.astype(od)
    x = _acc(self)
    m = lax.stop_gradient(jnp.max(x, axis=d, keepdims=True))
    e = jnp.exp(x - m)
    return (e / jnp.sum(e, axis=d, keepdims=True)).astype(od)


@register(aten._log_softmax.default)
def _log_softmax(self, dim, half_to_float):
    d, od = _softmax_prep(self, dim, half_to_float, "log_softmax_lastdim_kernel_impl")
    if self.ndim == 0:
        return jnp.zeros((), od)
    if self.size == 0:
        return self.astype(od)
    x = _acc(self)
    m = lax.stop_gradient(jnp.max(x, axis=d, keepdims=True))
    s = x - m
    return (s - jnp.log(jnp.sum(jnp.exp(s), axis=d, keepdims=True))).astype(od)


@register(aten._softmax_backward_data.default)
def _softmax_backward_data(grad_output, output, dim, input_dtype):
    d = canonical_dim(dim, output.ndim)
    g, o = _acc(grad_output), _acc(output)
    if output.ndim == 0:
        return (g * 0).astype(to_jax(input_dtype))
    r = o * (g - jnp.sum(g * o, axis=d, keepdims=True))
    return r.astype(to_jax(input_dtype))


@register(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(grad_output, output, dim, input_dtype):
    d = canonical_dim(dim, output.ndim)
    g, o = _acc(grad_output), _acc(output)
    if output.ndim == 0:
        return (g * 0).astype(to_jax(input_dtype))
    r = g - jnp.exp(o) * jnp.sum(g, axis=d, keepdims=True)
    return r.astype(to_jax(input_dtype))


# ---------------------------------------------------------------- searchsorted / bucketize

def _bsearch(seq, vals, right, nan_last=False):
    """PyTorch's binary search, vectorised: seq [..., n] sorted; vals [..., m] (same leading).

    lower bound: first i with seq[i] >= v; upper bound: first i with seq[i] > v (comparisons
    written exactly as PyTorch's, so NaNs land where they land on CPU). ``nan_last``: NaNs in
    ``seq`` (sorted to its end) count as above every value, so the search stays monotone.
    """
    n = seq.shape[-1]
    lo = jnp.zeros(vals.shape, _I64)
    hi = jnp.full(vals.shape, n, _I64)
    steps = max(1, int(n).bit_length() + 1)
    for _ in range(steps):
        active = lo < hi
        mid = lo + ((hi - lo) >> 1)
        midc = jnp.clip(mid, 0, max(n - 1, 0))
        mv = jnp.take_along_axis(seq, midc, axis=-1) if n else jnp.zeros(vals.shape, seq.dtype)
        go_right = ~(mv > vals) if right else ~(mv >= vals)
        if nan_last:
            go_right = go_right & ~jnp.isnan(mv)
        lo = jnp.where(active & go_right, mid + 1, lo)
        hi = jnp.where(active & ~go_right, mid, hi)
    return lo


def _searchsorted(sorted_sequence, values, out_int32, right, side, sorter):
    if side is not None:
        if side not in ("left", "right"):
            raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but "
                               f"got {side}")
        if right and side == "left":
            raise RuntimeError("torch.searchsorted(): side and right can't be set to opposites, "
                               "got side of left while right was True")
        right = side == "right"
    seq = sorted_sequence
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter.astype(_I64), axis=-1)
    od = jnp.int32 if out_int32 else _I64
    from ._util import result_type

    ct = to_jax(result_type(seq, values)) if seq.dtype != values.dtype else seq.dtype
    seq = seq.astype(ct)
    values = values.astype(ct)
    if seq.ndim == 1:
        flat = values.reshape(1, -1)
        r = _bsearch(seq.reshape(1, -1), flat, right).reshape(values.shape)
    else:
        if seq.shape[:-1] != values.shape[:-1]:
            raise RuntimeError(
                "torch.searchsorted(): boundaries tensor should be 1 dimension or the first N-1 "
                "dimensions of boundaries tensor and input value tensor must match, but we got "
                f"boundaries tensor {list(seq.shape)} and input value tensor {list(values.shape)}")
        r = _bsearch(seq, values, right)
    return r.astype(od)


@register(aten.searchsorted.Tensor)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    return _searchsorted(sorted_sequence, self, out_int32, right, side, sorter)


@register(aten.searchsorted.Scalar)
def searchsorted_scalar(sorted_sequence, self, *, out_int32=False, right=False, side=None,
                        sorter=None):
    from ._util import result_type

    if sorted_sequence.ndim != 1:
        raise RuntimeError("torch.searchsorted(): input value can be a scalar only when "
                           "boundaries tensor dimension is 1, but we got boundaries tensor dim("
                           f"{sorted_sequence.ndim}) and input value's dim(0) numel(1)")
    v = jnp.asarray(self, to_jax(result_type(sorted_sequence, self)))
    return _searchsorted(sorted_sequence, v, out_int32, right, side, sorter)


@register(aten.bucketize.Tensor)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    if boundaries.ndim != 1:
        raise RuntimeError("boundaries tensor must be 1 dimension, but got dim("
                           f"{boundaries.ndim})")
    return _searchsorted(boundaries, self, out_int32, right, None, None)


@register(aten.bucketize.Scalar)
def bucketize_scalar(self, boundaries, *, out_int32=False, right=False):
    from ._util import result_type

    v = jnp.asarray(self, to_jax(result_type(boundaries, self)))
    return bucketize(v, boundaries, out_int32=out_int32, right=right)


# ---------------------------------------------------------------- isin

_ISIN_BRUTE_PAIRS = 1 << 20  # up to this many (element, test element) pairs: compare all


def _isin(elements, test_elements, invert):
    """PyTorch's isin: both sides promoted to their common dtype and compared with ``==`` (NaN
    is in nothing, -0 is in [0]). Small sizes compare every pair; larger ones sort the test
    elements and binary-search each element. One program, where PyTorch's decomposition ran
    ~10 ops (generate()'s stopping criteria call it every token)."""
    from ._util import result_type

    dt = result_type(elements, test_elements)
    if dt == torch.bool or dt.is_complex:
        raise RuntimeError(f"Unsupported input type encountered for isin(): "
                           f"{_tname(to_jax(dt))}")
    ct = to_jax(dt)
    e = jnp.asarray(elements).astype(ct)
    t = jnp.asarray(test_elements).astype(ct).reshape(-1)
    flat = e.reshape(-1)
    if t.size == 0:
        found = jnp.zeros(flat.shape, jnp.bool_)
    elif flat.size * t.size <= _ISIN_BRUTE_PAIRS:
        found = jnp.any(flat[:, None] == t[None, :], axis=1)
    else:
        srt = jnp.sort(t)
        i = _bsearch(srt[None, :], flat[None, :], False, nan_last=True)[0]
        found = jnp.take(srt, jnp.clip(i, 0, t.size - 1)) == flat
    found = found.reshape(e.shape)
    return ~found if invert else found


@register(aten.isin.Tensor_Tensor)
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    return _isin(elements, test_elements, invert)


@register(aten.isin.Tensor_Scalar)
def isin_tensor_scalar(elements, test_element, *, assume_unique=False, invert=False):
    return _isin(elements, test_element, invert)


@register(aten.isin.Scalar_Tensor)
def isin_scalar_tensor(element, test_elements, *, assume_unique=False, invert=False):
    return _isin(element, test_elements, invert)


# ---------------------------------------------------------------- histograms

@register(aten.histc.default)
def histc(self, bins=100, min=0, max=0):
    if self.dtype == jnp.bool_ or not (_is_float(self) or jnp.issubdtype(self.dtype, jnp.integer)):
        raise NotImplementedError(f"\"histogram_cpu\" not implemented for '{_tname(self.dtype)}'")
    if bins <= 0:
        raise RuntimeError(f"torch.histc(): bins must be > 0, but got {bins} for dimension 0")
    if min > max:
        raise RuntimeError("torch.histc(): max must be larger than min")
    if not _is_float(self):
        return _histc_integer(self, bins, min, max)
    od = self.dtype
    x = self.reshape(-1)
    ct = jnp.float64 if od == jnp.float64 else jnp.float32
    xc = x.astype(ct)
    lo = jnp.asarray(min, ct)
    hi = jnp.asarray(max, ct)
    if min == max:
        if x.size:
            fin = jnp.isfinite(xc)
            lo = jnp.min(jnp.where(fin, xc, jnp.inf)).astype(ct)
            hi = jnp.max(jnp.where(fin, xc, -jnp.inf)).astype(ct)
            lo = jnp.where(fin.any(), lo, jnp.zeros((), ct))
            hi = jnp.where(fin.any(), hi, jnp.zeros((), ct))
        else:
            lo = hi = jnp.zeros((), ct)
        eq = lo == hi
        lo = jnp.where(eq, lo - 1, lo)
        hi = jnp.where(eq, hi + 1, hi)
    # PyTorch rounds the edges through the input dtype (linspace in self's dtype)
    lo = lo.astype(od).astype(ct)
    hi = hi.astype(od).astype(ct)
    inside = (xc >= lo) & (xc <= hi)
    pos = jnp.floor((xc - lo) * bins / (hi - lo))
    pos = jnp.where(inside, pos, 0).astype(_I64)
    pos = jnp.where(pos >= bins, bins - 1, pos)
    pos = jnp.clip(pos, 0, bins - 1)
    out = jnp.zeros((bins,), ct).at[pos].add(inside.astype(ct))
    return out.astype(od)


def _histc_integer(self, bins, min, max):
    # CPU refuses integer inputs; CUDA counts them (transformers' MoE layers call histc on int32
    # expert ids off CPU): bounds and bin arithmetic in int64, bin = (x - lo) * bins // (hi - lo),
    # values outside [lo, hi] dropped, counts in the input's dtype (SummaryOps.cu)
    od = self.dtype
    x = self.reshape(-1).astype(_I64)
    lo = jnp.asarray(int(min), _I64)
    hi = jnp.asarray(int(max), _I64)
    if int(min) == int(max) and x.size:
        lo, hi = jnp.min(x), jnp.max(x)
    eq = lo == hi
    lo = jnp.where(eq, lo - 1, lo)
    hi = jnp.where(eq, hi + 1, hi)
    inside = (x >= lo) & (x <= hi)
    pos = jnp.where(inside, (x - lo) * bins // (hi - lo), 0)
    pos = jnp.clip(pos, 0, bins - 1)
    return jnp.zeros((bins,), _I64).at[pos].add(inside.astype(_I64)).astype(od)


def _bincount_concrete(self, weights=None, minlength=0):
    if self.ndim != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if not jnp.issubdtype(self.dtype, jnp.integer):
        raise NotImplementedError(f"\"bincount_cpu\" not implemented for '{_tname(self.dtype)}'")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if weights is not None and weights.shape != self.shape:
        raise RuntimeError("weights should be 1-d and have the same length as input")
    host = np.asarray(self)
    if host.size and host.min() < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    length = builtins_max(int(host.max()) + 1 if host.size else 0, minlength)
    if weights is None:
        return jnp.zeros((length,), _I64).at[self].add(1)
    wd = weights.dtype if weights.dtype in (np.dtype(jnp.float32),) else jnp.float64
    if weights.dtype == jnp.float64:
        wd = jnp.float64
    return jnp.zeros((length,), wd).at[self].add(weights.astype(wd))


builtins_max = max


@register(aten.bincount.default, dynamic_shape=True)
def bincount(self, weights=None, minlength=0):
    return _bincount_concrete(self, weights, minlength)


def _histogram_counts(x, edges, weight, density):
    """Counts (or weight sums) of flat ``x`` in the bins ``edges`` (PyTorch's histogram: bin
    i holds edges[i] <= v < edges[i+1], the last bin is closed; NaN and outside values skip)."""
    nb = edges.shape[0] - 1
    inside = (x >= edges[0]) & (x <= edges[-1])
    pos = _bsearch(edges.reshape(1, -1), x.reshape(1, -1), True).reshape(x.shape) - 1
    pos = jnp.clip(jnp.where(pos >= nb, nb - 1, pos), 0, max(nb - 1, 0))
    w = jnp.ones(x.shape, x.dtype) if weight is None else weight.reshape(-1).astype(x.dtype)
    w = jnp.where(inside, w, jnp.zeros((), x.dtype))
    hist = jnp.zeros((nb,), x.dtype).at[pos].add(w)
    if density:
        widths = edges[1:] - edges[:-1]
        hist = hist / (jnp.sum(hist) * widths)
    return hist


def _linspace(start, end, steps, dt):
    """torch.linspace's CPU formula (first half from start, second half from end)."""
    start = jnp.asarray(start, dt)
    end = jnp.asarray(end, dt)
    if steps == 1:
        return start.reshape(1)
    step = (end - start) / jnp.asarray(steps - 1, dt)
    i = jnp.arange(steps)
    lo = start + step * i.astype(dt)
    hi = end - step * (steps - 1 - i).astype(dt)
    return jnp.where(i < steps // 2, lo, hi)


@register(aten.histogram.bin_ct)
def histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    if not _is_float(self):
        raise RuntimeError(f"torch.histogram: input tensor and bins tensors should have the "
                           f"same dtype, but got input {jdtype(self)}")
    if bins <= 0:
        raise RuntimeError(f"torch.histogramdd(): bins must be > 0, but got {bins} for "
                           "dimension 0")
    dt = self.dtype
    x = self.reshape(-1)
    if range is not None:
        lo, hi = float(range[0]), float(range[1])
        if lo > hi:
            raise ValueError(f"histogramdd(): for dimension 0, the range's min ({lo}) must not "
                             f"exceed its max ({hi})")
        lo = jnp.asarray(lo, jnp.float64)
        hi = jnp.asarray(hi, jnp.float64)
    elif x.size:
        # NaN data without a range is an error on CPU (it needs a sync); here edges go NaN
        lo = jnp.min(x).astype(jnp.float64)
        hi = jnp.max(x).astype(jnp.float64)
    else:  # empty input, no range: [0, 1] like NumPy
        lo, hi = jnp.zeros((), jnp.float64), jnp.ones((), jnp.float64)
    eq = lo == hi
    lo = jnp.where(eq, lo - 0.5, lo)
    hi = jnp.where(eq, hi + 0.5, hi)
    edges = _linspace(lo.astype(dt), hi.astype(dt), bins + 1, dt)
    return _histogram_counts(x, edges, weight, density), edges


@register(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    if bins.ndim != 1:
        raise RuntimeError("torch.histogramdd(): bins tensor should have one dimension")
    return _histogram_counts(self.reshape(-1), bins.astype(self.dtype), weight, density), bins


_CDIST_CHUNK = 1 << 22  # pair-difference elements materialised at once


def _over_rows(fn, rows, n_pair_elems):
    """Apply ``fn`` to each row (leading axis) of the arrays in ``rows``: vectorised when the
    [rows, ..., r2, m] pair differences fit in _CDIST_CHUNK elements, else in chunks."""
    n = rows[0].shape[0]
    per_row = max(1, n_pair_elems // max(n, 1))
    if n_pair_elems <= _CDIST_CHUNK or n <= 1:
        return jax.vmap(fn)(*rows)
    return lax.map(lambda r: fn(*r), tuple(rows), batch_size=max(1, _CDIST_CHUNK // per_row))


def _cdist_reduce(a, p):
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype), -1)
    if p == 1:
        return jnp.sum(a, -1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, -1))
    if math.isinf(p):
        return jnp.max(a, -1) if a.shape[-1] else jnp.zeros(a.shape[:-1], a.dtype)
    return jnp.power(jnp.sum(jnp.power(a, p), -1), 1.0 / p)


@register(aten._cdist_forward.default)
def _cdist_forward(x1, x2, p, compute_mode):
    if p < 0:
        raise RuntimeError("cdist only supports non-negative p values")
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(_acc(x1), batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(_acc(x2), batch + x2.shape[-2:])
    r1, r2, m = x1.shape[-2], x2.shape[-2], x1.shape[-1]
    if r1 == 0 or r2 == 0:
        return jnp.zeros(batch + (r1, r2), x1.dtype).astype(x1.dtype)

    def row(x1r):  # [*batch, m] -> [*batch, r2]
        return _cdist_reduce(jnp.abs(x1r[..., None, :] - x2), p)

    n = int(np.prod(batch, dtype=np.int64)) * r1 * r2 * m
    out = _over_rows(row, [jnp.moveaxis(x1, -2, 0)], n)  # [r1, *batch, r2]
    return jnp.moveaxis(out, 0, -2).astype(x1.dtype)


def _cdist_grad_terms(diff, g, d, p):
    zero = jnp.zeros((), diff.dtype)
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return g * jnp.sign(diff)
    if p == 2:
        return jnp.where(d == 0, zero, g * diff / jnp.where(d == 0, 1, d))
    if math.isinf(p):
        return g * jnp.sign(diff) * (jnp.abs(diff) == d).astype(diff.dtype)
    safe_d = jnp.where(d == 0, 1, d)
    if p < 2:
        bad = (d == 0) | ((diff == 0) & (p < 1))
        return jnp.where(bad, zero, jnp.sign(diff) * jnp.power(jnp.abs(diff), p - 1) * g
                         / jnp.power(safe_d, p - 1))
    return jnp.where(d == 0, zero, diff * jnp.power(jnp.abs(diff), p - 2) * g
                     / jnp.power(safe_d, p - 1))


@register(aten._cdist_backward.default)
def _cdist_backward(grad, x1, x2, p, cdist):
    """PyTorch's per-pair gradient formulas (zero where the distance is zero)."""
    batch = cdist.shape[:-2]
    x1b = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2b = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    r1, r2, m = x1b.shape[-2], x2b.shape[-2], x1b.shape[-1]
    if r1 == 0 or r2 == 0 or m == 0:
        r = jnp.zeros(batch + (r1, m), x1.dtype)
    else:
        def row(x1r, gr, dr):  # [*batch, m], [*batch, r2], [*batch, r2] -> [*batch, m]
            diff = x1r[..., None, :] - x2b
            return jnp.sum(_cdist_grad_terms(diff, gr[..., None], dr[..., None], p), axis=-2)

        n = int(np.prod(batch, dtype=np.int64)) * r1 * r2 * m
        r = _over_rows(row, [jnp.moveaxis(x1b, -2, 0), jnp.moveaxis(grad, -2, 0),
                             jnp.moveaxis(cdist, -2, 0)], n)
        r = jnp.moveaxis(r, 0, -2)
    # reduce broadcast batch dims back to x1's shape
    extra = r.ndim - x1.ndim
    if extra:
        r = jnp.sum(r, axis=tuple(range(extra)))
    for i, (s_in, s_out) in enumerate(zip(x1.shape[:-2], r.shape[:-2])):
        if s_in == 1 and s_out != 1:
            r = jnp.sum(r, axis=i, keepdims=True)
    return r.astype(x1.dtype)


# pdist: the condensed upper triangle (i < j, row-major) of cdist(x, x); the backward scatters
# the pair gradients into a symmetric matrix and reuses cdist's: every per-pair term is odd in
# the difference, so row j's term -f(x_i - x_j) is f(x_j - x_i) exactly.

def _pdist_check(self, p):
    if self.ndim != 2:
        raise RuntimeError(f"pdist only supports 2D tensors, got: {self.ndim}D")
    if p < 0:
        raise RuntimeError("pdist only supports non-negative p values")


@register(aten._pdist_forward.default)
def _pdist_forward(self, p=2.0):
    _pdist_check(self, p)
    n = self.shape[0]
    i, j = np.triu_indices(n, 1)
    if i.size == 0:
        return jnp.zeros((0,), self.dtype)
    return _cdist_forward(self, self, p, 0)[i, j]


@register(aten._pdist_backward.default)
def _pdist_backward(grad, self, p, pdist):
    _pdist_check(self, p)
    n = self.shape[0]
    i, j = np.triu_indices(n, 1)
    if i.size == 0 or self.shape[1] == 0:
        return jnp.zeros_like(self)
    g = jnp.zeros((n, n), grad.dtype).at[i, j].set(grad).at[j, i].set(grad)
    d = jnp.zeros((n, n), pdist.dtype).at[i, j].set(pdist).at[j, i].set(pdist)
    return _cdist_backward(g, self, self, p, d)


# registry meta ``dtype_from_out`` (read by eager/kernels.py): an ``out=`` call without ``dtype``
# computes in the out tensor's dtype, as PyTorch's kernels do (``get_dtype_from_result``):
# ``torch.sum(x_float, 0, out=long_tensor)`` sums ``x.long()``, it does not refuse the cast
for _op in (aten.sum.default, aten.sum.dim_IntList, aten.nansum.default, aten.prod.default,
            aten.prod.dim_int, aten.cumsum.default, aten.cumprod.default):
    registry.LOWERINGS[_op].meta["dtype_from_out"] = True
