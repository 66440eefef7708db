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
    from . import dynamo_compat
    from .disagg import install

    install()  # the "torchtpu" KV transfer backend (prefill/decode disaggregation)
    # plain-class twins of the layer-boundary records, before any model is built: no graph
    # break inside a compiled forward (dynamo_compat.py)
    dynamo_compat.install()
    from .prefill import install as install_prefill

    install_prefill()  # extend steps through bucketed compiled programs (prefill.py)
    if os.environ.get("TORCHTPU_SGLANG_METRICS_FILE"):
        HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner.forward",
                              _write_metrics, HookType.AFTER)


_forwards = {"decode": 0, "extend": 0, "other": 0}
_per_kind: dict = {}
_last: dict = {}
_per_kind_ops: dict = {}
_intervals: dict = {}
_prev_kind = "start"
_prev_t = None
_last_ops: dict = {}


def _write_metrics(result, runner, forward_batch, *args, **kwargs):
    """After each model forward of a worker: its ``torch.tpu.metrics()`` counters and forward
    counts, to ``$TORCHTPU_SGLANG_METRICS_FILE.<rank>`` (benchmarks read compiles and host
    syncs per step from it; the workers are SGLang's subprocesses). ``per_kind`` charges the
    counters' growth since the previous forward ended (the previous step's sampling and
    bookkeeping, then this forward) to ``decode`` when both forwards are decode steps (a
    decode step in steady state), else to ``<previous>-><this>`` (e.g. ``extend->decode``:
    what follows a prefill, the radix cache's insertions included); ``intervals`` counts
    them; ``forwards["graph"]`` counts the forwards the decode graph runner served. Opt-in: a
    file write per step."""
    import json
    import time

    import torch

    global _prev_kind, _prev_t
    now = time.perf_counter()
    mode = forward_batch.forward_mode
    kind = "decode" if mode.is_decode() else "extend" if mode.is_extend() else "other"
    _forwards[kind] += 1
    key = kind if _prev_kind == kind else f"{_prev_kind}->{kind}"
    _prev_kind = kind
    _intervals[key] = _intervals.get(key, 0) + 1
    snap = torch.tpu.metrics()
    counters = snap["counters"]
    acc = _per_kind.setdefault(key, {})
    for k, v in counters.items():
        d = v - _last.get(k, 0)
        if d:
            acc[k] = acc.get(k, 0) + d
    if _prev_t is not None:  # wall time of the interval, in microseconds
        acc["wall_us"] = acc.get("wall_us", 0) + int((now - _prev_t) * 1e6)
    _prev_t = now
    _last.clear()
    _last.update(counters)
    ops = snap["per_op"].get("eager_compiles", {})
    acc = _per_kind_ops.setdefault(key, {})
    for op, v in ops.items():
        d = v - _last_ops.get(op, 0)
        if d:
            acc[op] = acc.get(op, 0) + d
    _last_ops.clear()
    _last_ops.update(ops)
    if getattr(result, "can_run_graph", False):
        _forwards["graph"] = _forwards.get("graph", 0) + 1
    prefill = getattr(runner, "_torchtpu_prefill", None)
    if prefill is not None:
        _forwards["prefill_graph"] = prefill.served
    path = f"{os.environ['TORCHTPU_SGLANG_METRICS_FILE']}.{os.environ.get('RANK', '0')}"
    with open(path + ".tmp", "w") as f:
        json.dump({"forwards": _forwards, "intervals": _intervals, "counters": counters,
                   "per_kind": _per_kind, "per_op": snap["per_op"],
                   "per_kind_eager_compiles": _per_kind_ops,
                   "attention": type(runner.attn_backend).__name__,
                   "kv_pool": type(runner.token_to_kv_pool).__name__,
                   "graph_runner": type(runner.decode_cuda_graph_runner).__name__,
                   "graph_dynamo": {str(k): v for k, v in (getattr(
                       runner.decode_cuda_graph_runner, "dynamo", None) or {}).items()},
                   "prefill_dynamo": dict(getattr(getattr(runner, "_torchtpu_prefill", None),
                                                  "dynamo", None) or {}),
                   "graph_bs": list(getattr(runner.decode_cuda_graph_runner, "capture_bs",
                                            None) or [])}, f)
    os.replace(path + ".tmp", path)
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
