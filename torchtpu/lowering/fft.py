"""FFT lowerings: the three primitives every torch.fft function reaches (_fft_r2c, _fft_c2r,
_fft_c2c), with PyTorch's normalization enum (0: none, 1: 1/sqrt(n), 2: 1/n, where n is the
product of the signal sizes along ``dim``) and onesided (half-spectrum) semantics.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from ._util import canonical_dim
from .registry import aten, register


_COMPLEX_OF = {np.dtype(jnp.float32): jnp.complex64, np.dtype(jnp.float64): jnp.complex128}
_REAL_OF = {np.dtype(jnp.complex64): jnp.float32, np.dtype(jnp.complex128): jnp.float64}


def _axes(dim, ndim):
    return tuple(canonical_dim(d, ndim) for d in dim)


def _scale(x, normalization, n):
    if normalization == 0 or n == 0:
        return x
    f = 1.0 / math.sqrt(n) if normalization == 1 else 1.0 / n
    return x * jnp.asarray(f, _REAL_OF.get(np.dtype(x.dtype), x.dtype))


def _check_real(x, name):
    if np.dtype(x.dtype) not in _COMPLEX_OF:
        raise RuntimeError(f"{name} expects a floating point input tensor, but got "
                           f"{x.dtype}" if not jnp.issubdtype(x.dtype, jnp.floating) else
                           f"Unsupported dtype {torch.float16 if x.dtype == jnp.float16 else torch.bfloat16}")


def _check_complex(x, name):
    if np.dtype(x.dtype) not in _REAL_OF:
        raise RuntimeError(f"{name} expects a complex input tensor, but got {x.dtype}")


@register(aten._fft_r2c.default)
def _fft_r2c(self, dim, normalization, onesided):
    _check_real(self, "r2c")
    axes = _axes(dim, self.ndim)
    n = 1
    for a in axes:
        n *= self.shape[a]
    x = self
    if not axes:
        return x.astype(_COMPLEX_OF[np.dtype(x.dtype)])
    if onesided:
        r = jnp.fft.rfftn(x, axes=axes)
    else:
        r = jnp.fft.fftn(x.astype(_COMPLEX_OF[np.dtype(x.dtype)]), axes=axes)
    return _scale(r.astype(_COMPLEX_OF[np.dtype(x.dtype)]), normalization, n)


@register(aten._fft_c2r.default)
def _fft_c2r(self, dim, normalization, last_dim_size):
    _check_complex(self, "c2r")
    axes = _axes(dim, self.ndim)
    if not axes:
        return jnp.real(self)
    sizes = [self.shape[a] for a in axes[:-1]] + [int(last_dim_size)]
    n = 1
    for s in sizes:
        n *= s
    r = jnp.fft.irfftn(self, s=sizes, axes=axes, norm="forward")
    return _scale(r.astype(_REAL_OF[np.dtype(self.dtype)]), normalization, n)


@register(aten._fft_c2c.default)
def _fft_c2c(self, dim, normalization, forward):
    _check_complex(self, "c2c")
    axes = _axes(dim, self.ndim)
    if not axes:
        return self
    n = 1
    for a in axes:
        n *= self.shape[a]
    if forward:
        r = jnp.fft.fftn(self, axes=axes)
    else:
        r = jnp.fft.ifftn(self, axes=axes, norm="forward")
    return _scale(r.astype(self.dtype), normalization, n)
