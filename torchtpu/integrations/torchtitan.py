"""TorchTitan on "tpu" without Triton.

TorchTitan picks its device and process group by itself: ``torchtitan.tools.utils`` asks
``torch._utils._get_available_device_type()``, which returns the PrivateUse1 name ("tpu") once
``torch.tpu.is_available()``, and ``init_distributed`` takes the backend from
``torch.distributed.Backend.default_device_backend_map["tpu"]`` ("tpu_dist"). Its
FlexAttention is ``torch.compile(flex_attention)`` with the default backend: graphs on "tpu"
go to the tpu compiler (``compile/__init__.py``), which lowers the ``flex_attention`` HOPs
(``lowering/flex_attention.py``); the device allowlist is ``flex_attention.py``'s patch.

What remains is an import: every model (``torchtitan.models.common`` -> MoE -> token
dispatcher) imports ``torchtitan.distributed.minimal_async_ep.kernels``, which runs
``import triton`` (~1 GB, CUDA-only kernels for expert parallelism over symmetric memory).
When Triton is not installed, that one module is served by a finder here as a module whose
attributes are functions raising a RuntimeError that names the missing kernel and Triton;
nothing else changes. Dense models (llama3) never call them. With Triton installed, TorchTitan's
own module loads.

Its MoE combine is a custom op, ``torchtitan::deterministic_scatter_add``: once
``torchtitan.ops.scatter_add`` is imported, compiled graphs get a lowering for it
(``_lower_scatter_add``).

CUDA graphs: TorchTitan captures its forward/backward in a CUDA graph unless
``--training.disable_cuda_graphs`` is given, and its config check refuses pipeline parallelism
(and expert parallelism's all-to-all dispatcher) while they are on. Off NVIDIA CUDA its
``wrap_with_cuda_graph`` already runs the step eagerly, so on "tpu" they do nothing: the check
sees ``disable_cuda_graphs`` set whenever TorchTitan's device is "tpu" (``_no_cuda_graphs``),
and ``--parallelism.pipeline_parallel_degree`` works without the flag.

Pipeline parallelism: TorchTitan 0.3.0 hands its schedule microbatches it split itself
(``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, a newer PyTorch's signature);
torch 2.13's ``step`` takes only the whole batch and would pass those lists to the model as
keyword arguments (on CPU too). ``schedules_take_microbatches`` lets ``step`` take them, running
the schedule's own ``_step_microbatches`` on them, when the installed ``step`` lacks them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(
            f"TorchTitan's {KERNELS}.{name} is a Triton kernel (CUDA expert parallelism over "
            "symmetric memory) and Triton is not installed; it cannot run on 'tpu'")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


class _KernelsLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = types.ModuleType(spec.name)

        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _missing(name)

        mod.__getattr__ = __getattr__
        mod.__doc__ = "Stand-in for TorchTitan's Triton kernels when Triton is absent " \
                      "(torchtpu.integrations.torchtitan); every kernel raises RuntimeError."
        return mod

    def exec_module(self, module):
        pass


class _KernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != KERNELS or triton_available():
            return None
        return importlib.machinery.ModuleSpec(name, _KernelsLoader())


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_finder = _KernelsFinder()


SCATTER_ADD = "torchtitan.ops.scatter_add"


def _lower_scatter_add(module) -> None:
    """``torchtitan::deterministic_scatter_add`` (its MoE combine: ``out.scatter_add(0, index,
    src)`` with deterministic algorithms on) in compiled graphs: the aten ``scatter_add``
    lowering, with its index check (XLA's scatter-add is deterministic on CPU and TPU). Eager
    keeps TorchTitan's own kernel, which runs ``scatter_add`` on "tpu". Without this the op ran
    as a CPU callback inside every compiled MoE block."""
    import torch

    from ..lowering import indexing, registry

    op = getattr(getattr(torch.ops, "torchtitan", None), "deterministic_scatter_add", None)
    if op is None or registry.get(op.default) is not None:
        return

    def deterministic_scatter_add(out, index, src):
        return indexing.scatter_add(out, 0, index, src)

    ok, exc, msg = registry.get(torch.ops.aten.scatter_add.default).check
    registry.register(op.default, graph_only=True,
                      check=(lambda out, index, src: ok(out, 0, index, src), exc, msg))(
        deterministic_scatter_add)


TRAINER = "torchtitan.trainer"
_MB_KEYS = ("arg_mbs", "kwarg_mbs", "target_mbs")


def schedules_take_microbatches() -> None:
    """``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step`` accept TorchTitan's
    pre-split ``arg_mbs``, ``kwarg_mbs`` and ``target_mbs`` (what the newer PyTorch TorchTitan
    0.3.0 targets does): the same preamble as ``step`` (stages' ``has_backward``, runtime states
    cleared), then ``_step_microbatches`` on the given lists. Whole-batch calls are unchanged;
    nothing is patched where ``step`` already takes them. Needs no torchtpu import (the CPU
    reference of the tests applies it too)."""
    import inspect

    import torch
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        orig = cls.__dict__["step"]
        if getattr(orig, "_torchtpu", False) or "arg_mbs" in inspect.signature(orig).parameters:
            continue

        def make(orig):
            def step(self, *args, target=None, losses=None, return_outputs=True,
                     loss_kwargs=None, **kwargs):
                if not any(k in kwargs for k in _MB_KEYS):
                    return orig(self, *args, target=target, losses=losses,
                                return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                                **kwargs)
                if args or target is not None or set(kwargs) - set(_MB_KEYS):
                    raise TypeError("step() takes either the whole batch (args, target, "
                                    "kwargs) or microbatches (arg_mbs, kwarg_mbs, target_mbs), "
                                    "not both")
                if self._has_backward and not torch.is_grad_enabled():
                    raise RuntimeError("step() requires gradients to be enabled for backward "
                                       "computation; it should not be used under "
                                       "torch.no_grad() context. Please call eval() instead.")
                stages = getattr(self, "_stages", None) or [self._stage]
                for stage in stages:
                    stage.has_backward = self._has_backward
                    stage.clear_runtime_states()
                self._step_microbatches(kwargs.get("arg_mbs"), kwargs.get("kwarg_mbs"),
                                        kwargs.get("target_mbs"), losses, return_outputs,
                                        loss_kwargs=loss_kwargs)
                for stage in stages:
                    if stage.is_last and return_outputs:
                        return self._merge_outputs(stage.output_chunks)
                return None

            step._torchtpu = True
            step.__doc__ = orig.__doc__
            return step

        cls.step = make(orig)


def _no_cuda_graphs(module) -> None:
    """``Trainer.Config._validate_cuda_graphs`` (run when the config is built and again by the
    trainer) first sets ``training.disable_cuda_graphs`` when TorchTitan's device is "tpu"."""
    from .hooks import patch

    def make(orig):
        def _validate_cuda_graphs(self):
            from torchtitan.tools import utils

            if utils.device_type == "tpu":
                self.training.disable_cuda_graphs = True
            return orig(self)

        return _validate_cuda_graphs

    patch(module, "Trainer.Config._validate_cuda_graphs", make, params=("self",))
    schedules_take_microbatches()


def install() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    if __package__:  # not when a CPU reference loads this file alone for the finder above
        from .hooks import when_imported

        when_imported(SCATTER_ADD, _lower_scatter_add)
        when_imported(TRAINER, _no_cuda_graphs)
