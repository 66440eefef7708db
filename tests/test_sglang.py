"""SGLang on "tpu" (torchtpu.sglang): the engine and server checked against transformers on CPU.

SGLang lives in its own virtualenv (``make venv-sglang`` -> .venv-sglang; ``make test`` builds
it first); each check runs there as a subprocess (tests/sglang_check.py), bounded in time and
killed with its whole session if it overruns. Without that venv the tests skip, saying so.
"""
from __future__ import annotations

import json
import os

import pytest

from dist_launch import child_env, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SGLANG_PY = os.environ.get("TORCHTPU_SGLANG_PYTHON",
                           os.path.join(ROOT, ".venv-sglang", "bin", "python"))
CHECK = os.path.join(HERE, "sglang_check.py")

needs_sglang = pytest.mark.skipif(
    not os.path.exists(SGLANG_PY),
    reason=f"SGLang's virtualenv is absent ({SGLANG_PY}): build it with `make venv-sglang`")


def sglang_check(*args, timeout=900, env=None):
    """Run ``sglang_check.py args`` in the SGLang venv; its JSON result."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = child_env(PYTHONPATH=path, **(env or {}))
    rc, out = run([SGLANG_PY, CHECK, *args], timeout, env)
    lines = [ln for ln in out.splitlines() if ln.startswith("SGLANG_CHECK ")]
    assert rc == 0 and lines, f"sglang_check {args} exited {rc}:\n{out[-6000:]}"
    return json.loads(lines[-1][len("SGLANG_CHECK "):])


def _check_engine(r, n=8):
    assert r["platform"] == "TpuSRTPlatform"
    assert r["greedy"] == r["hf"]
    # the same prompts again: served from the radix cache (all but the last prompt token)
    assert r["greedy_again"] == r["hf"]
    assert all(c > 0 for c in r["cached_tokens"]), r["cached_tokens"]
    assert all(len(s) == n for s in r["sampled"]) and r["sampled"] != r["hf"]


@needs_sglang
def test_engine_greedy_batch_radix_cache(tmp_path):
    """A tiny Llama: a batch of greedy prompts equals HF on CPU, then again from the radix
    prefix cache, and sampling runs (in the default suite)."""
    _check_engine(sglang_check("engine", "--arch", "llama", "--out", str(tmp_path)))


@pytest.mark.slow
@needs_sglang
def test_engine_qwen_seeded_twice_from_compile_cache(tmp_path):
    """A tiny Qwen2 (qkv biases), twice in fresh processes sharing one compile cache folder:
    both equal HF greedy, and the seeded sampling (engine random_seed) is the same tokens."""
    cache = tmp_path / "cache"
    env = {"TORCHTPU_CACHE_DIR": str(cache)}
    first = sglang_check("engine", "--arch", "qwen2", "--out", str(tmp_path), env=env)
    assert any(cache.iterdir()), "the first process wrote no compile cache entry"
    second = sglang_check("engine", "--arch", "qwen2", "--out", str(tmp_path), env=env)
    _check_engine(first)
    _check_engine(second)
    assert first["sampled"] == second["sampled"]
