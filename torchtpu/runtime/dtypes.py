"""torch <-> jax dtype maps (built once at import)."""
import jax.numpy as jnp
import numpy as np
import torch

TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int64: jnp.int64,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name) and hasattr(jnp, _name):
        TORCH_TO_JAX[getattr(torch, _name)] = getattr(jnp, _name)

JAX_TO_TORCH = {np.dtype(v): k for k, v in TORCH_TO_JAX.items()}


def to_jax(dtype: torch.dtype):
    """The jax dtype for a torch dtype; TypeError naming the dtype if there is none."""
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"Unsupported dtype {dtype} on device tpu") from None


def to_torch(dtype) -> torch.dtype:
    """The torch dtype for a jax/numpy dtype."""
    try:
        return JAX_TO_TORCH[dtype]
    except KeyError:
        return JAX_TO_TORCH[np.dtype(dtype)]


_NAMES: dict = {}


def scalar_type_name(dtype) -> str:
    """PyTorch's ScalarType name of a torch or jax/numpy dtype, as its error messages spell it
    ("Float", "Long", "BFloat16", "ComplexFloat"; ``torch.float32.__str__`` says "float32")."""
    dt = dtype if isinstance(dtype, torch.dtype) else to_torch(dtype)
    name = _NAMES.get(dt)
    if name is None:  # 'torch.FloatTensor' -> 'Float' (the legacy type name is the ScalarType's)
        name = _NAMES[dt] = torch.empty(0, dtype=dt).type()[len("torch."):-len("Tensor")]
    return name
