"""torch.distributed on "tpu" (backend "tpu_dist"): collectives, DDP, faults.

Multi-process tests launch 2 ranks on 127.0.0.1 (torchrun or torch.multiprocessing.spawn),
each launch bounded in time and killed by process group if it overruns. The scripts under
tests/dist_scripts/ compare every result with a single-process CPU reference and print
"ALL OK"; a launch passes only if it exits 0 and printed that line.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from dist_launch import HERE, SCRIPTS, TORCHRUN
from dist_launch import child_env as _env
from dist_launch import free_port as _port
from dist_launch import ok as _ok
from dist_launch import ranks as _ranks
from dist_launch import run as _run
from dist_launch import spawn as _spawn
from dist_launch import torchrun as _torchrun


# ---- in this process: registration and a group of one ----

def test_backend_registered_and_default_for_tpu():
    assert "TPU_DIST" in dist.Backend._plugins and "TPU" in dist.Backend._plugins
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu_dist"
    assert dist.Backend._plugins["TPU_DIST"].extended_api


def test_group_of_one_in_process():
    store = dist.HashStore()
    dist.init_process_group("tpu_dist", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        assert dist.get_backend() == "tpu_dist"
        x = torch.arange(6.0, device="tpu").reshape(2, 3)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        torch.testing.assert_close(x.cpu(), torch.arange(6.0).reshape(2, 3))
        out = torch.empty(2, 3, device="tpu")
        dist.all_gather_into_tensor(out, x)
        torch.testing.assert_close(out.cpu(), x.cpu())
        w = dist.broadcast(x, src=0, async_op=True)
        assert w.wait() and w.is_completed()
        assert w.get_future().value()[0] is x
        objs = [None]
        dist.all_gather_object(objs, {"k": [1, 2]})
        assert objs == [{"k": [1, 2]}]
        dist.barrier()
        with pytest.raises(NotImplementedError, match="recvAnysource"):  # as with NCCL
            dist.recv(x)
        m = torch.tpu.metrics()["per_op"]
        assert m["dist_calls"]["all_reduce"] >= 1 and m["dist_bytes"]["all_reduce"] >= 24
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n", [3, 4])
def test_collective_programs_on_n_devices_of_one_process(n):
    """Every program body for group sizes 3 and 4 (the multi-process tests use 2), on
    in-process XLA:CPU devices, against numpy."""
    env = _env(XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    _ok(*_run([sys.executable, os.path.join(SCRIPTS, "programs_check.py"), str(n)], 300, env))


# ---- two processes ----

def test_collectives_torchrun_strict():
    """Every collective (ops x dtypes, views, 0-dim, async, coalesced, rooted, uneven
    all_to_all, p2p, subgroups, objects, CPU tensors) vs a CPU reference, under torchrun."""
    _ok(*_torchrun("collectives_check.py"))


def test_collectives_spawn_fused_default_backend():
    """The same checks (three dtypes) in Fused eager mode, launched with torch.multiprocessing.spawn and
    init_process_group() with no backend (the default for device "tpu" is "tpu_dist")."""
    _ok(*_spawn("collectives_check.py", "--mode", "fused", "--init", "default",
                "--dtypes", "float32,int64,bool"))


def test_ddp_matches_single_process(tmp_path):
    """DDP (plain, small buckets, no_sync, find_unused_parameters with a parameter unused
    everywhere and one used on one rank only, also under no_sync, static_graph, the Reducer's
    unused-parameter error, Fused, torch.compile, bf16/fp16 hooks) on 2 ranks vs one process on
    the full batch; the ranks share one compile-cache folder (and build the pinned-memory hooks
    that find_unused/static_graph need into it concurrently)."""
    env = _env(TORCHTPU_CACHE_DIR=tmp_path / "cache")
    _ok(*_torchrun("ddp_check.py", "plain", "buckets", "no_sync", "find_unused",
                   "static_graph", "no_sync_unused", "unused_error", "fused", "compile",
                   "bf16_hook", "fp16_hook", env=env, timeout=600))


def test_device_used_before_init_process_group_torchrun():
    """The first device use joins the cluster (torchrun's agent store); device_id=,
    set_device(local_rank), tpu:{local_rank} and "tpu" all name this rank's device; the group
    is bound to it; split_group, and DeviceMesh's split of the bound group."""
    _ok(*_torchrun("bootstrap_check.py", timeout=300))


# ---- faults ----

def test_dead_rank_raises_runtime_error():
    """The survivor's collective raises a RuntimeError naming group, collective and sequence
    number, and the process ends promptly (not after JAX's shutdown barrier timeout). Known:
    JAX's coordination service then reports the dead peer and terminates the survivor
    (SIGABRT, after the exception; jaxlib 0.10.2 cannot hand that report to Python)."""
    t0 = time.monotonic()
    (rc0, out0), (rc1, _) = _ranks("fault_check.py", "dead", env={"FAULT_TIMEOUT": 60})
    assert time.monotonic() - t0 < 150
    assert rc0 in (0, -signal.SIGABRT) and "RAISED" in out0, out0[-4000:]
    line = next(l for l in out0.splitlines() if l.startswith("RAISED"))
    assert "group '0'" in line and "all_reduce" in line and "sequence number" in line, line
    assert float(line.split("after ")[1].split("s:")[0]) < 60, line


def test_hung_rank_watchdog_reports_and_exits():
    t0 = time.monotonic()
    (rc0, out0), _ = _ranks("fault_check.py", "hang", env={"FAULT_TIMEOUT": 3})
    assert rc0 == 6, out0[-4000:]
    assert "all_reduce (sequence number 2) timed out" in out0, out0[-4000:]
    assert "NO TIMEOUT" not in out0
    assert time.monotonic() - t0 < 120


def test_mismatched_collectives_raise_on_every_rank():
    res = _ranks("fault_check.py", "mismatch", env={"TORCHTPU_DIST_CHECK": 1})
    for r, (rc, out) in enumerate(res):
        assert rc == 0 and f"RAISED rank {r}" in out, out[-4000:]
        assert "collectives differ across ranks" in out and "all_gather" in out, out[-4000:]


def test_torchrun_sigterm_ends_ranks_promptly():
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(_port()), os.path.join(SCRIPTS, "fault_check.py"), "loop"]
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            log.seek(0)
            if "READY" in log.read():
                break
            assert p.poll() is None, "torchrun exited early"
            time.sleep(0.5)
        else:
            pytest.fail("ranks never became ready")
        time.sleep(2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert took < 30, took
    # no rank survives its agent
    out = subprocess.run(["pgrep", "-f", "fault_check.py loop", "-s", str(p.pid)],
                         capture_output=True, text=True).stdout
    assert not out.strip(), out


@pytest.mark.slow  # ~1.5 min; test_ddp_matches_single_process covers DDP's equivalence
def test_train_gpt_ddp_matches_one_process(tmp_path):
    """examples/train_gpt.py under torchrun (2 ranks x batch 4) has the loss curve of one
    process on the combined batch (8)."""
    script = os.path.join(HERE, "..", "examples", "train_gpt.py")
    common = ["--steps", "8", "--layers", "1", "--embd", "48", "--heads", "2", "--seq-len",
              "32", "--log-every", "1", "--eval-batches", "0", "--quiet", "--warmup", "3"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    rc, out = _run([sys.executable, script, *common, "--batch-size", "8", "--losses-json",
                    str(one)], 300)
    assert rc == 0, out[-4000:]
    rc, out = _torchrun(os.path.join("..", "..", "examples", "train_gpt.py"), *common,
                        "--batch-size", "4", "--losses-json", str(two), timeout=300)
    assert rc == 0, out[-4000:]
    import json

    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert len(a) == len(b) == 8
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a))
