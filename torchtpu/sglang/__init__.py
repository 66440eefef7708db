"""SGLang on "tpu": an out-of-tree SGLang platform (``sglang.srt.platforms`` entry point).

SGLang (0.5.21+) resolves its platform once per process, when its modules are first imported,
from the plugins registered under the entry-point group ``sglang.srt.platforms``. ``activate``
is that entry point: it answers with the platform class only where the user asked for "tpu"
(``SGLANG_PLATFORM=tpu``, SGLang's own selector), or where SGLang has no device of its own
(no CUDA/ROCm, XPU or NPU torch, and not ``SGLANG_USE_CPU_ENGINE=1``), so installing torchtpu
never takes a GPU host's SGLang away from it. ``TORCHTPU_SGLANG=0`` turns it off.

``plugin`` (entry-point group ``sglang.srt.plugins``) makes tensor parallelism join its job the
way torchtpu needs: each rank is one process whose JAX backend must be created only after it
joined the job, but SGLang selects the rank's device (``set_device(gpu_id)``) before it calls
``init_process_group``. A hook before SGLang's ``init_parallel_runtime`` gives the rank
``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` so that this first device use joins the job, at the
coordinator address the platform chose in the launching process (``TpuSRTPlatform.
apply_server_args_defaults``); ``init_process_group("tpu_dist")`` then finds it joined.
"""
from __future__ import annotations

import os

PLATFORM = "torchtpu.sglang.platform.TpuSRTPlatform"


def _sglang_has_own_device() -> bool:
    import torch

    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        return True
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def activate() -> str | None:
    """The ``sglang.srt.platforms`` entry point: the platform's qualified name, or None."""
    if os.environ.get("TORCHTPU_SGLANG", "1") == "0":
        return None
    if os.environ.get("SGLANG_PLATFORM") != "tpu" and _sglang_has_own_device():
        return None
    import torchtpu  # noqa: F401  (registers the device if torch's autoload did not)

    # no device query here: it would create the JAX backend, which a tensor-parallel rank
    # must not do before it joins its job (init_process_group)
    return PLATFORM


def _active() -> bool:
    from sglang.srt.platforms import current_platform

    return current_platform.__class__.__module__ + "." + type(current_platform).__name__ == PLATFORM


def plugin() -> None:
    """The ``sglang.srt.plugins`` entry point: hooks SGLang calls in every process."""
    if not _active():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.distributed.bootstrap.init_parallel_runtime",
                          _rank_env, HookType.BEFORE)
    if os.environ.get("TORCHTPU_SGLANG_DEFER_NOVEL_OPS", "0") == "1":  # opt-in: see below
        from torchtpu.eager import deferred

        # the scheduler's bookkeeping ops (allocator, sampler, batch merges) take new shapes
        # with every batch composition: a new one runs on the host, exactly, while its program
        # builds on a worker, instead of compiling inside a request (eager/deferred.py).
        # TORCHTPU_SGLANG_DEFER_HOLD=1: held until the scheduler idles (working_set.
        # warm_if_idle) or the shape comes again: no compile beside a burst of new shapes,
        # but a steady shape runs on the host until its second step. Opt-in: with it on, the
        # engine check's steady decode steps still ran one bookkeeping call each on the host
        # (a host sync each; not yet explained), so the default suite's one sync per step
        # failed
        deferred.enable(True, hold=os.environ.get("TORCHTPU_SGLANG_DEFER_HOLD") == "1")
    from . import dynamo_compat
    from .disagg import install

    install()  # the "torchtpu" KV transfer backend (prefill/decode disaggregation)
    # plain-class twins of the layer-boundary records, before any model is built: no graph
    # break inside a compiled forward (dynamo_compat.py)
    dynamo_compat.install()
    from .prefill import install as install_prefill

    install_prefill()  # extend steps through bucketed compiled programs (prefill.py)
    # buckets the last run did not serve are warmed while the scheduler idles (working_set.py)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.on_idle", _idle_warm_up,
                          HookType.AFTER)
    from .input_check import check_prompt_ids

    # a prompt token id outside the vocabulary: a 400, not a scheduler crash (input_check.py)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager."
                          "_validate_one_request", check_prompt_ids, HookType.BEFORE)
    from .kv_pool import budget_bytes

    # a 16-bit model's pool is stored as float32 on XLA:CPU: SGLang's KV byte budget halved
    # for it (kv_pool.py)
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
                          "_profile_available_bytes", budget_bytes, HookType.AFTER)
    from .positions import compute_position

    # an extend step's positions from the host's arithmetic, not eager ops per request
    # (positions.py)
    HookRegistry.register("sglang.srt.model_executor.forward_batch_info.compute_position",
                          compute_position, HookType.AROUND)
    from .overlap import enable as enable_async_copy

    # overlap scheduling: the step's result read back on SGLang's copy thread, not the
    # scheduler's (overlap.py)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.init_overlap",
                          enable_async_copy, HookType.AFTER)
    if os.environ.get("TORCHTPU_SGLANG_METRICS_FILE"):
        # counters per forward in memory, written when a reader asks (metrics_file.py)
        from . import metrics_file

        HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.forward",
                              metrics_file.after_forward, HookType.AFTER)
        HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.on_idle",
                              metrics_file.after_idle, HookType.AFTER)


def _idle_warm_up(result, scheduler, *args, **kwargs):
    """After ``Scheduler.on_idle``: one deferred bucket (working_set.py), its counters charged
    to ``idle_warm_up`` in the metrics file, not to the next step."""
    from . import metrics_file, working_set

    if working_set.warm_if_idle(scheduler):
        metrics_file.set_aside("idle_warm_up")
    return None


def _rank_env(*args, **kwargs):
    """Before SGLang sets up a rank: the job's size and this rank for torchtpu's bootstrap."""
    from sglang.srt.runtime_context import get_device, get_parallel

    p = get_parallel()
    world = p.tp_size * p.pp_size
    if world > 1:
        os.environ["WORLD_SIZE"] = str(world)
        os.environ["RANK"] = str(p.tp_size * p.pp_rank + p.tp_rank)
        os.environ["LOCAL_RANK"] = str(get_device().gpu_id)
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    return None
