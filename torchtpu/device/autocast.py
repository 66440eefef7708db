"""``torch.autocast("tpu", dtype=torch.bfloat16)``: CUDA's autocast op lists on AutocastPrivateUse1.

PyTorch registers autocast kernels for CUDA/CPU/XPU/MPS in C++ only; for PrivateUse1 it has a
fallthrough (registered in registration.py). Here each listed op gets a Python kernel on
``AutocastPrivateUse1`` that casts its eligible arguments (floating tpu tensors other than
float64) and redispatches below autocast, exactly like CUDA's ``cached_cast`` policies:

- lower precision (matmul, conv, linear, attention): run in the autocast dtype;
- float32 (pointwise ops that lose accuracy, norms, losses, reductions): run in float32;
- promote (multi-input ops): run in the widest floating dtype among the inputs.
"""
from __future__ import annotations

import torch

from ..eager.dynamo_skip import skip

aten = torch.ops.aten
_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER = [
    "_convolution", "_convolution.deprecated", "conv1d", "conv1d.padding", "conv2d",
    "conv2d.padding", "conv3d", "conv3d.padding", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm",
    "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
]

FP32 = [
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "cross_entropy_loss", "nll_loss_nd",
    # CUDA's "fp32_set_opt_dtype" ops: reductions accumulate and return float32
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "sum", "sum.dim_IntList",
]

PROMOTE = [
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "scatter_add", "tensordot", "cat", "stack",
]


def _eligible(x):
    return (isinstance(x, torch.Tensor) and x.device.type == "tpu" and x.is_floating_point()
            and x.dtype != torch.float64)


def _cast(x, dtype):
    if _eligible(x) and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(e, dtype) for e in x)
    return x


def _widest(args, kwargs):
    best = None
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, torch.Tensor) and x.device.type == "tpu" and x.is_floating_point():
            best = x.dtype if best is None else torch.promote_types(best, x.dtype)
    return best


def _kernel(op, policy):
    def kernel(*args, **kwargs):
        if policy == "lower":
            dtype = torch.get_autocast_dtype("tpu")
        elif policy == "fp32":
            dtype = torch.float32
        else:
            dtype = _widest(args, kwargs)
        if dtype is not None:
            args = _cast(args, dtype)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_KEYS):
            return op(*args, **kwargs)

    return skip(kernel)


_lib = []


def _resolve(name):
    base, _, overload = name.partition(".")
    packet = getattr(aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def install() -> None:
    if _lib:
        return
    lib = torch.library.Library("aten", "IMPL")
    _lib.append(lib)
    for names, policy in ((LOWER, "lower"), (FP32, "fp32"), (PROMOTE, "promote")):
        for name in names:
            op = _resolve(name)
            if op is None:
                continue
            try:
                lib.impl(name, _kernel(op, policy), "AutocastPrivateUse1")
            except RuntimeError:
                pass  # already has an autocast kernel for this key
