"""Public namespaces hold only public names: ``torch.tpu``, ``torch.tpu.ops`` and the other
modules under ``torch.tpu``, and every ``__all__`` of ``torchtpu``'s packages, each against an
explicit list. A module-level ``import os`` (or ``jax``, ``torch``, ``functools``, a
``from __future__ import annotations``...) in one of them shows up here: import such things
under a private name (``import os as _os``).

A name added to the API is added to its list below. ``COMING`` lists names that work in progress
adds (they may or may not be there yet): once they have landed, move them into the lists.
"""
import types

import pytest
import torch

import torchtpu

TORCH_TPU = {
    # the torch.cuda-like device module
    "Event", "Stream", "StreamContext", "current_device", "current_stream", "default_generator",
    "default_generators", "default_stream", "device", "device_count", "device_of", "empty_cache",
    "get_amp_supported_dtype", "get_device_capability", "get_device_name",
    "get_device_properties", "get_rng_state", "get_rng_state_all", "initial_seed",
    "is_available", "is_bf16_supported", "is_current_stream_capturing", "is_initialized",
    "manual_seed", "manual_seed_all", "max_memory_allocated", "max_memory_reserved",
    "mem_get_info", "memory_allocated", "memory_reserved", "memory_stats", "memory_summary",
    "reset_accumulated_memory_stats", "reset_peak_memory_stats", "seed", "seed_all",
    "set_device", "set_rng_state", "set_rng_state_all", "set_stream", "stream", "synchronize",
    "set_sync_debug_mode", "get_sync_debug_mode", "init", "ipc_collect",
    "reset_max_memory_allocated", "OutOfMemoryError",
    # TorchTPU's own names
    "EagerMode", "get_eager_mode", "set_eager_mode", "Precision", "precision", "metrics",
    "reset_metrics", "peak_flops",
    # submodules
    "amp", "compiler", "export", "ops", "optimizers", "pallas", "profiler",
    "topology_aware_mesh",
}
TORCH_TPU_PROPERTIES = {"eager_mode", "enable_cpu_fallback"}
TORCH_TPU_COMING: set = set()

TORCH_TPU_OPS = {"kv_cache_update_", "ragged_dot", "ragged_paged_attention", "splash_sdpa",
                 "optimization_barrier", "all_gather_dim", "reduce_scatter_dim",
                 "ragged_all_to_all", "send", "recv", "max_pool"}
TORCH_TPU_OPS_COMING: set = set()

# torch.tpu's submodules: what each shows (its __all__, where it has one)
SUBMODULES = {
    "amp": {"GradScaler", "autocast", "custom_bwd", "custom_fwd"},
    "compiler": {"backend", "cache_dir", "custom_compiler_options",
                 "get_custom_compiler_options", "set_dynamic_buckets"},
    "profiler": {"TpuProfilerConfig", "get_config", "metrics_region", "profile", "set_config",
                 "tensorboard_trace_handler", "trace"},
    "pallas": {"NAMESPACE", "jax_op"},
    "optimizers": {"Adam", "AdamW", "Muon", "SGD", "SingleTraceTrainer", "functional"},
    "export": {"ExportError", "StableHLOExportOptions", "StableHLOGraphModule", "export_function",
               "exported_program_to_stablehlo", "load", "to_litert"},
}
# the export package's modules (torch.tpu.export.stablehlo / .litert / .artifact)
SUBMODULE_MODULES = {"export": {"artifact", "litert", "stablehlo"},
                     "optimizers": {"optimizer", "partition", "program", "trainer", "update"}}

# every __all__ of torchtpu's packages: (names, names still coming)
ALL = {
    "torchtpu": ({"__version__"}, set()),
    "torchtpu.compile": ({"compiler", "register_backend"}, set()),
    "torchtpu.distributed": ({"register", "auto_parallelize", "Plan"}, set()),
    "torchtpu.export": (SUBMODULES["export"], set()),
    "torchtpu.integrations": ({"STATUS", "bind", "install", "patch", "skipped",
                               "tpu_is_accelerator", "when_imported"}, set()),
    "torchtpu.ops": (TORCH_TPU_OPS, TORCH_TPU_OPS_COMING),
    "torchtpu.pallas": (SUBMODULES["pallas"], set()),
    "torchtpu.optimizers": (SUBMODULES["optimizers"], set()),
    "torchtpu.profiler": (SUBMODULES["profiler"], set()),
    "torchtpu.device.amp": (SUBMODULES["amp"], set()),
    "torchtpu.compile.compiler": (SUBMODULES["compiler"], set()),
}


def _public(module) -> set:
    return {n for n in dir(module) if not n.startswith("_")}


def _own_submodules(module) -> set:
    """Names that are the package's own modules (``torch.tpu.ops.moe``: an op family)."""
    prefix = module.__name__ + "."
    return {n for n in _public(module) if isinstance(getattr(module, n), types.ModuleType)
            and getattr(module, n).__name__.startswith(prefix)}


def _check(actual: set, expected: set, coming: set = frozenset()) -> None:
    missing, extra = expected - actual, actual - expected - coming
    assert not missing and not extra, f"missing: {sorted(missing)}, not public: {sorted(extra)}"


def test_torch_tpu_namespace():
    _check(_public(torch.tpu), TORCH_TPU, TORCH_TPU_COMING)
    for name in TORCH_TPU_PROPERTIES:
        assert hasattr(torch.tpu, name)
    for name in ("os", "functools", "threading", "torch", "jax", "annotations", "sys"):
        assert not hasattr(torch.tpu, name), name


def test_torch_tpu_ops_namespace():
    ops = torch.tpu.ops
    assert ops is torchtpu.ops
    # its op families are its own modules (torch.tpu.ops.moe...); everything else is an op
    _check(_public(ops) - _own_submodules(ops), TORCH_TPU_OPS, TORCH_TPU_OPS_COMING)
    for name in ("importlib", "pkgutil", "annotations"):
        assert not hasattr(ops, name), name


@pytest.mark.parametrize("name", sorted(SUBMODULES))
def test_torch_tpu_submodules(name):
    mod = getattr(torch.tpu, name)
    _check(_public(mod), SUBMODULES[name] | SUBMODULE_MODULES.get(name, set()))


@pytest.mark.parametrize("modname", sorted(ALL))
def test_dunder_all(modname):
    import importlib

    mod = importlib.import_module(modname)
    expected, coming = ALL[modname]
    assert len(mod.__all__) == len(set(mod.__all__)), mod.__all__
    _check(set(mod.__all__), expected, coming)
    for name in mod.__all__:
        assert hasattr(mod, name), f"{modname}.__all__ names {name!r}, which it lacks"
