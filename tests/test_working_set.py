"""Warm starts (runtime/working_set.py): a process records the programs it used; the next run of
the same command line loads them ahead on a background thread, compiles nothing, and loads
only what it uses. Another command line sharing the cache folder loads nothing ahead."""
from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys, torch
from torchtpu.runtime import working_set
a = torch.arange(12., device="tpu").reshape(3, 4)
b = (a * 2.5 + 1).sin()
c = (a @ b.t()).sum(dim=1)
with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
    d = (b * 3 - 1).cos().sum()
out = {"c": c.cpu().tolist(), "d": d.item()}
for t in working_set._thread:
    t.join()
out["counters"] = torch.tpu.metrics()["counters"]
out["left"] = len(working_set._ahead)  # loaded ahead, not used
print(json.dumps(out))
"""


def _run(cache, script=SCRIPT, **env):
    e = dict(os.environ, TORCHTPU_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu")
    e.pop("TORCHTPU_WORKING_SET", None)
    e.update(env)
    p = subprocess.run([sys.executable, "-c", script], env=e, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_later_process_loads_its_working_set_ahead(tmp_path):
    cache = tmp_path / "cache"
    cold = _run(cache)
    c0 = cold["counters"]
    assert c0.get("eager_xla_compiles", 0) > 3 and c0.get("fused_xla_compiles", 0) == 1
    assert c0.get("working_set_loads", 0) == 0  # nothing recorded yet
    sets = os.listdir(cache / "working-sets")
    assert len(sets) == 1

    warm = _run(cache)
    w = warm["counters"]
    assert (warm["c"], warm["d"]) == (cold["c"], cold["d"])
    assert w.get("eager_xla_compiles", 0) == 0 and w.get("fused_xla_compiles", 0) == 0
    used = w.get("eager_disk_cache_hits", 0) + w.get("fused_disk_cache_hits", 0)
    assert used == c0["eager_xla_compiles"] + c0["fused_xla_compiles"]
    taken = w.get("eager_working_set_hits", 0) + w.get("fused_working_set_hits", 0)
    # every program was loaded ahead or, when a call needed it first, by that call; none twice
    assert w.get("working_set_loads", 0) == taken and taken > 0
    assert warm["left"] == 0  # loaded only what it used
    # each loaded ahead was also run once ahead (runtime/first_run.py: no custom calls here);
    # the results above are the cold process's all the same
    assert w.get("working_set_first_runs", 0) == taken

    other = _run(cache, SCRIPT.replace("2.5", "3.5"))  # another command line: its own set
    assert other["counters"].get("working_set_loads", 0) == 0
    off = _run(cache, TORCHTPU_WORKING_SET="0")
    assert off["counters"].get("working_set_loads", 0) == 0
    assert off["counters"].get("eager_xla_compiles", 0) == 0
    assert len(os.listdir(cache / "working-sets")) == 2  # the first command line's, the other's


IMPORT_ONLY = r"""
import json, os, torch
from jax._src import xla_bridge
from torchtpu.runtime import working_set
out = {"backend": bool(xla_bridge._backends), "thread": bool(working_set._thread),
       "counters": dict(torch.tpu.metrics()["counters"])}
if os.environ.get("WORLD_SIZE", "1") == "1":  # a rank of a job would join first: not here
    torch.ones(2, device="tpu").add_(1).cpu()
print(json.dumps(out))
"""


def test_a_multi_process_job_creates_no_backend_at_import(tmp_path):
    """A rank of a torchrun job must create its backend only after the job joined one cluster:
    loading its working set at import would create it first (rank 1 then found no device of
    its own at the join: KeyError in rank_device). Recorded or not, the import leaves it alone."""
    cache = tmp_path / "cache"
    first = _run(cache, IMPORT_ONLY)
    assert not first["backend"] and not first["thread"]
    again = _run(cache, IMPORT_ONLY)  # the same command line: its working set is recorded
    assert again["thread"] and again["backend"]  # single process: loaded ahead
    rank = _run(cache, IMPORT_ONLY, WORLD_SIZE="2", RANK="1")
    assert not rank["backend"] and not rank["thread"]
    assert rank["counters"].get("working_set_skipped", 0) == 1


FUSED = r"""
import json, torch
torch.manual_seed(0)
x = torch.arange(24., device="tpu").reshape(4, 6)
idx = torch.tensor([3, 0, 2], device="tpu")
with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
    y = (x * 2.5 + 1).sin()
    z = y.t() @ y[:, 1:]  # views, a matmul
    v, i = z.max(dim=1)  # two outputs
    a, b = torch.split(z, [2, 4])  # a list of outputs
    y.add_(torch.rand(4, 6, device="tpu"))  # in place, random
    g = y.index_select(0, idx)  # a checked op (index bounds)
    w = torch.cat([v, i.float(), a.sum(0), b.mean(0), g.flatten()]).softmax(-1)
    out = w.cpu().tolist()
c = torch.tpu.metrics()["counters"]
print(json.dumps({"out": out, "counters": c}))
"""


def test_a_warm_fused_process_traces_and_compiles_nothing(tmp_path):
    """Fused recording needs each op's output shapes; a later process finds them in the cache
    folder (eager/fused_shapes.py), as it finds the programs: no eval_shape trace, no compile,
    with or without the working set loaded ahead."""
    cache = tmp_path / "cache"
    cold = _run(cache, FUSED)
    c0 = cold["counters"]
    assert c0.get("fused_op_traces", 0) >= 8 and c0.get("fused_xla_compiles", 0) >= 1
    assert len(os.listdir(cache / "fused-shapes")) == 1
    for env in ({}, {"TORCHTPU_WORKING_SET": "0"}):
        warm = _run(cache, FUSED, **env)
        w = warm["counters"]
        assert warm["out"] == cold["out"]
        assert w.get("fused_op_traces", 0) == 0, w
        assert w.get("fused_op_shapes_loaded", 0) == c0["fused_op_traces"]
        assert w.get("fused_xla_compiles", 0) == 0 and w.get("eager_xla_compiles", 0) == 0
    off = _run(cache, FUSED, TORCHTPU_FUSED_SHAPE_CACHE="0")  # the shapes traced again
    assert off["out"] == cold["out"]
    assert off["counters"].get("fused_op_traces", 0) == c0["fused_op_traces"]


GROWING = r"""
import json, os, torch
from torchtpu.runtime import prefetch
calls = [0]
predict = prefetch.predict


def counted(history, sig):
    calls[0] += 1
    return predict(history, sig)


prefetch.predict = counted
x = torch.ones(2, 3, device="tpu")
for i in range(int(os.environ["STEPS"])):
    x = torch.cat([x, x[:, -1:] + 1], dim=1)  # a growing signature: its next one is guessed
c = torch.tpu.metrics()["counters"]
print(json.dumps({"out": x.cpu().tolist(), "guesses": calls[0], "counters": c}))
"""


def test_a_warm_process_guesses_no_signature_its_working_set_holds(tmp_path):
    """A program the working set loaded ahead grows no guess (its progression's next executable
    is loaded ahead too: building its disk key to find that out cost a warm generate's first
    call ~0.2 ms a miss); past what the last run used, guessing resumes."""
    import torch

    cache = tmp_path / "cache"
    env = {"TORCHTPU_WORKING_SET": "growing", "STEPS": "8"}
    cold = _run(cache, GROWING, **env)
    ref = torch.ones(2, 3)
    for _ in range(12):
        ref = torch.cat([ref, ref[:, -1:] + 1], dim=1)
    assert cold["out"] == ref[:, :11].tolist()
    assert cold["guesses"] > 0 and cold["counters"].get("eager_prefetches", 0) > 0
    warm = _run(cache, GROWING, **env)
    w = warm["counters"]
    assert warm["out"] == cold["out"]
    assert w.get("eager_xla_compiles", 0) == 0 and w.get("working_set_loads", 0) > 0
    assert warm["guesses"] == 0
    longer = _run(cache, GROWING, **dict(env, STEPS="12"))  # beyond the recorded set
    assert longer["out"] == ref.tolist()
    assert longer["guesses"] > 0 and longer["counters"].get("eager_prefetch_hits", 0) > 0
    off = _run(cache, GROWING, **dict(env, TORCHTPU_WORKING_SET="0"))  # loaded on demand
    assert off["out"] == cold["out"] and off["guesses"] > 0
