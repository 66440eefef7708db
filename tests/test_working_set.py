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


SPAWNED = r"""
import json, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r, world, port, q):
    from jax._src import xla_bridge
    from torchtpu.runtime import working_set
    backend_at_import = bool(xla_bridge._backends)
    if world > 1:  # no WORLD_SIZE in the environment: the rank joins by itself, as vLLM's do
        dist.init_process_group("tpu_dist", init_method=f"tcp://127.0.0.1:{port}", rank=r,
                                world_size=world)
    y = ((torch.arange(6., device="tpu") * 2.5 + 1).sin() * (r + 1)).sum(0, keepdim=True)
    if world > 1:
        dist.all_reduce(y)
    for t in working_set._thread:
        t.join()
    q.put([r, backend_at_import, y.cpu().tolist(), dict(torch.tpu.metrics()["counters"])])
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, port = int(sys.argv[1]), int(sys.argv[2])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, world, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = sorted(q.get(timeout=200) for _ in ps)
    for p in ps:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in ps), [p.exitcode for p in ps]
    print(json.dumps(got))
"""


def test_a_spawned_rank_that_joins_later_is_not_blocked_by_its_working_set(tmp_path):
    """vLLM's tensor-parallel workers and ``mp.spawn``'s ranks are spawned children that call
    init_process_group themselves, with no WORLD_SIZE in their environment. Once a run of the
    same command line had recorded a working set, loading it at import created the backend and
    the next run's join failed ("init_process_group must run before the first use"). A spawned
    child now creates nothing at import; its first device use loads the set ahead, unless that
    use is a job's (whose ranks neither load nor record a set)."""
    import torch
    from dist_launch import free_port

    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    cache = tmp_path / "cache"
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu",
               TORCHTPU_WORKING_SET="spawned-ranks")  # both runs' children: one set
    for v in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "XLA_FLAGS"):
        env.pop(v, None)

    def run(world):
        p = subprocess.run([sys.executable, str(script), str(world), str(free_port())],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    solo = run(1)  # records the set
    (recorded,) = (cache / "working-sets").iterdir()
    before = recorded.read_bytes()
    joined = run(2)  # before: both ranks failed at the join
    assert recorded.read_bytes() == before  # a job's ranks leave the set alone
    for r, at_import, y, c in joined:
        assert not at_import
        assert c.get("working_set_skipped", 0) == 1 and not c.get("working_set_loads")
        # the all-reduce's float32 sum of the two ranks' values
        assert y == (torch.tensor(solo[0][2]) + torch.tensor(solo[1][2])).tolist()
    again = run(1)
    for (r, at_import, y, c), before in zip(again, solo):
        assert not at_import and y == before[2]
        assert c.get("working_set_deferred_starts", 0) == 1 and c.get("working_set_loads", 0) > 0
