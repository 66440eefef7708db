"""Small helpers shared by the test modules."""
from __future__ import annotations

import torch


def flat(x):
    """A nested list/tuple of results as a flat list."""
    if isinstance(x, (list, tuple)):
        return [e for y in x for e in flat(y)]
    return [x]


def classification_batches(n, batch, in_shape, classes, seed=1):
    """``n`` (inputs of ``in_shape``, class labels) batches from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *in_shape, generator=g),
             torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def token_batches(n, batch, seq_len, vocab, seed=2):
    """``n`` (tokens, next tokens) language-model batches from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def json_result(proc, timeout: float):
    """The last stdout line of the child ``proc`` as JSON, once it exits 0 within ``timeout``
    seconds (killed past it: never left running after the test)."""
    import json
    import subprocess

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, f"exit {proc.returncode}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def run_json(script: str, env: dict, timeout: float):
    """Run ``python -c script`` with ``env``; its ``json_result``."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return json_result(proc, timeout)


def counter(name: str) -> int:
    """A ``torch.tpu.metrics()`` counter's value (0 when never counted)."""
    return torch.tpu.metrics()["counters"].get(name, 0)
