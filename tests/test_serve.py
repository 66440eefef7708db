"""``transformers serve --device tpu --continuous-batching``: an OpenAI-compatible server on "tpu".

The test saves a tiny random-weight Llama with a word-level tokenizer and a chat template (built
here, no downloads), starts the real server on 127.0.0.1 once with ``--device cpu`` and once
with ``--device tpu``, sends four concurrent chat completions and one streamed one with the
``openai`` client, and requires the tpu server's text to equal the CPU server's. The KV cache is
kept small (``--cb-*`` flags) so that the test is quick; the servers are stopped by pid.
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

START_TIMEOUT = 300
REQUEST_TIMEOUT = 300
PROMPTS = ["hello world", "the cat sat on the mat", "how are you today", "what is your name"]
CB_FLAGS = ["--cb-num-blocks", "16", "--cb-block-size", "16", "--cb-max-batch-tokens", "64"]


def _example():
    """examples/tiny_chat_model.py (the walk-through in examples/serve.md uses it too)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "tiny_chat_model.py")
    spec = importlib.util.spec_from_file_location("tiny_chat_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    return exe if os.path.exists(exe) else shutil.which("transformers")


class Server:
    """``transformers serve`` in a subprocess; stopped (by pid) on exit."""

    def __init__(self, model_dir, device, log_path):
        self.port = free_port()
        self.log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [cli(), "serve", str(model_dir), "--device", device, "--continuous-batching",
             "--host", "127.0.0.1", "--port", str(self.port), *CB_FLAGS],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
        self.log_path = log_path
        self.model = str(model_dir)

    def wait_ready(self) -> float:
        while time.monotonic() - self.started < START_TIMEOUT:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return time.monotonic() - self.started
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"server not up after {START_TIMEOUT} s:\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()

    def chats(self) -> tuple[list[str], list[str]]:
        """Four concurrent completions, then one streamed (its chunks)."""
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                               timeout=REQUEST_TIMEOUT, max_retries=0)

        def one(prompt):
            r = client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                temperature=0)
            return r.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as ex:
            texts = list(ex.map(one, PROMPTS))
        stream = client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "good day my friend"}],
            max_tokens=8, temperature=0, stream=True)
        chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
        return texts, chunks


@pytest.mark.slow
def test_serve_tpu_matches_cpu(tmp_path):
    model_dir = tmp_path / "tiny-chat"
    _example().save_tiny_chat_model(model_dir)
    results, timings = {}, {}
    for device in ("cpu", "tpu"):
        server = Server(model_dir, device, tmp_path / f"server-{device}.log")
        try:
            timings[device] = [server.wait_ready()]
            t0 = time.monotonic()
            results[device] = server.chats()
            timings[device].append(time.monotonic() - t0)
        finally:
            server.stop()
    print(f"startup, requests (s): {timings}")
    texts, chunks = results["tpu"]
    assert all(t and len(t.split()) >= 2 for t in texts), texts
    assert "".join(chunks).strip() and len(chunks) > 2, chunks
    assert results["tpu"] == results["cpu"]


def test_continuous_batching_cache_budget_is_a_fraction_of_free_memory(monkeypatch):
    """The KV cache budget continuous batching computes with its default config: a fraction of
    the tpu device's free memory (on the CPU platform 0.1 of the host's available memory), not
    90% of all host RAM less the process's RSS, which got the server OOM-killed."""
    from types import SimpleNamespace

    from transformers.generation.continuous_batching import cache, initialization

    from torchtpu.integrations.transformers import CPU_PLATFORM_MEMORY_PERCENT
    from torchtpu.runtime import devices, memory

    gib = 1 << 30
    if devices.platform() == "cpu":
        monkeypatch.setattr(memory, "host_memory", lambda: (4 * gib, 16 * gib))
        assert 0 < CPU_PLATFORM_MEMORY_PERCENT <= 0.2
        expect = int(4 * gib * CPU_PLATFORM_MEMORY_PERCENT)
    else:
        expect = int(torch.tpu.mem_get_info()[0] * 0.9)
    config = transformers.ContinuousBatchingConfig()
    initialization.resolve_max_memory_percent(config, False, torch.device("tpu", 0))
    handler = SimpleNamespace(cb_config=config)
    budget = cache.PagedAttentionMemoryHandler.get_available_memory(handler)
    assert budget == pytest.approx(expect, rel=0.01)
    # a value the user sets is kept
    config = transformers.ContinuousBatchingConfig(max_memory_percent=0.5)
    initialization.resolve_max_memory_percent(config, False, torch.device("tpu", 0))
    assert config.max_memory_percent == 0.5
