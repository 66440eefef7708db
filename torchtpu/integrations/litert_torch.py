"""litert-torch on models that live on "tpu": convert a CPU copy.

litert-torch converts on the host, and its constant cache (``backend.inline_consts``, 0.10.0)
keys a weight by the data pointer of ``tensor.cpu()``. For a weight on an accelerator that is a
temporary copy, freed right after, so its address is reused by the next one: two weights of one
shape could share one entry and the converted model silently held one weight's values in place
of another's (a CNN trained on "tpu": max error 0.13-0.26 in 1 of 2-4 conversions). A module
on the CPU has persistent storages, so the keys are sound there.

``Converter.add_signature`` (where every module reaches litert-torch: ``litert_torch.convert``,
``signature``, ``Converter().signature``) is wrapped: when the module has a parameter or buffer
on "tpu", or a sample input is on "tpu", litert-torch gets a CPU copy of the module and of the
inputs (the user's model stays where it is); anything else is passed through unchanged.
"""
from __future__ import annotations

import copy
import functools

from .hooks import bind, patch, when_imported


def _on_tpu(module, args, kwargs) -> bool:
    import torch

    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)]
    if isinstance(module, torch.nn.Module):
        tensors += list(module.parameters()) + list(module.buffers())
    return any(t.device.type == "tpu" for t in tensors)


def _to_cpu(x):
    import torch

    return torch.utils._pytree.tree_map(
        lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, x)


def _wrap(orig):
    @functools.wraps(orig)
    def add_signature(self, *args, **kwargs):
        b = bind(orig, (self, *args), kwargs)
        if b is None or not _on_tpu(b.arguments.get("module"), b.arguments.get("sample_args"),
                                    b.arguments.get("sample_kwargs")):
            return orig(self, *args, **kwargs)
        import torch

        module = b.arguments["module"]
        if isinstance(module, torch.nn.Module):
            module = copy.deepcopy(module).to("cpu")
        b.arguments["module"] = module
        for name in ("sample_args", "sample_kwargs"):
            if b.arguments.get(name) is not None:
                b.arguments[name] = _to_cpu(b.arguments[name])
        return orig(*b.args, **b.kwargs)

    return add_signature


def _patch(mod) -> None:
    patch(mod, "Converter.add_signature", _wrap,
          params=("module", "sample_args", "sample_kwargs"))


def install() -> None:
    when_imported("litert_torch._convert.interface", _patch)
