"""Grouped matrix multiplication for mixture-of-experts: ``aten._grouped_mm`` (what
TorchTitan's MoE calls) and the ragged dot behind ``torch.tpu.ops.ragged_dot``.

``_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None)`` in torch 2.13 (CPU's
kernel, ``ATen/native/GroupedMMUtils.h``, is a per-group ``mm`` loop; CUDA's is CUTLASS):
``offs`` holds int32 *cumulative ends* of the groups along the one ragged dimension.

==========  ===============================  ==========================================
layout      shapes                           result
==========  ===============================  ==========================================
2d x 3d     a [m, k], b [g, k, n]            out[s:e] = a[s:e] @ b[i]          -> [m, n]
3d x 2d     a [g, m, k], b [k, n]            out[:, s:e] = a[i] @ b[:, s:e]    -> [m, n]
2d x 2d     a [m, k], b [k, n]               out[i] = a[:, s:e] @ b[s:e]       -> [g, m, n]
3d x 3d     a [g, m, k], b [g, k, n]         bmm, no offsets                   -> [g, m, n]
==========  ===============================  ==========================================

(``s:e`` = ``offs[i-1]:offs[i]``.) PyTorch's derivative formulas are ``_grouped_mm`` calls in
other layouts (2d x 3d differentiates into 2d x 3d and 2d x 2d), so lowering all four serves
forward and backward in every executor. Rows (columns) past ``offs[-1]`` are not written by
CPU's kernel (uninitialised memory); here they are zeros. ``offs`` past the grouped size are
clamped as CPU's slicing clamps them; decreasing offsets (CPU then computes overlapping or
missing groups) raise a RuntimeError at the next host sync (a device check, ``eager/checks.py``).
Half-precision products accumulate in float32 and round once per element, as CPU's ``mm``.

Two grouped products do all the work, each one program over every group:
- ``gmm``: rows of ``lhs`` [m, k] grouped, one ``rhs`` [k, n] per group (2d x 3d; 3d x 2d is
  its transpose);
- ``tgmm``: the contraction dim grouped, one output [m, n] per group (2d x 2d).
Which kernel computes them is chosen by the PJRT platform at trace time (``kernel_for``):
- TPU: the megablox ``gmm`` / ``tgmm`` Pallas kernels that JAX ships
  (``jax.experimental.pallas.ops.tpu.megablox``) for bfloat16 (and float32 when the matmul
  precision is below "highest"); true float32 products use XLA's ragged dot;
- GPU: ``jax.lax.ragged_dot_general`` (XLA's ragged-dot instruction);
- CPU and anything else: a tiled loop in plain JAX (``_gmm_tiled``/``_tgmm_tiled``): row tiles
  of one group each, ~(m + g * tile) * k * n multiply-adds. ``lax.ragged_dot`` on XLA:CPU
  lowers to JAX's dense expansion (every group's product over all m rows, masked: g times the
  work and a [g, m, k] copy), measured 10x slower at 8 experts (benchmarks/grouped_mm.py).
``kernel(name, interpret=True)`` forces a kernel at trace time: the tests run the megablox
path in Pallas interpret mode on CPU against the others.
"""
from __future__ import annotations

import contextlib
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..runtime import devices
from ._util import to_jax
from .linalg import _precision, _tname
from .registry import aten, matmul_precision, register

_LOW = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_MEGABLOX_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
KERNELS = ("megablox", "xla", "tiled")
_forced: list = []  # [(name, interpret)] while ``kernel(...)`` is active


@contextlib.contextmanager
def kernel(name: str, interpret: bool = False):
    """Force the grouped-matmul kernel for programs *traced* inside the block (tests: the
    megablox kernels in Pallas interpret mode on CPU). Programs already in a cache keep theirs:
    trace the lowering directly (``jax.jit``) under it."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    _forced.append((name, interpret))
    try:
        yield
    finally:
        _forced.pop()


def kernel_for(dtype) -> tuple[str, bool]:
    """(kernel, interpret) for a product of ``dtype`` inputs on this process's platform."""
    if _forced:
        name, interpret = _forced[-1]
        if name != "megablox" or np.dtype(dtype) in _MEGABLOX_DTYPES:
            return name, interpret
        return "tiled", False
    p = devices.platform()
    if p == "tpu":
        # megablox's float32 dot takes no precision argument (what Mosaic does with it is not
        # verified here): float32 at "highest" (CPU's true float32, the default) goes to
        # XLA's ragged dot, which honours the precision
        if np.dtype(dtype) == np.dtype(jnp.bfloat16) or (
                np.dtype(dtype) == np.dtype(jnp.float32) and matmul_precision() != "highest"):
            return "megablox", False
        return "xla", False
    if p == "gpu":
        return "xla", False
    return "tiled", False


def _acc_dtype(dtype):
    return jnp.float32 if np.dtype(dtype) in _LOW else dtype


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile(size: int, groups: int) -> int:
    """Tile length along the grouped dim for the tiled kernels: a power of two in [8, 512]
    with about a quarter of ``size / groups`` rows, so the partial tiles at group boundaries
    (at most one per group, half a tile on average: ~1/8 more work) stay cheap while the loop
    stays short."""
    t = max(size // (4 * max(groups, 1)), 8)
    t = 1 << (t.bit_length() - 1)
    return int(min(t, 512))


def sizes_from_offsets(offs, total: int):
    """Group sizes from cumulative ends, clamped to ``[0, total]`` as CPU's slicing clamps."""
    ends = jnp.clip(offs.astype(jnp.int32), 0, total)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return jnp.maximum(ends - starts, 0)


def _clamp_sizes(sizes, total: int):
    """Sizes >= 0 whose running sum stays within ``total`` (trailing groups shrink)."""
    ends = jnp.clip(jnp.cumsum(jnp.maximum(sizes.astype(jnp.int32), 0)), 0, total)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


# ---------------------------------------------------------------- tiled kernels (plain JAX)

def _tiles(sizes, tm: int, count: int):
    """For up to ``count`` tiles of ``tm`` along a dim grouped by ``sizes``: each tile's group
    and start, and the number of real tiles (group i gets ceil(size_i / tm) of them, in order).
    A tile may run past its group's end (the caller masks or overwrites those positions)."""
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    ntiles = (sizes + tm - 1) // tm
    tile_end = jnp.cumsum(ntiles)
    t = jnp.arange(count, dtype=jnp.int32)
    gid = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), g - 1).astype(jnp.int32)
    first = tile_end[gid] - ntiles[gid]
    start = starts[gid] + (t - first) * tm
    return gid, start, tile_end[-1], ends


def _gmm_tiled(lhs, rhs, sizes, out_dtype, precision):
    m, k = lhs.shape
    g, _, n = rhs.shape
    tm = _tile(m, g)
    count = (m + g * (tm - 1)) // tm  # >= sum(ceil(size_i / tm)) for sizes summing to <= m
    gid, start, real, ends = _tiles(sizes, tm, count)
    # rows past the last group are zeroed, so a tile running past its group writes zeros or
    # values that the next group's tiles overwrite (tiles run in order); the loop runs over
    # the real tiles only (a dynamic trip count)
    rows = jnp.arange(m)
    x = jnp.where((rows < ends[-1])[:, None], lhs, jnp.zeros((), lhs.dtype))
    x = jnp.concatenate([x, jnp.zeros((tm, k), lhs.dtype)])
    acc = _acc_dtype(lhs.dtype)

    def body(i, out):
        r0 = start[i]
        xs = lax.dynamic_slice_in_dim(x, r0, tm)
        w = lax.dynamic_index_in_dim(rhs, gid[i], keepdims=False)
        y = jnp.dot(xs, w, precision=precision, preferred_element_type=acc).astype(out_dtype)
        return lax.dynamic_update_slice_in_dim(out, y, r0, 0)

    out = lax.fori_loop(0, real, body, jnp.zeros((m + tm, n), out_dtype))
    return out[:m]


def _tgmm_tiled(lhs, rhs, sizes, out_dtype, precision):
    m, kk = lhs.shape
    _, n = rhs.shape
    g = sizes.shape[0]
    tk = _tile(kk, g)
    count = (kk + g * (tk - 1)) // tk
    gid, start, real, ends = _tiles(sizes, tk, count)
    a = jnp.concatenate([lhs, jnp.zeros((m, tk), lhs.dtype)], axis=1)
    b = jnp.concatenate([rhs, jnp.zeros((tk, n), rhs.dtype)])
    acc = _acc_dtype(lhs.dtype)
    cols = jnp.arange(tk)

    def body(i, out):
        c0 = start[i]
        # the tile's positions that belong to its group
        keep = c0 + cols < ends[gid[i]]
        bs = lax.dynamic_slice_in_dim(b, c0, tk)
        bs = jnp.where(keep[:, None], bs, jnp.zeros((), bs.dtype))
        p = jnp.dot(lax.dynamic_slice_in_dim(a, c0, tk, axis=1), bs, precision=precision,
                    preferred_element_type=acc)
        cur = lax.dynamic_index_in_dim(out, gid[i], keepdims=False)
        return lax.dynamic_update_index_in_dim(out, cur + p, gid[i], 0)

    out = lax.fori_loop(0, real, body, jnp.zeros((g, m, n), acc))
    return out.astype(out_dtype)


# ---------------------------------------------------------------- XLA's ragged dot

_RAGGED_ROWS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_RAGGED_CONTRACTING = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1],
    rhs_group_dimensions=[])


def _gmm_xla(lhs, rhs, sizes, out_dtype, precision):
    acc = _acc_dtype(lhs.dtype)
    return lax.ragged_dot_general(lhs, rhs, sizes, _RAGGED_ROWS, precision=precision,
                                  preferred_element_type=acc).astype(out_dtype)


def _tgmm_xla(lhs, rhs, sizes, out_dtype, precision):
    acc = _acc_dtype(lhs.dtype)
    return lax.ragged_dot_general(lhs, rhs, sizes, _RAGGED_CONTRACTING, precision=precision,
                                  preferred_element_type=acc).astype(out_dtype)


# ---------------------------------------------------------------- megablox (TPU Pallas)

def _megablox():
    # the package re-exports the custom_vjp wrapper as ``gmm``, shadowing the module that
    # holds the kernels (gmm and tgmm): import the module by name
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _round_up(x: int, m: int) -> int:
    return _cdiv(x, m) * m


def _lane_tile(size: int) -> int:
    # a block's last dim is a multiple of 128 or the whole dim (Mosaic's layout rule)
    return size if size <= 128 else 128


def _row_tile(size: int, dtype) -> int:
    sub = 16 if np.dtype(dtype) in _LOW else 8  # sublane packing
    return min(128, _round_up(max(size, 1), sub))


def _gmm_megablox(lhs, rhs, sizes, out_dtype, interpret):
    m, k = lhs.shape
    n = rhs.shape[2]
    tm = _row_tile(m, lhs.dtype)
    mp = _round_up(m, tm)
    x = jnp.pad(lhs, ((0, mp - m), (0, 0))) if mp != m else lhs
    with jax.enable_x64(False):  # see _tgmm_megablox
        out = _megablox().gmm(x, rhs, sizes, preferred_element_type=out_dtype,
                              tiling=(tm, _lane_tile(k), _lane_tile(n)), interpret=interpret)
    # the kernel leaves rows past the last group as it found them: zero them
    rows = jnp.arange(m)
    return jnp.where((rows < jnp.sum(sizes))[:, None], out[:m], jnp.zeros((), out.dtype))


def _tgmm_megablox(lhs, rhs, sizes, out_dtype, interpret):
    # megablox's tgmm: lhs [k, m] x rhs [m, n] with m grouped -> [g, k, n]; here
    # lhs [m, K] x rhs [K, n] with K grouped, the same layout under other names
    m, kk = lhs.shape
    n = rhs.shape[1]
    g = sizes.shape[0]
    tk = _row_tile(kk, lhs.dtype)
    kp = _round_up(kk, tk)
    if kp != kk:
        lhs = jnp.pad(lhs, ((0, 0), (0, kp - kk)))
        rhs = jnp.pad(rhs, ((0, kp - kk), (0, 0)))
    # traced with 32-bit defaults, as JAX's own tests run the kernels: under x64 (PyTorch
    # semantics, always on here) the interpreter fails on tgmm's int32 grid arithmetic
    # ("lax.sub requires arguments to have the same dtypes, got int64, int32")
    with jax.enable_x64(False):
        return _megablox().tgmm(lhs, rhs, sizes, preferred_element_type=out_dtype,
                                tiling=(tk, _lane_tile(m), _lane_tile(n)),
                                num_actual_groups=g, interpret=interpret)


# ---------------------------------------------------------------- the two grouped products

def gmm(lhs, rhs, sizes, out_dtype=None):
    """``out[rows of group i] = lhs[rows of group i] @ rhs[i]``: lhs [m, k], rhs [g, k, n],
    ``sizes`` [g] int32 (consecutive row groups from row 0; rows past them give zeros)."""
    out_dtype = out_dtype or lhs.dtype
    m, k = lhs.shape
    g, _, n = rhs.shape
    if m == 0 or g == 0 or k == 0:
        return jnp.zeros((m, n), out_dtype)
    sizes = _clamp_sizes(sizes, m)
    name, interpret = kernel_for(lhs.dtype)
    if name == "megablox":
        return _gmm_megablox(lhs, rhs, sizes, out_dtype, interpret)
    prec = _precision(lhs.dtype)
    if name == "xla":
        return _gmm_xla(lhs, rhs, sizes, out_dtype, prec)
    return _gmm_tiled(lhs, rhs, sizes, out_dtype, prec)


def tgmm(lhs, rhs, sizes, out_dtype=None):
    """``out[i] = lhs[:, group i] @ rhs[group i]``: lhs [m, K], rhs [K, n], ``sizes`` [g] over
    K (positions past the groups are ignored; an empty group gives zeros) -> [g, m, n]."""
    out_dtype = out_dtype or lhs.dtype
    m, kk = lhs.shape
    n = rhs.shape[1]
    g = sizes.shape[0]
    if g == 0 or m == 0 or n == 0 or kk == 0:
        return jnp.zeros((g, m, n), out_dtype)
    sizes = _clamp_sizes(sizes, kk)
    name, interpret = kernel_for(lhs.dtype)
    if name == "megablox":
        return _tgmm_megablox(lhs, rhs, sizes, out_dtype, interpret)
    prec = _precision(lhs.dtype)
    if name == "xla":
        return _tgmm_xla(lhs, rhs, sizes, out_dtype, prec)
    return _tgmm_tiled(lhs, rhs, sizes, out_dtype, prec)


# ---------------------------------------------------------------- aten._grouped_mm

_GMM_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
_SCALAR_TYPE = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
                torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
                torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def _check_grouped_mm(a, b, offs, bias, out_dtype):
    """CPU's argument checks (GroupedMMUtils.h), with its messages. Strides are not checked:
    CPU and CUDA ask for 16-byte aligned strides (a TMA constraint), any layout works here."""
    from ._util import to_torch

    ta, tb = to_torch(a.dtype), to_torch(b.dtype)
    for name, t in (("mat_a", ta), ("mat_b", tb)):
        if t not in _GMM_DTYPES:
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got "
                               f"{_SCALAR_TYPE.get(t, t)}")
    if a.ndim not in (2, 3):
        raise RuntimeError("mat_a has to be 2 or 3d")
    if b.ndim not in (2, 3):
        raise RuntimeError("mat_b has to be 2 or 3d")
    a2, b2 = a.ndim == 2, b.ndim == 2
    if (not a2 or not b2) and a.shape[-1] != b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if (offs is not None) != (a2 or b2):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if "
                           "both matrices are 3d")
    if offs is not None:
        if offs.ndim != 1:
            raise RuntimeError("offs has to be 1D")
        if np.dtype(offs.dtype) != np.dtype(jnp.int32):
            raise RuntimeError("Offsets have to be int32")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    if out_dtype is not None and out_dtype != ta:
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")
    if a2 != b2 and offs.shape[0] != (b.shape[0] if a2 else a.shape[0]):
        raise RuntimeError("matrix batch sizes have to match")
    if not a2 and not b2 and a.shape[0] != b.shape[0]:
        raise RuntimeError("batched dimension has to match")
    if ta != tb:  # CPU's per-group mm
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: "
                           f"{_tname(a.dtype)} != {_tname(b.dtype)}")


def _offsets_ok(a, b, offs=None, bias=None, out_dtype=None):
    if offs is None or offs.shape[0] == 0:
        return jnp.asarray(True)
    o = offs.astype(jnp.int32)
    return jnp.all(o[1:] >= o[:-1]) & (o[0] >= 0)


@register(aten._grouped_mm.default, reads_precision=True,
          check=(_offsets_ok, RuntimeError,
                 "_grouped_mm: offs must be non-negative and non-decreasing (cumulative ends "
                 "of the groups)"))
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    _check_grouped_mm(self, mat2, offs, bias, out_dtype)
    a, b = self, mat2
    if a.ndim == 3 and b.ndim == 3:
        acc = _acc_dtype(a.dtype)
        return jnp.matmul(a, b, precision=_precision(a.dtype),
                          preferred_element_type=acc).astype(a.dtype)
    if a.ndim == 2 and b.ndim == 3:
        return gmm(a, b, sizes_from_offsets(offs, a.shape[0]))
    if a.ndim == 3:  # out[:, s:e] = a[i] @ b[:, s:e]: the transpose of a 2d x 3d product
        sizes = sizes_from_offsets(offs, b.shape[1])
        return gmm(b.T, jnp.swapaxes(a, 1, 2), sizes).T
    return tgmm(a, b, sizes_from_offsets(offs, a.shape[1]))


# ---------------------------------------------------------------- torch.tpu.ops.ragged_dot

def ragged_dot(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """``jax.lax.ragged_dot``: lhs [m, k], rhs [g, k, n], group_sizes [g] -> [m, n]
    (the lowering of ``tpu::ragged_dot``, registered by ``torchtpu/ops/moe.py``)."""
    _check_ragged(lhs, rhs, group_sizes, "ragged_dot")
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise RuntimeError(f"ragged_dot: expected lhs [m, k] and rhs [g, k, n], got "
                           f"{list(lhs.shape)} and {list(rhs.shape)}")
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise RuntimeError(f"ragged_dot: shapes {list(lhs.shape)}, {list(rhs.shape)} and "
                           f"group_sizes {list(group_sizes.shape)} do not match (lhs [m, k], "
                           "rhs [g, k, n], group_sizes [g])")
    out = to_jax(preferred_element_type) if preferred_element_type is not None else lhs.dtype
    return gmm(lhs, rhs, group_sizes.astype(jnp.int32), out)


def ragged_dot_contract(lhs, rhs, group_sizes, *, out_dtype=None):
    """The ragged-contraction product: lhs [k, m], rhs [m, n], ``group_sizes`` [g] over m ->
    [g, k, n] (megablox's ``tgmm``; ``ragged_dot``'s weight gradient)."""
    _check_ragged(lhs, rhs, group_sizes, "ragged_dot_contract")
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[1] != rhs.shape[0]:
        raise RuntimeError(f"ragged_dot_contract: expected lhs [k, m] and rhs [m, n], got "
                           f"{list(lhs.shape)} and {list(rhs.shape)}")
    out = to_jax(out_dtype) if out_dtype is not None else lhs.dtype
    return tgmm(lhs, rhs, group_sizes.astype(jnp.int32), out)


def _check_ragged(lhs, rhs, group_sizes, name):
    if not (jnp.issubdtype(lhs.dtype, jnp.floating) and lhs.dtype == rhs.dtype):
        raise RuntimeError(f"{name}: expected lhs and rhs of one floating dtype, got "
                           f"{_tname(lhs.dtype)} and {_tname(rhs.dtype)}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise RuntimeError(f"{name}: group_sizes must be a 1-D integer tensor")


def ragged_sizes_ok(lhs, rhs, group_sizes, *args, ragged_dim=0, **kwargs):
    """Device check: group sizes non-negative, summing to at most the grouped size."""
    gs = group_sizes.astype(jnp.int64)
    return jnp.all(gs >= 0) & (jnp.sum(gs) <= lhs.shape[ragged_dim])
