"""Binding the lowering table (and the runtime's own kernels) to PrivateUse1.

For every functional overload in the table we also bind its in-place and out= siblings; the
executor derives their behaviour from the kind. View ops use PyTorch's own metadata-only CPU
kernels (redispatch), so views are real views of the same storage.
"""
from __future__ import annotations

import torch
from torch._ops import OpOverload

from ..lowering import registry
from ..runtime import buffer as _buffer
from ..runtime.metrics import count
from . import multi_write_kernels as _multi
from . import copy as _copy
from . import executor
from . import fastpath as _fastpath
from .dynamo_skip import skip

_copy.bind_executor(executor)  # copy.py's writes read the executor's donation settings

aten = torch.ops.aten
_lib = torch.library.Library("aten", "IMPL")
_libs = {"aten": _lib}  # one IMPL library per op namespace (aten, prims, ...)
_bound: set = set()
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _qualname(op: OpOverload) -> str:
    name = op._schema.name.split("::", 1)[1]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _bind(op: OpOverload, fn) -> None:
    if op in _bound:
        return
    ns = op._schema.name.split("::", 1)[0]
    lib = _libs.get(ns)
    if lib is None:
        lib = _libs[ns] = torch.library.Library(ns, "IMPL")
    if not _fastpath.bind_boxed(ns, _qualname(op), fn):  # a fast-path Kernel: boxed, in C++
        lib.impl(_qualname(op), skip(fn), "PrivateUse1")
    _bound.add(op)


def _arg_sig(args):
    return [(a.name, str(a.type)) for a in args]


def _siblings(op: OpOverload):
    """(inplace overload or None, [out overloads]) of a functional overload."""
    schema = op._schema
    ns, base = schema.name.split("::", 1)
    namespace = getattr(torch.ops, ns)
    sig = _arg_sig(schema.arguments)
    inplace = None
    ip_packet = getattr(namespace, base + "_", None)
    if ip_packet is not None:
        cand = getattr(ip_packet, op._overloadname, None)
        if cand is not None and _arg_sig(cand._schema.arguments) == sig:
            inplace = cand
    outs = []
    packet = getattr(namespace, base)
    for name in packet.overloads():
        cand = getattr(packet, name)
        cs = cand._schema
        if not cs.is_mutable or cand is op:
            continue
        # out= tensors are keyword-only; a positional mutated argument (running_mean of
        # _native_batch_norm_legit) makes a different op, not an out= sibling
        non_out = [a for a in cs.arguments
                   if not (a.alias_info is not None and a.alias_info.is_write and a.kwarg_only)]
        if _arg_sig(non_out) == sig:
            outs.append(cand)
    return inplace, outs


def _out_names(op: OpOverload):
    return [a.name for a in op._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only]


def _host_tensors_to_device(args):
    """Registry meta ``host_tensors``: CPU tensors among the arguments (index tensors; CUDA
    accepts CPU indices too) are copied to the device of the op's first tpu tensor."""
    dev = None
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and t.device.type == "tpu":
                dev = t.device
                break
        if dev is not None:
            break
    if dev is None:
        return args

    def move(t):
        return t.to(dev) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t

    return tuple(type(a)(move(t) for t in a) if isinstance(a, (list, tuple)) else move(a)
                 for a in args)


_EXPLICIT_FORMATS = (torch.channels_last, torch.channels_last_3d)


def _honour_memory_format(run):
    """``executor.run`` for a functional op with a ``memory_format`` argument (``clone``, the
    ``*_like`` factories): eager results are contiguous, but an explicit channels_last(_3d)
    request gets that layout, as on CPU and CUDA (``x.contiguous(memory_format=...)`` must
    satisfy ``is_contiguous(memory_format=...)``, and code views its permutation). Such a call
    runs the op again for the contiguous format and copies the result into a tensor of the
    asked layout; every other call is ``run`` itself. Inside the kernel, so the C++ fast path
    stays in front of it (it keys on the argument's value: a channels_last call always reaches
    this Python kernel)."""
    def with_format(lowering, kind, args, kwargs):
        mf = kwargs.get("memory_format")
        if mf not in _EXPLICIT_FORMATS:
            return run(lowering, kind, args, kwargs)
        # through the dispatcher: the C++ fast path's entry for this call's key (the asked
        # format) is never made; the contiguous call's own key gets its entry
        res = lowering.op(*args, **{**kwargs, "memory_format": torch.contiguous_format})
        out = _empty(res.shape, res.dtype, device=res.device, memory_format=mf)
        return out.copy_(res)

    return with_format


def _make(lowering, kind, out_names=(), void=False):
    """The PrivateUse1 kernel of one overload. ``void``: its schema returns nothing (the
    in-place foreach ops), so the kernel must return None."""
    run = executor.run
    if kind == executor.FUNCTIONAL and any(a.name == "memory_format" and a.kwarg_only
                                           for a in lowering.op._schema.arguments):
        run = _honour_memory_format(run)
    host = lowering.meta.get("host_tensors", False)
    layout = lowering.meta.get("eager_layout") if kind == executor.FUNCTIONAL else None
    if layout is not None:
        # registry meta ``eager_layout``: (args, kwargs, result) -> result with the strides
        # PyTorch's kernel (and its meta function) gives the outputs; eager outputs are
        # contiguous otherwise, and code that trusts the meta strides (DTensor's view rules)
        # would see a different layout
        def kernel(*args, **kwargs):
            return layout(args, kwargs, run(lowering, kind, args, kwargs))

        if lowering.meta.get("eager_layout_like") is not None:
            # a layout the C++ fast path reproduces (eager/fastpath.py): in front of it too
            return _fastpath.kernel(skip(kernel), lowering)
    elif void and kind != executor.OUT:
        def kernel(*args, **kwargs):
            if host:
                args = _host_tensors_to_device(args)
            run(lowering, kind, args, kwargs)
    elif kind == executor.FUNCTIONAL or kind == executor.INPLACE or kind == executor.DIRECT_INPLACE:
        def kernel(*args, **kwargs):
            if host:
                args = _host_tensors_to_device(args)
            return run(lowering, kind, args, kwargs)

        if kind == executor.FUNCTIONAL:
            # the C++ fast path in front of it (eager/fastpath.py), or the kernel itself
            return _fastpath.kernel(skip(kernel), lowering)
    else:
        dtype_from_out = lowering.meta.get("dtype_from_out", False)

        def kernel(*args, **kwargs):
            outs = []
            for n in out_names:
                o = kwargs.pop(n)
                if isinstance(o, (list, tuple)):  # Tensor(a!)[] out (split_with_sizes_copy)
                    outs.extend(o)
                else:
                    outs.append(o)
            if dtype_from_out and kwargs.get("dtype") is None:  # registry meta: as PyTorch
                kwargs["dtype"] = outs[0].dtype
            if host:
                args = _host_tensors_to_device(args)
            res = executor.run_out(lowering, args, kwargs, outs)
            return None if void else res
    return kernel


def _is_composite_implicit(op) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def is_view_schema(schema) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def bind_lowering(lowering: registry.Lowering) -> None:
    op = lowering.op
    schema = op._schema
    if lowering.graph_only:  # registry flag: eager keeps PyTorch's kernel
        return
    if is_view_schema(schema):
        # Lowerings of view ops serve the graph executors (compile, fused) only: in eager a
        # view must alias its base, which PyTorch's metadata kernels do (see VIEW_OPS).
        return
    if _is_composite_implicit(op):
        # A backend kernel would replace the decomposition that autograd differentiates
        # through (and the op would lose its gradient): such lowerings serve graphs only.
        return
    if not schema.is_mutable or lowering.mutates:
        # (registry flag mutates: the executor writes the mutated arguments back itself)
        _bind(op, _make(lowering, executor.FUNCTIONAL))
        inplace, outs = _siblings(op)
        if inplace is not None and registry.get(inplace) is None:
            _bind(inplace, _make(lowering, executor.INPLACE, void=not inplace._schema.returns))
        for o in outs:
            if registry.get(o) is None:
                _bind(o, _make(lowering, executor.OUT, _out_names(o), void=not o._schema.returns))
    elif schema.name.endswith("_") or op._overloadname.endswith("_"):
        _bind(op, _make(lowering, executor.DIRECT_INPLACE, void=not schema.returns))
    else:
        _bind(op, _make(lowering, executor.OUT, _out_names(op), void=not schema.returns))


def bind_table() -> None:
    for lowering in list(registry.LOWERINGS.values()):
        bind_lowering(lowering)


# ---- the runtime's own kernels: allocation, copies, metadata, scalars ----

def _redispatch_cpu(op):
    h = op._handle

    def kernel(*args, **kwargs):
        return h.redispatch_boxed(_CPU_KEYS, *args, **kwargs)

    return kernel


VIEW_OPS = [aten.view.default, aten.as_strided.default, aten._reshape_alias.default,
            aten.unfold.default, aten.view_as_real.default, aten.view_as_complex.default,
            aten.set_.source_Storage_storage_offset, aten.set_.source_Storage,
            aten.set_.source_Tensor, aten.set_.default, aten.view.dtype]


def format_strides(size, memory_format):
    """The strides PyTorch gives a new tensor of ``size`` in ``memory_format`` (its own rank
    checks and errors: channels_last needs 4 dims, preserve_format is refused), read from a
    meta tensor; None for the contiguous layout."""
    if memory_format is None or memory_format is torch.contiguous_format:
        return None
    strides = list(torch.empty(list(size), device="meta", memory_format=memory_format).stride())
    return None if strides == _buffer._contiguous_strides(list(size)) else strides


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    from .factories import empty_strided, empty_tensor

    strides = format_strides(size, memory_format)
    if strides is not None:  # channels_last(_3d): laid out as asked, as PyTorch's kernels do
        return empty_strided(list(size), strides, dtype, device)
    return empty_tensor(list(size), dtype, device)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    from .factories import empty_strided

    return empty_strided(list(size), list(stride), dtype, device)


def _local_scalar_dense(t):
    return _copy.device_to_host(_copy.value_of(t)).item()


def _copy_kernel(self, src, non_blocking=False):
    return _copy.copy_(self, src, non_blocking)


def _copy_from(self, dst, non_blocking=False):
    return _copy.copy_(dst, self, non_blocking)


def _copy_from_and_resize(self, dst):
    if tuple(dst.shape) != tuple(self.shape):
        _copy.resize(dst, list(self.shape))
    return _copy.copy_(dst, self)


def _resize_(self, size, memory_format=None):
    _copy.resize(self, list(size))
    return self


def _equal(a, b):
    if a.shape != b.shape:
        return False
    return bool(aten.eq.Tensor(a, b).all().item())


# ---- F.scaled_dot_product_attention routing (added by the nn developer) ----
# PyTorch picks the SDPA backend through _fused_sdp_choice_stub, a C++ DispatchStub that only C++
# code can register for PrivateUse1 (binding the aten::_fused_sdp_choice op is not consulted), so
# every tpu SDPA would take the unfused math path (a dozen ops, the L x S weights materialised
# between them). This kernel, bound to PrivateUse1 and AutogradPrivateUse1 of the
# CompositeImplicitAutograd op aten::scaled_dot_product_attention, does what PyTorch's composite
# does when the choice is OVERRIDEABLE: call _scaled_dot_product_fused_attention_overrideable
# (lowered in lowering/attention.py; autograd uses its derivative formula, i.e. the lowered
# backward op). Inputs the fused op does not cover, or every fused backend disabled through
# torch.nn.attention.sdpa_kernel, take PyTorch's own math path (same results and errors).

def _fused_backend_enabled() -> bool:
    """The fused op stands for every fused SDPA backend: code that allows flash, efficient or
    cuDNN attention (``sdpa_kernel([FLASH_ATTENTION, MATH])``, as TorchTitan does) means
    "not the math path" on "tpu" too; only excluding them all takes the math path."""
    C = torch._C
    return (C._get_overrideable_sdp_enabled() or C._get_flash_sdp_enabled()
            or C._get_mem_efficient_sdp_enabled() or C._get_cudnn_sdp_enabled())


def _sdpa_fused_ok(q, k, v, attn_mask, is_causal, enable_gqa):
    if not _fused_backend_enabled():
        return False
    if q.is_nested or k.is_nested or v.is_nested or q.dim() < 3:
        return False
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return False
    if not (q.dim() == k.dim() == v.dim()) or q.shape[:-3] != k.shape[:-3] or k.shape[:-1] != v.shape[:-1]:
        return False
    if q.shape[-1] != k.shape[-1]:
        return False
    hq, hk = q.shape[-3], k.shape[-3]
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        return False
    if attn_mask is not None:
        if is_causal or attn_mask.device != q.device:
            return False
        if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
            return False
    return True


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if _sdpa_fused_ok(query, key, value, attn_mask, is_causal, enable_gqa):
        return aten._scaled_dot_product_fused_attention_overrideable(
            query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device
                                ).masked_fill_(attn_mask.logical_not(), float("-inf"))
    return aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
        enable_gqa=enable_gqa)[0]


def _no_nested_tensors(t, mask):
    """Nested tensors have no tpu backend. nn.TransformerEncoder asks this before it packs a
    padded batch into one (inference with a key padding mask); "not left-aligned" makes it take
    its padded path, whose results are the same."""
    return False


def _resize_storage_bytes_(variable, new_size) -> None:
    """inductor::resize_storage_bytes_ (compiled FSDP2 frees and re-allocates parameters with
    it): the storage resize of device/extras.py."""
    variable.untyped_storage().resize_(new_size)


def bind_runtime() -> None:
    if hasattr(torch.ops.inductor, "resize_storage_bytes_"):
        _bind(torch.ops.inductor.resize_storage_bytes_.default, _resize_storage_bytes_)
    for op in VIEW_OPS:
        if op not in _bound and _fastpath.cpu_redispatch(op):  # in C++ where it is built
            _bound.add(op)
        else:
            _bind(op, _redispatch_cpu(op))
    _bind(aten.empty.memory_format, _empty)
    _bind(aten.empty_strided.default, _empty_strided)
    _bind(aten._local_scalar_dense.default, _local_scalar_dense)
    _bind(aten.copy_.default, _copy_kernel)
    _bind(aten._copy_from.default, _copy_from)
    _bind(aten._copy_from_and_resize.default, _copy_from_and_resize)
    _bind(aten.resize_.default, _resize_)
    _bind(aten.equal.default, _equal)
    _bind(aten._nested_tensor_from_mask_left_aligned.default, _no_nested_tensors)
    _bind(aten._amp_foreach_non_finite_check_and_unscale_.default,
          _multi.non_finite_check_and_unscale_)
    _bind(aten._amp_update_scale_.default, _multi.update_scale_)
    for name in ("_fused_adam", "_fused_adamw", "_fused_sgd", "_fused_adagrad"):
        for overload in ("default", "tensor_lr"):
            functional = getattr(getattr(aten, name), overload)
            inplace = getattr(getattr(aten, name + "_"), overload)
            _bind(inplace, _multi.fused_optimizer_(functional, inplace))
    # SDPA routing (see _sdpa above): the autograd key too, so autograd sees the fused op
    _bind(aten.scaled_dot_product_attention.default, _sdpa)
    _lib.impl("scaled_dot_product_attention", skip(_sdpa), "AutogradPrivateUse1")
