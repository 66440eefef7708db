"""Linear algebra lowerings: matmul family and LAPACK-style factorizations (PyTorch semantics).

Matmul precision: float32 products use ``lax.Precision.HIGHEST`` (true float32, matching CPU)
unless ``registry.matmul_precision()`` says otherwise (``torch.set_float32_matmul_precision``
"high"/"medium", or ``torch.tpu.precision``); those lowerings are registered with
``reads_precision``, so every cache is keyed by it. Half-precision inputs accumulate in float32.
Integer matmuls stay integer.

Factorizations return what PyTorch's kernels return, including LAPACK-style ``LU`` / 1-based
int32 ``pivots`` / int32 ``info`` (autograd formulas consume them). ``info`` is computed on the
device; ``_linalg_check_errors`` turns it into a device check (``eager/checks.py``), so a singular
or non positive-definite input raises LinAlgError at the next host sync, not at the op.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ._util import canonical_dim, to_jax
from .registry import aten, matmul_precision, register


_LOW = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_I32 = jnp.int32


# ---------------------------------------------------------------- helpers

def _precision(dtype):
    if np.dtype(dtype) in (np.dtype(jnp.float32), np.dtype(jnp.complex64)):
        return _PRECISIONS[matmul_precision()]
    return lax.Precision.HIGHEST


_PRECISIONS = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH,
               "default": lax.Precision.DEFAULT}


def _tname(dt) -> str:
    from ._util import to_torch

    t = to_torch(np.dtype(dt))
    return {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
            torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int",
            torch.complex64: "c10::complex<float>",
            torch.complex128: "c10::complex<double>"}.get(t, str(t).replace("torch.", ""))


def _is_float_or_complex(x):
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _matmul(a, b, out_dtype=None, keep_acc=False):
    """a @ b with PyTorch's dtype rules (inputs already share a dtype). Half-precision
    inputs accumulate in float32; ``keep_acc`` returns that float32 value unrounded (the
    addmm family adds beta * self before rounding once, like PyTorch's CPU kernels)."""
    dt = a.dtype
    od = dt if out_dtype is None else np.dtype(out_dtype)
    if dt == jnp.bool_:
        r = jnp.matmul(a.astype(jnp.int32), b.astype(jnp.int32), preferred_element_type=jnp.int32)
        return r != 0
    if dt in _LOW:
        r = jnp.matmul(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return r if keep_acc else r.astype(od)
    if jnp.issubdtype(dt, jnp.integer):
        return jnp.matmul(a, b, preferred_element_type=od).astype(od)
    return jnp.matmul(a, b, precision=_precision(dt), preferred_element_type=od).astype(od)


def _same_dtype(a, b, what="m1 and m2"):
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected {what} to have the same dtype, but got: "
                           f"{_tname(a.dtype)} != {_tname(b.dtype)}")


def _no_bool(x, kernel):
    """PyTorch's CPU matmul kernels have no bool implementation (CUDA neither)."""
    if x.dtype == jnp.bool_:
        raise NotImplementedError(f"\"{kernel}\" not implemented for 'Bool'")


def _same_scalar_type(a, b):
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected scalar type {_torch_name(a.dtype)} but found "
                           f"{_torch_name(b.dtype)}")


def _addmm_dtypes(self, mat1, mat2):
    if self.dtype != mat2.dtype:
        raise RuntimeError(f"self and mat2 must have the same dtype, but got "
                           f"{_torch_name(self.dtype)} and {_torch_name(mat2.dtype)}")
    _same_dtype(mat1, mat2)


def _addmv_dtypes(self, mat, vec):
    if not (self.dtype == mat.dtype == vec.dtype):
        raise RuntimeError(f"addmv input tensors must have the same dtype, but got "
                           f"{_torch_name(self.dtype)}, {_torch_name(mat.dtype)}, and "
                           f"{_torch_name(vec.dtype)}")


def _check_out_dtype(a, out_dtype, name):
    od = np.dtype(to_jax(out_dtype))
    if not (od == a.dtype or (a.dtype in _LOW and od == np.dtype(jnp.float32))):
        raise RuntimeError(f"{name}: out_dtype must be the same as input dtype or fp32 for "
                           "fp16/bf16 inputs")
    return od


def _scale(x, s, dt):
    """s * x for a Python scalar s in dtype dt (skipped when s == 1)."""
    if isinstance(s, bool) or dt == jnp.bool_:
        return x if s else jnp.zeros_like(x)
    if s == 1:
        return x
    return x * jnp.asarray(s, dt)


def _add_scaled(self, prod, beta, alpha, out_dtype=None):
    """beta * self + alpha * prod, PyTorch's addmm family (beta == 0 ignores self's NaNs).
    ``prod`` may be a float32 accumulator of a half-precision product: the sum is formed in
    float32 and rounded once to ``out_dtype``."""
    dt = prod.dtype
    od = dt if out_dtype is None else np.dtype(out_dtype)
    self = jnp.broadcast_to(self.astype(dt), prod.shape)
    if dt == jnp.bool_:
        p = prod if alpha else jnp.zeros_like(prod)
        return (self & bool(beta)) | p if beta else p
    p = _scale(prod, alpha, dt)
    if beta == 0:
        return p.astype(od)
    return (_scale(self, beta, dt) + p).astype(od)


def _addmm_like(self, a, b, beta, alpha, out_dtype=None):
    od = np.dtype(out_dtype) if out_dtype is not None else a.dtype
    return _add_scaled(self, _matmul(a, b, out_dtype, keep_acc=True), beta, alpha, od)


def _mm_shapes(a, b):
    if a.ndim != 2:
        raise RuntimeError(f"self must be a matrix")
    if b.ndim != 2:
        raise RuntimeError(f"mat2 must be a matrix")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]}"
                           f" and {b.shape[0]}x{b.shape[1]})")


# ---------------------------------------------------------------- matmul family

@register(aten.mm.default, reads_precision=True)
def mm(self, mat2):
    _no_bool(self, "addmm_impl_cpu_")
    _mm_shapes(self, mat2)
    _same_dtype(self, mat2)
    return _matmul(self, mat2)


@register(aten.mm.dtype, reads_precision=True)
def mm_dtype(self, mat2, out_dtype):
    _no_bool(self, "addmm_impl_cpu_")
    _mm_shapes(self, mat2)
    _same_dtype(self, mat2)
    return _matmul(self, mat2, _check_out_dtype(self, out_dtype, "mm"))


def _bmm_shapes(a, b):
    if a.ndim != 3:
        raise RuntimeError("batch1 must be a 3D tensor")
    if b.ndim != 3:
        raise RuntimeError("batch2 must be a 3D tensor")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"Expected size for first two dimensions of batch2 tensor to be: "
                           f"[{a.shape[0]}, {a.shape[2]}] but got: [{b.shape[0]}, {b.shape[1]}].")


@register(aten.bmm.default, reads_precision=True)
def bmm(self, mat2):
    _no_bool(self, "bmm")
    _bmm_shapes(self, mat2)
    _same_scalar_type(self, mat2)
    return _matmul(self, mat2)


@register(aten.bmm.dtype, reads_precision=True)
def bmm_dtype(self, mat2, out_dtype):
    _no_bool(self, "bmm")
    _bmm_shapes(self, mat2)
    _same_scalar_type(self, mat2)
    return _matmul(self, mat2, _check_out_dtype(self, out_dtype, "bmm"))


@register(aten.addmm.default, reads_precision=True)
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    _no_bool(mat1, "addmm_impl_cpu_")
    _mm_shapes(mat1, mat2)
    _addmm_dtypes(self, mat1, mat2)
    return _addmm_like(self, mat1, mat2, beta, alpha)


@register(aten.addmm.dtype, reads_precision=True)
def addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1):
    _no_bool(mat1, "addmm_impl_cpu_")
    _mm_shapes(mat1, mat2)
    _same_dtype(mat1, mat2)
    od = _check_out_dtype(mat1, out_dtype, "addmm")
    return _addmm_like(self, mat1, mat2, beta, alpha, od)


@register(aten.baddbmm.default, reads_precision=True)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    _no_bool(batch1, "baddbmm")
    _bmm_shapes(batch1, batch2)
    _same_scalar_type(self, batch1)
    _same_scalar_type(batch1, batch2)
    return _addmm_like(self, batch1, batch2, beta, alpha)


@register(aten.baddbmm.dtype, reads_precision=True)
def baddbmm_dtype(self, batch1, batch2, out_dtype, *, beta=1, alpha=1):
    _no_bool(batch1, "baddbmm")
    _bmm_shapes(batch1, batch2)
    od = _check_out_dtype(batch1, out_dtype, "baddbmm")
    return _addmm_like(self, batch1, batch2, beta, alpha, od)


@register(aten.addbmm.default, reads_precision=True)
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    _no_bool(batch1, "addmm_impl_cpu_")
    _bmm_shapes(batch1, batch2)
    _same_scalar_type(self, batch1)
    _same_scalar_type(batch1, batch2)
    dt = batch1.dtype
    if dt == jnp.bool_ or jnp.issubdtype(dt, jnp.integer):
        prod = jnp.sum(_matmul(batch1, batch2), axis=0, dtype=dt)
    else:
        b, n, k = batch1.shape
        # one (n, b*k) @ (b*k, m) product: the batch sum happens inside the matmul
        a2 = jnp.transpose(batch1, (1, 0, 2)).reshape(n, b * k)
        b2 = batch2.reshape(b * k, batch2.shape[2])
        return _addmm_like(self, a2, b2, beta, alpha)
    return _add_scaled(self, prod, beta, alpha)


@register(aten.mv.default, reads_precision=True)
def mv(self, vec):
    _no_bool(self, "addmv_impl_cpu")
    if self.ndim != 2 or vec.ndim != 1 or self.shape[1] != vec.shape[0]:
        raise RuntimeError(f"size mismatch, got input ({self.shape[0] if self.ndim else 0}), "
                           f"mat ({'x'.join(map(str, self.shape))}), vec ({vec.shape[0] if vec.ndim else 0})")
    _addmv_dtypes(vec, self, vec)
    return _matmul(self, vec)


@register(aten.addmv.default, reads_precision=True)
def addmv(self, mat, vec, *, beta=1, alpha=1):
    _no_bool(mat, "addmv_impl_cpu")
    if mat.ndim != 2 or vec.ndim != 1 or mat.shape[1] != vec.shape[0]:
        raise RuntimeError(f"size mismatch, got input ({self.shape[0] if self.ndim else 1}), "
                           f"mat ({'x'.join(map(str, mat.shape))}), vec ({vec.shape[0] if vec.ndim else 0})")
    _addmv_dtypes(self, mat, vec)
    return _addmm_like(self, mat, vec, beta, alpha)


def _dot_check(a, b, name):
    if a.ndim != 1 or b.ndim != 1:
        raise RuntimeError(f"1D tensors expected, but got {a.ndim}D and {b.ndim}D tensors")
    if a.dtype != b.dtype:
        raise RuntimeError(f"{name} : expected both vectors to have same dtype, but found "
                           f"{_torch_name(a.dtype)} and {_torch_name(b.dtype)}")
    if a.shape[0] != b.shape[0]:
        raise RuntimeError(f"inconsistent tensor size, expected tensor [{a.shape[0]}] and src "
                           f"[{b.shape[0]}] to have the same number of elements, but got "
                           f"{a.shape[0]} and {b.shape[0]} elements respectively")


def _torch_name(dt):
    from ._util import to_torch

    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
            torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
            torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}.get(
        to_torch(np.dtype(dt)), str(dt))


@register(aten.dot.default, reads_precision=True)
def dot(self, tensor):
    _no_bool(self, "dot")
    _dot_check(self, tensor, "dot")
    return _matmul(self, tensor)


@register(aten.vdot.default, reads_precision=True)
def vdot(self, other):
    _no_bool(self, "dot")
    _dot_check(self, other, "vdot")
    return _matmul(jnp.conj(self), other)


@register(aten.addr.default)
def addr(self, vec1, vec2, *, beta=1, alpha=1):
    if vec1.ndim != 1 or vec2.ndim != 1:
        raise RuntimeError(f"addr: Expected 1-D argument vec1, but got {vec1.ndim}-D"
                           if vec1.ndim != 1 else
                           f"addr: Expected 1-D argument vec2, but got {vec2.ndim}-D")
    from ._util import result_type

    dt = to_jax(result_type(self, vec1, vec2))
    outer = vec1.astype(dt)[:, None] * vec2.astype(dt)[None, :]
    return _add_scaled(self, outer, beta, alpha)


@register(aten.trace.default)
def trace(self):
    if self.ndim != 2:
        raise RuntimeError(f"trace: expected a matrix, but got tensor with dim {self.ndim}")
    d = jnp.diagonal(self)
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        return jnp.sum(d, dtype=jnp.int64)
    if self.dtype in _LOW:
        return jnp.sum(d.astype(jnp.float32)).astype(self.dtype)
    return jnp.sum(d)


@register(aten.linalg_cross.default)
def linalg_cross(self, other, *, dim=-1):
    if self.ndim != other.ndim:
        raise RuntimeError(f"linalg.cross: inputs must have the same number of dimensions.")
    shape = jnp.broadcast_shapes(self.shape, other.shape)
    d = canonical_dim(dim, len(shape))
    if self.shape[d] != 3 or other.shape[d] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. Got "
                           f"{self.shape[d]} and {other.shape[d]}")
    from ._util import result_type

    dt = to_jax(result_type(self, other))
    a = jnp.broadcast_to(self.astype(dt), shape)
    b = jnp.broadcast_to(other.astype(dt), shape)
    a0, a1, a2 = (lax.index_in_dim(a, i, d) for i in range(3))
    b0, b1, b2 = (lax.index_in_dim(b, i, d) for i in range(3))
    return jnp.concatenate([a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0], axis=d)


# ---------------------------------------------------------------- factorization helpers

def _square(A, name):
    if A.ndim < 2:
        raise RuntimeError(f"{name}: The input tensor A must have at least 2 dimensions.")
    if A.shape[-1] != A.shape[-2]:
        raise RuntimeError(f"{name}: A must be batches of square matrices, but they are "
                           f"{A.shape[-2]} by {A.shape[-1]} matrices")


def _floating(A, name):
    if not _is_float_or_complex(A) or A.dtype in _LOW:
        raise RuntimeError(f"{name}: Expected a floating point or complex tensor as input. "
                           f"Got {_torch_name(A.dtype)}")


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.issubdtype(x.dtype, jnp.complexfloating) else _mT(x)


def _real(dt):
    dt = np.dtype(dt)
    return {np.dtype(jnp.complex64): np.dtype(jnp.float32),
            np.dtype(jnp.complex128): np.dtype(jnp.float64)}.get(dt, dt)


def _lu(A):
    """LU with partial pivoting: (LU, 1-based int32 pivots, permutation, info)."""
    m, n = A.shape[-2], A.shape[-1]
    k = min(m, n)
    if A.size == 0:
        batch = A.shape[:-2]
        return (A, jnp.ones(batch + (k,), _I32) * jnp.arange(1, k + 1, dtype=_I32),
                jnp.broadcast_to(jnp.arange(m, dtype=_I32), batch + (m,)),
                jnp.zeros(batch, _I32))
    lu, piv, perm = lax.linalg.lu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    zero = diag == 0
    first = jnp.argmax(zero, axis=-1).astype(_I32) + 1
    info = jnp.where(jnp.any(zero, axis=-1), first, 0).astype(_I32)
    return lu, (piv + 1).astype(_I32), perm, info


def _perm_from_pivots(pivots, m):
    """Permutation (0-based rows) from LAPACK 1-based pivots."""
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(_I32) - 1, m)


def _tri(a, b, *, left=True, lower=True, trans=False, conj=False, unit=False):
    """Triangular solve op(a) x = b (left) or x op(a) = b (right), batch dims broadcast."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    if b.size == 0 or a.size == 0:
        return jnp.zeros(b.shape, b.dtype)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=trans,
                                       conjugate_a=conj, unit_diagonal=unit)


def _lu_solve_core(lu, perm, B, adjoint=False):
    """Solve A X = B (or A^H X = B) for A = P L U, with B matrices [..., n, k]."""
    batch = jnp.broadcast_shapes(lu.shape[:-2], B.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    if B.size == 0 or lu.size == 0:
        return jnp.zeros(B.shape, jnp.result_type(lu.dtype, B.dtype))
    cplx = jnp.issubdtype(lu.dtype, jnp.complexfloating)
    if not adjoint:
        pb = jnp.take_along_axis(B, perm[..., :, None].astype(jnp.int64), axis=-2)
        y = lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)
    # A^H = U^H L^H P^T: solve U^H z = B, L^H w = z, X = P w
    z = lax.linalg.triangular_solve(lu, B, left_side=True, lower=False, transpose_a=True,
                                    conjugate_a=cplx)
    w = lax.linalg.triangular_solve(lu, z, left_side=True, lower=True, transpose_a=True,
                                    conjugate_a=cplx, unit_diagonal=True)
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(w, inv[..., :, None].astype(jnp.int64), axis=-2)


def _det_from_lu(lu, pivots):
    n = lu.shape[-1]
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, n + 1, dtype=_I32), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(lu.dtype)
    return diag, parity


# ---------------------------------------------------------------- determinants / inverse / solve

def _det_input(A):
    """The matrix whose LU _linalg_det/_linalg_slogdet return. PyTorch factors A^T for a real
    contiguous A (det(A^T) = det(A)) and its backward formula (linalg_lu_solve with
    adjoint=False) relies on that. A lowering cannot see strides; tensors a lowering receives
    are contiguous in the common case, so we mirror the contiguous branch. Known limitation:
    the gradient of det/slogdet of a real *non-contiguous* view (e.g. ``A.mT``) is transposed.
    """
    return A if jnp.issubdtype(A.dtype, jnp.complexfloating) else _mT(A)


@register(aten._linalg_det.default)
def _linalg_det(A):
    _square(A, "linalg.det")
    _floating(A, "linalg.det")
    lu, piv, _, _ = _lu(_det_input(A))
    diag, parity = _det_from_lu(lu, piv)
    return parity * jnp.prod(diag, axis=-1), lu, piv


@register(aten._linalg_slogdet.default)
def _linalg_slogdet(A):
    _square(A, "linalg.slogdet")
    _floating(A, "linalg.slogdet")
    lu, piv, _, _ = _lu(_det_input(A))
    diag, parity = _det_from_lu(lu, piv)
    absd = jnp.abs(diag)
    logabs = jnp.sum(jnp.log(absd), axis=-1).astype(_real(A.dtype))
    if jnp.issubdtype(A.dtype, jnp.complexfloating):
        phase = jnp.where(absd == 0, jnp.zeros((), A.dtype), diag / absd.astype(A.dtype))
        sign = parity * jnp.prod(phase, axis=-1)
    else:
        sign = parity * jnp.prod(jnp.sign(diag), axis=-1)
    return sign, logabs, lu, piv


@register(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, *, check_errors=False):
    _square(A, "linalg.inv")
    _floating(A, "linalg.inv")
    lu, piv, perm, info = _lu(A)
    n = A.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=A.dtype), A.shape)
    return _lu_solve_core(lu, perm, eye), info


def _is_vector_rhs(A, B):
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@register(aten._linalg_solve_ex.default)
def _linalg_solve_ex(A, B, *, left=True, check_errors=False):
    _square(A, "linalg.solve")
    _floating(A, "linalg.solve")
    if A.dtype != B.dtype:
        raise RuntimeError(f"linalg.solve: Expected A and B to have the same dtype, but found "
                           f"A of type {_torch_name(A.dtype)} and B of type "
                           f"{_torch_name(B.dtype)} instead")
    vec = _is_vector_rhs(A, B) and left
    lu, piv, perm, info = _lu(A)
    if vec:
        X = _lu_solve_core(lu, perm, B[..., None])[..., 0]
    elif left:
        X = _lu_solve_core(lu, perm, B)
    else:
        # X A = B  <=>  A^T X^T = B^T
        X = _mT(_lu_solve_core_trans(lu, perm, _mT(B)))
    return X, lu, piv, info


def _lu_solve_core_trans(lu, perm, B):
    """Solve A^T X = B (plain transpose) for A = P L U."""
    batch = jnp.broadcast_shapes(lu.shape[:-2], B.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    B = jnp.broadcast_to(B, batch + B.shape[-2:])
    if B.size == 0 or lu.size == 0:
        return jnp.zeros(B.shape, B.dtype)
    z = lax.linalg.triangular_solve(lu, B, left_side=True, lower=False, transpose_a=True)
    w = lax.linalg.triangular_solve(lu, z, left_side=True, lower=True, transpose_a=True,
                                    unit_diagonal=True)
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(w, inv[..., :, None].astype(jnp.int64), axis=-2)


@register(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    if A.ndim < 2:
        raise RuntimeError("torch.linalg.lu_factor: Expected tensor with 2 or more dimensions. "
                           f"Got size: {list(A.shape)} instead")
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")
    _floating(A, "linalg.lu_factor")
    lu, piv, _, info = _lu(A)
    return lu, piv, info


@register(aten.linalg_lu.default)
def linalg_lu(A, *, pivot=True):
    if A.ndim < 2:
        raise RuntimeError("linalg.lu: Expected tensor with 2 or more dimensions. "
                           f"Got size: {list(A.shape)} instead")
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")
    _floating(A, "linalg.lu")
    m, n = A.shape[-2:]
    k = min(m, n)
    lu, piv, perm, _ = _lu(A)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=A.dtype)
    U = jnp.triu(lu[..., :k, :])
    # A[perm] = L U  =>  A = P L U with P[perm[i], i] = 1
    P = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=A.dtype), -1, -2)
    return P, L, U


@register(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m, n = LU_data.shape[-2:]
    k = min(m, n)
    dt = LU_data.dtype
    if unpack_data:
        L = jnp.tril(LU_data[..., :, :k], -1) + jnp.eye(m, k, dtype=dt)
        U = jnp.triu(LU_data[..., :k, :])
    else:
        L = U = jnp.zeros((0,), dt)
    if unpack_pivots:
        perm = _perm_from_pivots(LU_pivots, m) if m else jnp.zeros(LU_pivots.shape[:-1] + (0,), _I32)
        P = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=dt), -1, -2)
    else:
        P = jnp.zeros((0,), dt)
    return P, L, U


@register(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    n = LU.shape[-1]
    perm = _perm_from_pivots(pivots, n)
    cplx = jnp.issubdtype(LU.dtype, jnp.complexfloating)
    if left:
        return _lu_solve_core(LU, perm, B, adjoint=adjoint)
    # X op(A) = B  <=>  op(A)^H X^H = B^H
    if not adjoint:
        # X A = B <=> A^T X^T = B^T
        return _mT(_lu_solve_core_trans(LU, perm, _mT(B)))
    # X A^H = B <=> A X^H = B^H
    return _mH(_lu_solve_core(LU, perm, _mH(B))) if cplx else \
        _mT(_lu_solve_core(LU, perm, _mT(B)))


# ---------------------------------------------------------------- triangular solves

@register(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    if self.ndim < 2 or A.ndim < 2:
        raise RuntimeError("torch.triangular_solve: Expected b to have at least 2 dimensions, "
                           f"but it has {self.ndim} dimensions instead")
    batch = jnp.broadcast_shapes(self.shape[:-2], A.shape[:-2])
    Ab = jnp.broadcast_to(A, batch + A.shape[-2:])
    X = _tri(A, self, left=True, lower=not upper, trans=transpose, unit=unitriangular)
    return X, Ab


@register(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, *, upper, left=True, unitriangular=False):
    return _tri(self, B, left=left, lower=not upper, unit=unitriangular)


# ---------------------------------------------------------------- Cholesky

def _chol_lower(A):
    """Cholesky factor of the Hermitian matrix whose lower triangle is A's (NaN if not PD)."""
    if A.size == 0:
        return A
    return lax.linalg.cholesky(A, symmetrize_input=False)


def _chol_info(L):
    n = L.shape[-1]
    if L.size == 0:
        return jnp.zeros(L.shape[:-2], _I32)
    d = jnp.diagonal(L, axis1=-2, axis2=-1)
    bad = jnp.isnan(d) | (jnp.real(d) <= 0) if n else d
    first = jnp.argmax(bad, axis=-1).astype(_I32) + 1
    return jnp.where(jnp.any(bad, axis=-1), first, 0).astype(_I32)


def _cholesky(A, upper):
    if upper:
        # LAPACK 'U' reads A's upper triangle: U = chol_lower(A^H)^H
        return _mH(jnp.tril(_chol_lower(_mH(A))))
    return jnp.tril(_chol_lower(A))


@register(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, *, upper=False, check_errors=False):
    _square(self, "linalg.cholesky")
    _floating(self, "linalg.cholesky")
    L = _cholesky(self, upper)
    return L, _chol_info(L)


@register(aten.cholesky.default)  # the deprecated torch.cholesky: gone from aten in torch 2.14
def cholesky(self, upper=False):
    _square(self, "cholesky")
    _floating(self, "cholesky")
    return _cholesky(self, upper)


@register(aten.cholesky_solve.default)
def cholesky_solve(self, input2, upper=False):
    # A = L L^H (or U^H U): solve A X = self
    if self.dtype != input2.dtype:
        raise RuntimeError(f"cholesky_solve: Expected b and A to have the same dtype, but found "
                           f"b of type {_torch_name(self.dtype)} and A of type "
                           f"{_torch_name(input2.dtype)} instead.")
    cplx = jnp.issubdtype(input2.dtype, jnp.complexfloating)
    if upper:
        y = _tri(input2, self, left=True, lower=False, trans=True, conj=cplx)
        return _tri(input2, y, left=True, lower=False)
    y = _tri(input2, self, left=True, lower=True)
    return _tri(input2, y, left=True, lower=True, trans=True, conj=cplx)


@register(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    if self.ndim < 2 or self.shape[-1] != self.shape[-2]:
        raise RuntimeError("cholesky_inverse: A must be batches of square matrices")
    n = self.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=self.dtype), self.shape)
    return cholesky_solve(eye, self, upper)


# ---------------------------------------------------------------- QR / SVD / eigh / expm

@register(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode not in ("reduced", "complete", "r"):
        raise RuntimeError(f"qr received unrecognized mode '{mode}' but expected one of "
                           "'reduced' (default), 'r', or 'complete'")
    if A.ndim < 2:
        raise RuntimeError(f"linalg.qr: The input tensor A must have at least 2 dimensions.")
    _floating(A, "linalg.qr")
    m, n = A.shape[-2:]
    k = min(m, n)
    full = mode == "complete"
    if A.size == 0:
        qc = m if full else k
        Q = jnp.broadcast_to(jnp.eye(m, qc, dtype=A.dtype), A.shape[:-2] + (m, qc))
        R = jnp.zeros(A.shape[:-2] + (qc, n), A.dtype)
    else:
        Q, R = lax.linalg.qr(A, full_matrices=full)
    if mode == "r":
        return jnp.zeros((0,), A.dtype), R
    return Q, R


@register(aten._linalg_svd.default)
def _linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    if A.ndim < 2:
        raise RuntimeError("linalg.svd: The input tensor A must have at least 2 dimensions.")
    _floating(A, "linalg.svd")
    m, n = A.shape[-2:]
    k = min(m, n)
    batch = A.shape[:-2]
    rd = _real(A.dtype)
    if A.size == 0:
        S = jnp.zeros(batch + (k,), rd)
        if not compute_uv:
            return jnp.zeros((0,), A.dtype), S, jnp.zeros((0,), A.dtype)
        uc, vr = (m, n) if full_matrices else (k, k)
        U = jnp.broadcast_to(jnp.eye(m, uc, dtype=A.dtype), batch + (m, uc))
        Vh = jnp.broadcast_to(jnp.eye(vr, n, dtype=A.dtype), batch + (vr, n))
        return U, S, Vh
    if not compute_uv:
        S = lax.linalg.svd(A, full_matrices=False, compute_uv=False)
        return jnp.zeros((0,), A.dtype), S.astype(rd), jnp.zeros((0,), A.dtype)
    U, S, Vh = lax.linalg.svd(A, full_matrices=full_matrices, compute_uv=True)
    return U, S.astype(rd), Vh


@register(aten._linalg_eigh.default)
def _linalg_eigh(A, UPLO="L", compute_v=True):
    if UPLO not in ("L", "U"):
        raise RuntimeError(f"Expected UPLO argument to be 'L' or 'U', but got {UPLO}")
    _square(A, "linalg.eigh")
    _floating(A, "linalg.eigh")
    rd = _real(A.dtype)
    if A.size == 0:
        w = jnp.zeros(A.shape[:-1], rd)
        return w, (A if compute_v else jnp.zeros((0,), A.dtype))
    v, w = lax.linalg.eigh(A, lower=(UPLO == "L"), symmetrize_input=False)
    if not compute_v:
        return w.astype(rd), jnp.zeros((0,), A.dtype)
    return w.astype(rd), v


@register(aten.linalg_matrix_sqrth.default)  # new in torch 2.14
def linalg_matrix_sqrth(self):
    _square(self, "linalg.matrix_sqrth")
    _floating(self, "linalg.matrix_sqrth")
    if self.size == 0:
        return self
    w, V = _linalg_eigh(self, "L")
    return jnp.matmul(V * jnp.sqrt(w).astype(V.dtype)[..., None, :], jnp.conj(jnp.swapaxes(V, -1, -2)),
                      precision=lax.Precision.HIGHEST)


@register(aten.linalg_polar.default)  # new in torch 2.14
def linalg_polar(A):
    if A.ndim < 2:
        raise RuntimeError("linalg.polar: The input tensor A must have at least 2 dimensions.")
    _floating(A, "linalg.polar")
    m, n = A.shape[-2:]
    if m < n:
        raise RuntimeError(f"linalg.polar: input must have at least as many rows as columns, "
                           f"but got {m} by {n} matrices")
    if A.size == 0:
        return A, jnp.zeros(A.shape[:-2] + (n, n), A.dtype)
    W, S, Vh = _linalg_svd(A, full_matrices=False)
    hp = lax.Precision.HIGHEST
    V = jnp.conj(jnp.swapaxes(Vh, -1, -2))
    return (jnp.matmul(W, Vh, precision=hp),
            jnp.matmul(V * S.astype(A.dtype)[..., None, :], Vh, precision=hp))


@register(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self):
    _square(self, "linalg.matrix_exp")
    if not _is_float_or_complex(self):
        raise RuntimeError(f"linalg.matrix_exp: Expected a floating point or complex tensor "
                           f"as input. Got {_torch_name(self.dtype)}")
    if self.size == 0:
        return self
    x = self.astype(jnp.float32) if self.dtype in _LOW else self
    r = jax.scipy.linalg.expm(x)
    return r.astype(self.dtype)


# ---------------------------------------------------------------- error checks

def _info_ok(info, api_name, *, is_matrix):
    return jnp.all(info == 0)


@register(aten._linalg_check_errors.default,
          check=(_info_ok, torch.linalg.LinAlgError,
                 "linalg: the factorization or inversion could not be completed because the "
                 "input is singular or not positive-definite"))
def _linalg_check_errors(info, api_name, *, is_matrix):
    """``torch.linalg.cholesky``, ``inv``, ``solve``...: ``info`` (computed by the op's lowering)
    becomes a device check, raised as LinAlgError at the next host sync (CUDA raises at the op,
    after a sync); the ``*_ex`` forms return ``info`` unchecked."""
    return None
