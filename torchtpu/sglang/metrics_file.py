"""A worker's per-forward counters, for benchmarks and tests (``TORCHTPU_SGLANG_METRICS_FILE``).

SGLang's model runs in scheduler subprocesses, so a benchmark or a test cannot call
``torch.tpu.metrics()`` there. With ``TORCHTPU_SGLANG_METRICS_FILE=<base>`` set, each worker
keeps, after every model forward (a hook after ``ModelRunner.forward``), the growth of its
counters per kind of step in memory (no file, no JSON: the step's time is not charged for
it), and writes ``<base>.<rank>`` only when asked: ``read(base)`` leaves a request
(``<base>.<rank>.req``, a fresh token) and waits for the file to carry that token; the worker
answers from a hook after the scheduler's ``on_idle`` (it is idle once the requests the
reader waited for are done), or after its next forward.

The file holds: ``forwards`` (decode / extend / other forwards; ``graph``: those the decode
graph runner served; ``prefill_graph``: extend steps through compiled buckets), ``counters``
(``torch.tpu.metrics()``), ``per_kind`` (the counters' growth since the previous forward
ended: the previous step's sampling and bookkeeping, then this forward, charged to ``decode``
when both forwards are decode steps, else to ``<previous>-><this>``, e.g. ``extend->decode``;
``wall_us``: its wall time), ``intervals`` (how many of each), ``per_kind_eager_compiles``,
``per_op`` and the worker's attention, pool and graph-runner classes and buckets.
"""
from __future__ import annotations

import json
import os
import time

_forwards = {"decode": 0, "extend": 0, "other": 0}
_per_kind: dict = {}
_last: dict = {}
_per_kind_ops: dict = {}
_intervals: dict = {}
_last_ops: dict = {}
_state = {"prev_kind": "start", "prev_t": None, "runner": None, "served": None}


def _path() -> str:
    return f"{os.environ['TORCHTPU_SGLANG_METRICS_FILE']}.{os.environ.get('RANK', '0')}"


def _grow(acc: dict, now: dict, last: dict) -> None:
    for k, v in now.items():
        d = v - last.get(k, 0)
        if d:
            acc[k] = acc.get(k, 0) + d
    last.clear()
    last.update(now)


def after_forward(result, runner, forward_batch, *args, **kwargs):
    """After each model forward: the counters' growth charged to the step's kind, in memory."""
    now = time.perf_counter()
    mode = forward_batch.forward_mode
    kind = "decode" if mode.is_decode() else "extend" if mode.is_extend() else "other"
    _forwards[kind] += 1
    prev = _state["prev_kind"]
    key = kind if prev == kind else f"{prev}->{kind}"
    _state["prev_kind"] = kind
    _intervals[key] = _intervals.get(key, 0) + 1
    acc = _charge(key)
    if _state["prev_t"] is not None:  # wall time of the interval, in microseconds
        acc["wall_us"] = acc.get("wall_us", 0) + int((now - _state["prev_t"]) * 1e6)
    _state["prev_t"] = now
    if getattr(result, "can_run_graph", False):
        _forwards["graph"] = _forwards.get("graph", 0) + 1
    _state["runner"] = runner
    _answer()
    return None


def _charge(key: str) -> dict:
    """The counters' growth since the last charge, added to ``key``'s."""
    from torchtpu.runtime import metrics

    with metrics._lock:
        counters = dict(metrics.COUNTERS)
        ops = dict(metrics.PER_OP.get("eager_compiles", {}))
    acc = _per_kind.setdefault(key, {})
    _grow(acc, counters, _last)
    _grow(_per_kind_ops.setdefault(key, {}), ops, _last_ops)
    return acc


def set_aside(key: str) -> None:
    """Work between two forwards that is no step's (a bucket warmed while the scheduler
    idles, working_set.py): its counters charged to ``key``, not to the next forward's."""
    if not os.environ.get("TORCHTPU_SGLANG_METRICS_FILE"):
        return
    _charge(key)
    _intervals[key] = _intervals.get(key, 0) + 1
    _state["prev_t"] = time.perf_counter()


def after_idle(result, *args, **kwargs):
    """After the scheduler's idle housekeeping: answer a pending request."""
    _answer()
    return None


def _answer() -> None:
    path = _path()
    try:
        with open(path + ".req") as f:
            token = f.read()
    except FileNotFoundError:
        return
    if token and token != _state["served"]:
        write(token)


def snapshot() -> dict:
    import torch

    snap = torch.tpu.metrics()
    out = {"forwards": dict(_forwards), "intervals": _intervals, "counters": snap["counters"],
           "per_kind": _per_kind, "per_op": snap["per_op"],
           "per_kind_eager_compiles": _per_kind_ops}
    runner = _state["runner"]
    if runner is not None:
        from . import working_set

        prefill = getattr(runner, "_torchtpu_prefill", None)
        if prefill is not None:
            out["forwards"]["prefill_graph"] = prefill.served
        graphs = runner.decode_cuda_graph_runner
        pages = getattr(runner.token_to_kv_pool, "kv_pages", None)
        out.update({
            "attention": type(runner.attn_backend).__name__,
            "kv_pool": type(runner.token_to_kv_pool).__name__,
            "kv_dtype": str(pages[0].dtype) if pages else None,  # as stored (kv_pool.py)
            "max_total_num_tokens": getattr(runner, "max_total_num_tokens", None),
            "graph_runner": type(graphs).__name__,
            "graph_dynamo": {str(k): v for k, v in (getattr(graphs, "dynamo", None)
                                                     or {}).items()},
            "prefill_dynamo": dict(getattr(prefill, "dynamo", None) or {}),
            "prefill_warm_up_s": getattr(prefill, "warm_up_s", None),
            "prefill_warmed": list(getattr(prefill, "warmed", None) or []),
            "decode_warm_up_s": getattr(graphs, "warm_up_s", None),
            "deferred": {"decode": list(getattr(graphs, "deferred", None) or []),
                         "prefill": list(getattr(prefill, "deferred", None) or []),
                         "pending": working_set.pending(), **working_set._STATS},
            "graph_bs": list(getattr(graphs, "capture_bs", None) or [])})
    return out


def write(token: str = "") -> None:
    """``<base>.<rank>`` now (tmp + rename), carrying ``token``."""
    path = _path()
    data = snapshot()
    data["token"] = token
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
    _state["served"] = token


def read(base: str | None = None, rank: int = 0, timeout: float = 120.0) -> dict:
    """Ask worker ``rank`` for its counters and wait for them (called outside the worker)."""
    path = f"{base or os.environ['TORCHTPU_SGLANG_METRICS_FILE']}.{rank}"
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    with open(path + ".req.tmp", "w") as f:
        f.write(token)
    os.replace(path + ".req.tmp", path + ".req")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("token") == token:
                return data
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"SGLang worker {rank} did not write its metrics to {path} "
                               f"within {timeout:.0f} s (is TORCHTPU_SGLANG_METRICS_FILE set "
                               "in the engine's environment?)")
        time.sleep(0.01)
