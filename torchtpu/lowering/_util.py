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


@functools.lru_cache(maxsize=4096)
def _result_type_key(key):
    import torch._prims_common as pc

    operands = [torch.empty(() if v[1] else (0,), dtype=v[0], device="meta") if kind == "t" else v
                for kind, v in key]
    return pc.elementwise_dtypes(
        *operands, type_promotion_kind=pc.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


_WEAK_PROXY = {"b": True, "i": 1, "u": 1, "f": 1.0, "c": 1j}


def _weak(a) -> bool:
    aval = getattr(a, "aval", None)
    return bool(getattr(aval if aval is not None else a, "weak_type", False))


def result_type(*args) -> torch.dtype:
    """PyTorch's type promotion over arrays and Python scalars (torch.result_type rules)."""
    key = []
    for a in args:
        if a is None:
            continue
        if is_array(a):
            if a.ndim == 0 and _weak(a):
                # a traced Python number (a wrapped-number operand or a scalar_args value)
                key.append(("s", _WEAK_PROXY[jnp.dtype(a.dtype).kind]))
                continue
            key.append(("t", (to_torch(a.dtype), a.ndim == 0)))
        else:
            key.append(("s", a))
    return _result_type_key(tuple(key))


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


def canonical_dim(dim: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n
