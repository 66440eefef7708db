"""A long session keeps its loaded XLA code bounded (runtime/program_cache.py ``MAX_LIVE``).

Every XLA:CPU executable maps its JIT-compiled code into the process for as long as it lives,
and Linux allows ``vm.max_map_count`` (65530) mappings per process: the test suite in one
process made ~20000 programs, ran out of mappings and died with SIGSEGV inside XLA. Programs
past the budget are dropped oldest first (and freed: JAX's own caches no longer keep them),
and a later call reloads them from the compile cache folder with the same numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, gc, torch, torchtpu
    from torchtpu.runtime import program_cache as pc

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    def work(n):
        x = torch.arange(n, dtype=torch.float32, device="tpu")
        return ((x * 3 + 1).sin().sum()).item()

    work(1)
    gc.collect()
    base = maps()
    first = [work(n) for n in range(2, 152)]  # ~5 programs per length: 750 programs
    gc.collect()
    grown = maps() - base
    again = [work(n) for n in range(2, 152)]  # evicted ones come back from the cache folder
    want = [torch.arange(n, dtype=torch.float32).mul(3).add(1).sin().sum().item()
            for n in range(2, 152)]
    c = torch.tpu.metrics()["counters"]
    print(json.dumps({"grown": grown, "live": pc.live_programs(), "first": first,
                      "again": again, "want": want,
                      "evicted": c.get("eager_programs_evicted", 0),
                      "disk_hits": c.get("eager_disk_cache_hits", 0)}))
""")


def test_loaded_programs_stay_within_the_budget_and_come_back_from_the_cache(tmp_path):
    env = dict(os.environ, TORCHTPU_MAX_LIVE_PROGRAMS="100",
               TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["live"] <= 100
    assert r["evicted"] > 500
    assert r["disk_hits"] > 0
    # 750 programs kept loaded would map ~5000 more regions (3+ each); 100 live ones ~400
    assert r["grown"] < 1000, r["grown"]
    assert r["first"] == r["again"]
    for got, want in zip(r["first"], r["want"]):
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (got, want)


PRESSURE = textwrap.dedent("""
    import json, gc, torch, torchtpu
    from torchtpu.runtime import program_cache as pc

    def work(n):
        x = torch.arange(n, dtype=torch.float32, device="tpu")
        return ((x * 3 + 1).sin().sum()).item()

    work(1)
    pc.MAP_LIMIT = 2 * (pc.mappings() + 400)  # "half the limit": 400 mappings from here
    peak = 0
    got = []
    for n in range(2, 202):
        got.append(work(n))
        peak = max(peak, pc.mappings())
    c = torch.tpu.metrics()["counters"]
    print(json.dumps({"peak": peak, "limit": pc.MAP_LIMIT, "got": got,
                      "checks": c.get("programs_evicted_for_mappings", 0)}))
""")


def test_programs_are_dropped_when_the_process_nears_its_mapping_limit(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", PRESSURE], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["checks"] > 0
    # checked every 64 loads: between checks at most 64 programs' mappings are added
    assert r["peak"] < r["limit"] // 2 + 64 * 8, r
    for n, got in zip(range(2, 202), r["got"]):
        want = torch_ref(n)
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (n, got, want)


def torch_ref(n):
    import torch

    return torch.arange(n, dtype=torch.float32).mul(3).add(1).sin().sum().item()


def test_executables_loaded_ahead_have_their_mappings_counted_by_the_loading_thread(
        monkeypatch):
    # the working-set thread counts the mappings of what it loads ahead (runtime/program_cache
    # ``_check_ahead``); the caller tracking such an executable does not read the count again
    # (~4 ms a read on a warm generate's first call), but does as soon as the thread saw the
    # process above half its limit, and evicts there
    import collections

    from torchtpu.runtime import program_cache as pc

    reads = []
    now = [0]
    monkeypatch.setattr(pc, "mappings", lambda: reads.append(1) or now[0])
    monkeypatch.setattr(pc, "MAP_LIMIT", 1000)
    monkeypatch.setattr(pc, "_live", collections.OrderedDict())
    monkeypatch.setattr(pc, "_loads_since_check", [0])
    monkeypatch.setattr(pc, "_loaded_ahead", [1])
    prog = pc.Program("eager", lambda x: x)
    for i in range(3 * pc._CHECK_EVERY):
        prog.by_sig[("ahead", i)] = object()
        pc._track(prog, ("ahead", i), mapped_ahead=True)
    assert not reads
    now[0] = 100  # the thread's own reads: every _CHECK_EVERY loads, nothing to do below half
    for _ in range(pc._CHECK_EVERY):
        pc._check_ahead()
    assert len(reads) == 1 and pc._loads_since_check[0] == 0
    now[0] = 600  # above half: the next track reads the count and drops the older half
    for _ in range(pc._CHECK_EVERY):
        pc._check_ahead()
    assert len(reads) == 2
    prog.by_sig[("ahead", "last")] = object()
    pc._track(prog, ("ahead", "last"), mapped_ahead=True)
    assert len(reads) == 4  # the count, and again after evicting (a warning above 3/4)
    assert len(pc._live) == (3 * pc._CHECK_EVERY + 1) - (3 * pc._CHECK_EVERY + 1) // 2
    # loads the caller made itself are counted as before
    now[0] = 100
    for i in range(pc._CHECK_EVERY):
        prog.by_sig[("own", i)] = object()
        pc._track(prog, ("own", i))
    assert len(reads) == 5
