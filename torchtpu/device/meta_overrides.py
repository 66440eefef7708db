"""Meta (fake-tensor) kernels where PyTorch's own one states CUDA's limits for every device.

Dynamo, AOTAutograd and ``torch.export`` infer shapes by running an op's Meta kernel on fake
tensors. A few of PyTorch's Python meta kernels check what CUDA's kernel needs whatever the
fake tensor's device is; on "tpu" the op accepts more (its lowering serves every case), so a
program that runs eagerly on "tpu" would fail only when compiled. Each override here answers for
"tpu" tensors and hands every other device to PyTorch's kernel unchanged.

- ``aten._grouped_mm``: PyTorch's meta asks for bfloat16 and 16-byte aligned strides (CUTLASS
  on CUDA); CPU's kernel and the "tpu" lowering take float32, bfloat16 and float16 in any
  layout. transformers' mixture-of-experts layers call it for every dtype on "tpu", eager and
  compiled.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_GMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_lib = None


def _grouped_mm_shape(a, b, offs, bias, out_dtype) -> list:
    """CPU's argument checks (ATen/native/GroupedMMUtils.h) on shapes and dtypes, with its
    messages; the output's size."""
    for name, t in (("mat_a", a), ("mat_b", b)):
        torch._check(t.dtype in _GMM_DTYPES, lambda: (
            f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {t.dtype}"))
    torch._check(a.dim() in (2, 3), lambda: "mat_a has to be 2 or 3d")
    torch._check(b.dim() in (2, 3), lambda: "mat_b has to be 2 or 3d")
    a2, b2 = a.dim() == 2, b.dim() == 2
    if not (a2 and b2):
        torch._check(a.size(-1) == b.size(-2),
                     lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check((offs is not None) == (a2 or b2), lambda: (
        "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d"))
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    torch._check(bias is None, lambda: "Bias not supported yet")
    torch._check(out_dtype is None or out_dtype == a.dtype,
                 lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    torch._check(a.dtype == b.dtype, lambda: (
        f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}"))
    if a2 and b2:  # the contraction dim grouped: one [m, n] product per group
        return [offs.size(0), a.size(0), b.size(1)]
    if a2:  # rows of a grouped, one b per group
        torch._check(offs.size(0) == b.size(0), lambda: "matrix batch sizes have to match")
        return [a.size(0), b.size(-1)]
    if b2:  # columns of b grouped, one a per group
        torch._check(offs.size(0) == a.size(0), lambda: "matrix batch sizes have to match")
        return [a.size(1), b.size(-1)]
    torch._check(a.size(0) == b.size(0), lambda: "batched dimension has to match")
    return [a.size(0), a.size(1), b.size(-1)]


def _override(op, device_meta) -> None:
    """Route ``op``'s Meta kernel (Python dispatcher, C++ dispatcher and the decomposition
    table FakeTensor consults) through ``device_meta`` for "tpu" tensors."""
    from torch._decomp import meta_table

    original = op.py_kernels.get(torch._C.DispatchKey.Meta) or meta_table.get(op)
    if original is None or getattr(original, "_torchtpu_override", False):
        return

    def meta(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        # inside a fake kernel a FakeTensor reports device "meta"; its own device is fake_device
        device = getattr(first, "fake_device", None) or getattr(first, "device", None)
        if device is not None and device.type == "tpu":
            return device_meta(*args, **kwargs)
        return original(*args, **kwargs)

    meta._torchtpu_override = True
    op.py_kernels[torch._C.DispatchKey.Meta] = meta
    op._dispatch_cache.clear()
    meta_table[op] = meta
    _lib.impl(op, meta, "Meta")


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    size = _grouped_mm_shape(mat_a, mat_b, offs, bias, out_dtype)
    return mat_a.new_empty(size, dtype=out_dtype or mat_a.dtype)


def install() -> None:
    global _lib
    if _lib is not None:
        return
    import torch._meta_registrations  # noqa: F401  (PyTorch's kernels first, then ours)

    _lib = torch.library.Library("aten", "IMPL")
    _override(aten._grouped_mm.default, _grouped_mm_meta)
