"""Launching multi-process tests: ranks on 127.0.0.1, each launch bounded in time and killed by
session if it overruns. Scripts live in tests/dist_scripts/; a launch passes only if it exits 0
and printed "ALL OK" (see ``ok``)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "dist_scripts")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra):
    """This process's environment for a rank: one XLA device per process, plus ``extra``."""
    e = dict(os.environ)
    e.pop("XLA_FLAGS", None)
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run(cmd, timeout, env=None):
    """Run ``cmd`` in its own session; kill the whole session if it overruns."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env or child_env(), start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout} s:\n{out[-4000:]}")
    return p.returncode, out


def torchrun(script, *args, nproc=2, timeout=400, env=None):
    """``torchrun --nproc-per-node nproc tests/dist_scripts/script args``."""
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), os.path.join(SCRIPTS, script), *args]
    return run(cmd, timeout, env)


def spawn(script, *args, nproc=2, timeout=400, env=None):
    """The script's ``main(rank, world)`` under ``torch.multiprocessing.spawn``."""
    cmd = [sys.executable, os.path.join(SCRIPTS, "spawn_launch.py"), str(nproc),
           str(free_port()), os.path.join(SCRIPTS, script), *args]
    return run(cmd, timeout, env)


def ranks(script, *args, timeout=300, env=None):
    """Start 2 ranks as plain processes (env://); returns [(returncode, output)] per rank."""
    port = free_port()
    procs = []
    for r in range(2):
        e = child_env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(env or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.join(SCRIPTS, script), *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=e, start_new_session=True))
    res = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            out, _ = p.communicate()
            pytest.fail(f"{script} {args} did not finish within {timeout} s:\n{out[-4000:]}")
        res.append((p.returncode, out))
    return res


def ok(rc, out):
    assert rc == 0 and "ALL OK" in out, out[-6000:]
