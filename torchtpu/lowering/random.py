"""Random ops on jax.random (registry flag ``random=True``: the lowering gets a key first).

Distributions, supports and dtypes follow PyTorch; the values do not match the CPU generator
bit for bit. Reproducibility comes from the device generator's (seed, offset) state, which the
executor turns into the key (eager/rng.py).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ._util import jdtype, real_dtype, to_jax
from ..runtime.dtypes import scalar_type_name as _tname
from .registry import aten, register


_LOW = (jnp.float16, jnp.bfloat16)


def _fdt(dt):
    """The float dtype random values are drawn in (float32 for half/bfloat16)."""
    return jnp.float32 if dt in _LOW else dt


def _check_float(self, name):
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise NotImplementedError(f'"{name}" not implemented for \'{_tname(jdtype(self))}\'')


def _uniform(key, shape, dt, lo=0.0, hi=1.0):
    return jax.random.uniform(key, shape, _fdt(dt), lo, hi)


# ---------------------------------------------------------------- in-place samplers

def _complex_parts(self, draw):
    """A complex tensor's sample, as PyTorch draws it: its real and imaginary parts
    (``view_as_real``) each drawn by ``draw`` from a real tensor of the parts' dtype."""
    parts = draw(jnp.zeros(self.shape + (2,), real_dtype(self.dtype)))
    return jax.lax.complex(parts[..., 0], parts[..., 1]).astype(self.dtype)


@register(aten.normal_.default, random=True)
def normal_(key, self, mean=0.0, std=1.0):
    if jnp.iscomplexobj(self):  # each part with half the variance (PyTorch's normal_impl_)
        return _complex_parts(self, lambda r: normal_(key, r, mean, std / math.sqrt(2)))
    _check_float(self, "normal_kernel_cpu")
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    z = jax.random.normal(key, self.shape, _fdt(self.dtype))
    return (z * std + mean).astype(self.dtype)


@register(aten.uniform_.default, random=True)
def uniform_(key, self, from_=0.0, to=1.0):
    if jnp.iscomplexobj(self):  # each part in [from, to) (PyTorch's uniform_impl_)
        return _complex_parts(self, lambda r: uniform_(key, r, from_, to))
    _check_float(self, "check_uniform_bounds")
    if from_ > to:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={from_} "
                           f"> to={to}")
    u = _uniform(key, self.shape, self.dtype, from_, to)
    out = u.astype(self.dtype)
    if self.dtype in _LOW:  # rounding may reach `to`: keep the half-open interval
        hi = jnp.asarray(to, self.dtype)
        out = jnp.where(out >= hi, jnp.nextafter(hi, jnp.asarray(from_, self.dtype)), out)
    return out


@register(aten.exponential_.default, random=True)
def exponential_(key, self, lambd=1.0):
    _check_float(self, "exponential_cpu")
    if not lambd > 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    e = jax.random.exponential(key, self.shape, _fdt(self.dtype)) / lambd
    return e.astype(self.dtype)


@register(aten.geometric_.default, random=True)
def geometric_(key, self, p):
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    dt = self.dtype
    u = jax.random.uniform(key, self.shape, jnp.float64, jnp.finfo(jnp.float64).tiny, 1.0)
    k = jnp.maximum(jnp.ceil(jnp.log(u) / math.log1p(-p)), 1.0)
    return k.astype(dt)


@register(aten.log_normal_.default, random=True)
def log_normal_(key, self, mean=1.0, std=2.0):
    _check_float(self, "log_normal_cpu")
    if not std > 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={std}")
    z = jax.random.normal(key, self.shape, _fdt(self.dtype))
    return jnp.exp(z * std + mean).astype(self.dtype)


@register(aten.cauchy_.default, random=True)
def cauchy_(key, self, median=0.0, sigma=1.0):
    _check_float(self, "cauchy_cpu")
    if not sigma > 0:
        raise RuntimeError(f"cauchy_ expects sigma > 0.0, but found sigma={sigma}")
    u = _uniform(key, self.shape, self.dtype)
    return (median + sigma * jnp.tan(math.pi * (u - 0.5))).astype(self.dtype)


@register(aten.bernoulli_.float, random=True)
def bernoulli_float_(key, self, p=0.5):
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    return (jax.random.uniform(key, self.shape, jnp.float64) < p).astype(self.dtype)


def _p_in_unit_ok(self, p=None, **_):
    """Data-dependent check (registry ``check``): probabilities in [0, 1], as CPU asserts."""
    p = self if p is None else p
    if not jnp.issubdtype(p.dtype, jnp.floating):
        return jnp.asarray(True)
    return jnp.all((p >= 0) & (p <= 1))


_P_IN_UNIT = (_p_in_unit_ok, RuntimeError,
              "Expected p_in >= 0 && p_in <= 1 to be true, but got false.")


@register(aten.bernoulli_.Tensor, random=True, check=_P_IN_UNIT)
def bernoulli_tensor_(key, self, p):
    pb = jnp.broadcast_to(p, self.shape)
    u = jax.random.uniform(key, self.shape, _fdt(pb.dtype) if jnp.issubdtype(pb.dtype, jnp.floating)
                           else jnp.float32)
    return (u < pb).astype(self.dtype)


# ---------------------------------------------------------------- random_ (integers)

def _digits(dt):
    """2**digits bounds random_() on floating dtypes (mantissa bits + 1), as PyTorch."""
    return {jnp.dtype(jnp.float16): 11, jnp.dtype(jnp.bfloat16): 8, jnp.dtype(jnp.float32): 24,
            jnp.dtype(jnp.float64): 53}[jnp.dtype(dt)]


def _randint(key, shape, lo, hi, dt):
    """Uniform integers in [lo, hi) (Python ints, hi - lo <= 2**64) cast to ``dt``."""
    span = hi - lo
    if span <= 0:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={lo} >= to={hi}")
    if span <= 2 ** 62 and -2 ** 62 <= lo and hi <= 2 ** 62:
        r = jax.random.randint(key, shape, lo, hi, jnp.int64)
    else:
        bits = jax.random.bits(key, shape, jnp.uint64)
        off = bits if span == 2 ** 64 else bits % np.uint64(span)
        r = (off + np.uint64(lo % 2 ** 64)).astype(jnp.int64)
    return r.astype(dt)


def _int_max(dt):
    if dt == jnp.bool_:
        return 1
    if jnp.issubdtype(dt, jnp.integer):
        return int(jnp.iinfo(dt).max)
    return 2 ** _digits(dt)


def _random_dtype_ok(self):
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise NotImplementedError(f'"random_kernel_cpu" not implemented for \'{_tname(self.dtype)}\'')


def _random_bounds_ok(self):
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        raise RuntimeError("check_random_bounds handles only integral, floating-point and boolean "
                           "types")


@register(aten.random_.default, random=True)
def random_(key, self):
    _random_dtype_ok(self)
    if jnp.issubdtype(self.dtype, jnp.floating) or self.dtype == jnp.bool_:
        return _randint(key, self.shape, 0, _int_max(self.dtype) + 1, self.dtype)
    return _randint(key, self.shape, 0, _int_max(self.dtype) + 1, self.dtype)


@register(aten.random_.to, random=True)
def random_to(key, self, to):
    _random_bounds_ok(self)
    return _randint(key, self.shape, 0, to, self.dtype)


@register(getattr(aten.random_, "from"), random=True)
def random_from(key, self, from_, to=None):
    _random_bounds_ok(self)
    if to is None:
        hi = _int_max(self.dtype) + 1
    else:
        hi = to
    return _randint(key, self.shape, from_, hi, self.dtype)


# ---------------------------------------------------------------- functional samplers

@register(aten.bernoulli.default, random=True, check=_P_IN_UNIT)
def bernoulli(key, self):
    u = jax.random.uniform(key, self.shape, _fdt(self.dtype))
    return (u < self).astype(self.dtype)


@register(aten.bernoulli.p, random=True)
def bernoulli_p(key, self, p):
    return bernoulli_float_(key, self, p)


@register(aten.bernoulli.Tensor, random=True, check=_P_IN_UNIT)
def bernoulli_t(key, self, p):
    return bernoulli_tensor_(key, self, p)


@register(aten.normal.Tensor_float, random=True)
def normal_tensor_float(key, mean, std=1.0):
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    z = jax.random.normal(key, mean.shape, _fdt(mean.dtype))
    return (z * std + mean).astype(mean.dtype)


@register(aten.normal.float_Tensor, random=True)
def normal_float_tensor(key, mean, std):
    z = jax.random.normal(key, std.shape, _fdt(std.dtype))
    return (z * std + mean).astype(std.dtype)


@register(aten.normal.Tensor_Tensor, random=True)
def normal_tensor_tensor(key, mean, std):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    dt = jnp.result_type(mean.dtype, std.dtype)
    z = jax.random.normal(key, shape, _fdt(dt))
    return (z * std + mean).astype(dt)


@register(aten.normal.float_float, random=True)
def normal_float_float(key, mean, std, size, *, dtype=None, layout=None, device=None,
                       pin_memory=None):
    dt = _fdtype(dtype)
    z = jax.random.normal(key, tuple(size), _fdt(dt))
    return (z * std + mean).astype(dt)


# ---------------------------------------------------------------- factories
# One op each, drawing exactly what eager's ``empty`` + in-place sampler draws from the same key,
# so a compiled graph's random factories (which aot_autograd would otherwise decompose to prims
# that run on the CPU) give the values eager gives.

def _fdtype(dtype, default=None):
    return to_jax(dtype if dtype is not None else (default or torch.get_default_dtype()))


def _like(self, dtype):
    return self.shape, (to_jax(dtype) if dtype is not None else self.dtype)


@register(aten.randn.default, aten.randn.generator, random=True)
def randn(key, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return normal_(key, jnp.zeros(tuple(size), _fdtype(dtype)))


@register(aten.rand.default, aten.rand.generator, random=True)
def rand(key, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return uniform_(key, jnp.zeros(tuple(size), _fdtype(dtype)))


@register(aten.randint.default, aten.randint.generator, random=True)
def randint(key, high, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return random_from(key, jnp.zeros(tuple(size), _fdtype(dtype, torch.int64)), 0, high)


@register(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(key, low, high, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return random_from(key, jnp.zeros(tuple(size), _fdtype(dtype, torch.int64)), low, high)


@register(aten.randn_like.default, random=True)
def randn_like(key, self, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    return normal_(key, jnp.zeros(*_like(self, dtype)))


@register(aten.rand_like.default, random=True)
def rand_like(key, self, *, dtype=None, layout=None, device=None, pin_memory=None,
              memory_format=None):
    return uniform_(key, jnp.zeros(*_like(self, dtype)))


@register(aten.randint_like.default, random=True)
def randint_like(key, self, high, *, dtype=None, layout=None, device=None, pin_memory=None,
                 memory_format=None):
    return random_from(key, jnp.zeros(*_like(self, dtype)), 0, high)


@register(aten.randint_like.low_dtype, random=True)
def randint_like_low(key, self, low, high, *, dtype=None, layout=None, device=None,
                     pin_memory=None, memory_format=None):
    return random_from(key, jnp.zeros(*_like(self, dtype)), low, high)


@register(torch.ops.prims.normal.default, random=True)
def prims_normal(key, shape, *, mean, std, dtype, device=None, requires_grad=False):
    return normal_(key, jnp.zeros(tuple(shape), to_jax(dtype)), mean, std)


@register(aten.randperm.default, random=True)
def randperm(key, n, *, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    dt = to_jax(dtype if dtype is not None else torch.int64)
    return jax.random.permutation(key, n).astype(dt)


def _multinomial_ok(self, num_samples, replacement=False, **_):
    """Data-dependent check: finite, non-negative probabilities with a positive sum per row."""
    if not jnp.issubdtype(self.dtype, jnp.floating):
        return jnp.asarray(True)
    p = self.astype(jnp.float32) if self.dtype in _LOW else self
    return jnp.all(jnp.isfinite(p) & (p >= 0)) & jnp.all(jnp.sum(p, axis=-1) > 0)


@register(aten.multinomial.default, random=True, check=(
    _multinomial_ok, RuntimeError, "probability tensor contains either `inf`, `nan` or "
    "element < 0, or invalid multinomial distribution (sum of probabilities <= 0)"))
def multinomial(key, self, num_samples, replacement=False):
    if self.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not jnp.issubdtype(self.dtype, jnp.floating):
        raise RuntimeError("multinomial only supports floating-point dtypes for input, got: "
                           f"{_tname(jdtype(self))}")
    n_cat = self.shape[-1]
    if not replacement and num_samples > n_cat:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    p = self.astype(jnp.float32) if self.dtype in _LOW else self
    p2 = p.reshape(-1, n_cat)
    logp = jnp.where(p2 > 0, jnp.log(jnp.where(p2 > 0, p2, 1)), -jnp.inf)
    if replacement:
        idx = jax.random.categorical(key, logp[:, None, :], axis=-1,
                                     shape=(p2.shape[0], num_samples))
    else:
        g = jax.random.gumbel(key, logp.shape, logp.dtype)
        _, idx = jax.lax.top_k(logp + g, num_samples)
    idx = idx.astype(jnp.int64)
    return idx.reshape(num_samples) if self.ndim == 1 else idx


@register(aten.native_dropout.default, random=True)
def native_dropout(key, input, p, train):
    if train is not None and not train:
        return input, jnp.ones(input.shape, jnp.bool_)
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    keep = jax.random.uniform(key, input.shape, jnp.float32) >= p if p < 1 else \
        jnp.zeros(input.shape, jnp.bool_)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    out = jnp.where(keep, input * jnp.asarray(scale, input.dtype), jnp.zeros((), input.dtype))
    return out, keep
