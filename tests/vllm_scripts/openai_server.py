"""``python -m vllm.entrypoints.openai.api_server`` in a subprocess for the scripts here:
started on a free 127.0.0.1 port in its own session, waited for (``/health``), and stopped
(its process group killed) on exit."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


class Server:
    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        self.log.seek(0)
        return "\n".join(self.log.read().splitlines()[-n:])


@contextlib.contextmanager
def openai_server(model: str, *flags: str, env: dict | None = None, timeout: float = 600):
    """A running server of ``model`` (device "tpu" unless ``env`` says otherwise), the engine
    core in its own process as a user starts it; yields a ``Server``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(tempfile.mkdtemp(), "server.log"), "w+")
    e = dict(os.environ, VLLM_TARGET_DEVICE="tpu")
    e.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    e.update(env or {})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e,
                            start_new_session=True)
    srv = Server(proc, port, log)
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}:\n{srv.tail()}")
            try:
                with urllib.request.urlopen(srv.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"server not ready in {timeout} s:\n{srv.tail()}")
            time.sleep(0.5)
        print(f"server ready in {time.perf_counter() - t0:.1f} s", flush=True)
        yield srv
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
