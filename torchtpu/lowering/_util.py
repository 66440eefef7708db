"""Helpers shared by lowerings. All of them run at trace time only."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..runtime.dtypes import to_jax, to_torch

__all__ = ["to_jax", "to_torch", "result_type", "jdtype", "is_array", "canonical_dim",
           "float_result_type", "cast"]


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def jdtype(x):
    """The torch dtype of an array argument."""
    return to_torch(x.dtype)


# A Python scalar promotes by its category only (bool, int, float, complex), never its value.
# The key names the category, not a proxy value: True == 1 == 1.0 as dict keys.
_PROXY = {"b": True, "i": 1, "u": 1, "f": 1.0, "c": 1j}
_CATEGORY = {bool: "b", int: "i", float: "f", complex: "c"}


@functools.lru_cache(maxsize=4096)
def _result_type_key(key, default_dtype):
    import torch._prims_common as pc

    operands = [torch.empty(() if v[1] else (0,), dtype=v[0], device="meta") if kind == "t"
                else _PROXY[v] for kind, v in key]
    return pc.elementwise_dtypes(
        *operands, type_promotion_kind=pc.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


def _weak(a) -> bool:
    aval = getattr(a, "aval", None)
    return bool(getattr(aval if aval is not None else a, "weak_type", False))


def _scalar_category(a) -> str:
    c = _CATEGORY.get(type(a))
    if c is not None:
        return c
    if isinstance(a, (bool, np.bool_)):
        return "b"
    if isinstance(a, (int, np.integer)):
        return "i"
    if isinstance(a, (float, np.floating)):
        return "f"
    if isinstance(a, (complex, np.complexfloating)):
        return "c"
    raise TypeError(f"unsupported scalar operand of type {type(a).__name__}")


def result_type(*args) -> torch.dtype:
    """PyTorch's type promotion over arrays and Python scalars (torch.result_type rules)."""
    key = []
    for a in args:
        if a is None:
            continue
        if is_array(a):
            if a.ndim == 0 and _weak(a):
                # a traced Python number (a wrapped-number operand or a scalar_args value)
                key.append(("s", jnp.dtype(a.dtype).kind))
                continue
            key.append(("t", (to_torch(a.dtype), a.ndim == 0)))
        else:
            key.append(("s", _scalar_category(a)))
    # the default dtype decides int tensor + float scalar: part of the key
    return _result_type_key(tuple(key), torch.get_default_dtype())


def float_result_type(*args) -> torch.dtype:
    """Like result_type, but integer/bool results become the default float dtype."""
    dt = result_type(*args)
    if not (dt.is_floating_point or dt.is_complex):
        return torch.get_default_dtype()
    return dt


def cast(x, dtype: torch.dtype):
    """Cast an array or Python scalar to a torch dtype's jax dtype."""
    jd = to_jax(dtype)
    if is_array(x):
        return x if x.dtype == jd else x.astype(jd)
    return jnp.asarray(x, dtype=jd)


def real_dtype(jd):
    """The dtype of a complex JAX dtype's parts (float32 for complex64, float64 for
    complex128); any other dtype as it is."""
    jd = np.dtype(jd)
    if jd == np.complex64:
        return jnp.float32
    if jd == np.complex128:
        return jnp.float64
    return jd


def canonical_dim(dim: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n
