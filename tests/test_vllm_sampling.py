"""The in-program sampler of vLLM on "tpu" (torchtpu/vllm/sampling.py): the compiled program on
"tpu" draws exactly what the same function draws on CPU, greedy rows are the argmax, and the
draws follow softmax(logits / temperature) (chi-square against the exact probabilities; the
draws are seeded, so the statistic is the same every run). The engine-level checks (seeded
requests repeat, distribution against transformers' logits) are in vllm_scripts/offline.py."""
from __future__ import annotations

import numpy as np
import torch

import torchtpu  # noqa: F401
from torchtpu.vllm import sampling as S


def _packed_sample(packed, logits, R: int):
    return S.sample(logits, packed[:R].view(torch.float32), packed[R:2 * R], packed[2 * R:])


def test_program_on_tpu_draws_what_cpu_draws():
    g = torch.Generator().manual_seed(0)
    R, V = 16, 300
    logits = torch.randn(R, V, generator=g) * 3
    temp = torch.tensor([0.0, 1.0, 0.5, 2.0] * 4)
    seeds = torch.randint(-2 ** 31, 2 ** 31 - 1, (R,), dtype=torch.int32, generator=g)
    pos = torch.arange(R, dtype=torch.int32) * 37
    ref = S.sample(logits, temp, seeds, pos)
    packed = torch.cat([temp.view(torch.int32), seeds, pos])
    prog = torch.compile(_packed_sample, backend="tpu", dynamic=False)
    got = prog(packed.to("tpu"), logits.to("tpu"), R).cpu()
    assert torch.equal(got, ref)
    assert torch.equal(ref[temp == 0], logits[temp == 0].argmax(-1).to(torch.int32))
    # an all-greedy step takes the program's other branch (no noise computed): the argmax,
    # from the same program
    zeros = torch.zeros(R)
    packed0 = torch.cat([zeros.view(torch.int32), seeds, pos])
    got0 = prog(packed0.to("tpu"), logits.to("tpu"), R).cpu()
    assert torch.equal(got0, logits.argmax(-1).to(torch.int32))
    assert torch.equal(got0, S.sample(logits, zeros, seeds, pos))
    # the same (seed, position) draws the same; another position or seed draws anew
    u = S.uniform(seeds, pos, V)
    assert torch.equal(u, S.uniform(seeds, pos, V))
    assert not torch.equal(u, S.uniform(seeds, pos + 1, V))
    assert not torch.equal(u, S.uniform(seeds + 1, pos, V))
    assert 0 < float(u.min()) and float(u.max()) < 1


def _chi2(counts, p):
    exp = p * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum()), len(p) - 1


def test_draws_follow_softmax_over_temperature():
    V, N = 8, 4000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    for temp in (1.0, 0.5, 2.0):
        ids = S.sample(logits.expand(N, V), torch.full((N,), temp),
                       torch.arange(N, dtype=torch.int32), torch.full((N,), 5, dtype=torch.int32))
        counts = np.bincount(ids.numpy(), minlength=V)
        p = torch.softmax(logits.double() / temp, -1).numpy()
        chi2, df = _chi2(counts, p)
        assert chi2 < 40, (temp, chi2, counts, p * N)  # df 7: p ~ 1e-6
        # a draw at another temperature is told apart
        wrong = torch.softmax(logits.double() / (temp * 1.5), -1).numpy()
        assert _chi2(counts, wrong)[0] > 40, temp
    # one request's draws along its positions (a seeded stream) follow it too
    ids = S.sample(logits.expand(N, V), torch.ones(N), torch.full((N,), 7, dtype=torch.int32),
                   torch.arange(N, dtype=torch.int32))
    chi2, _ = _chi2(np.bincount(ids.numpy(), minlength=V),
                    torch.softmax(logits.double(), -1).numpy())
    assert chi2 < 40, chi2
