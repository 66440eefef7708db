"""The CPU paged-attention kernel (runtime/cpu_paged_attention.cc, an XLA FFI custom call) against
its reference, the portable lowering (``impl="xla"``), and the dense float64 reference.

Measured on these cases (float32; the tests before the new head-dim ones): kernel vs portable
lowering at most 8.3e-7, kernel vs the float64 reference at most 5.2e-7 (the kernel before its
vectorized exp: 8.3e-7 and 5.0e-7; the tolerance below is 2e-6).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_json
from test_vllm_paged_attention import _case as _paged_case

from torchtpu.lowering import paged_attention as pa
from torchtpu.runtime import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available("paged_attention"),
                                reason="no C++ compiler: the kernel is not used")


def _case(seed, q_lens, kv_lens, Hq=4, Hkv=2, D=16, page=4, pps=None, S=None, T=None,
          dtype=np.float32):
    """test_vllm_paged_attention's case, sized to the lengths; T past the tokens: padding."""
    S = S or len(q_lens) + 2
    pps = pps or -(-max(kv_lens) // page)
    return _paged_case(seed=seed, P=S * pps + 3, page=page, Hkv=Hkv, D=D, Hq=Hq, S=S, pps=pps,
                       T=T or sum(q_lens) + 5, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype)


def _both(case, **kw):
    run = lambda impl: np.asarray(jax.jit(  # noqa: E731
        lambda *a: pa.ragged_paged_attention(*a, impl=impl, **kw))(*case), np.float64)
    return run("cpu"), run("xla")


def _check(case, atol=2e-6, **kw):
    got, want = _both(case, **kw)
    np.testing.assert_allclose(got, want, atol=atol, rtol=atol)
    ref = pa.dense_reference(*case, **kw)
    np.testing.assert_allclose(got, ref, atol=atol, rtol=atol)
    end = int(case[4][case[5][0]])
    assert not got[end:].any()  # padding tokens are zeros
    return got


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (8, 2), (8, 1)], ids=lambda x: str(x))
def test_decode_gqa(Hq, Hkv):
    rng = np.random.default_rng(Hq * 10 + Hkv)
    lens = tuple(int(x) for x in rng.integers(1, 300, 24))
    _check(_case(1, (1,) * 24, lens, Hq=Hq, Hkv=Hkv, D=32, page=16), sm_scale=0.2)


def test_ragged_prefill_and_decode_mixed():
    """Chunks of one sequence longer than the kernel's group of 8 tokens, a chunk that starts
    inside the sequence (prefix cached), decode tokens between them."""
    _check(_case(2, (17, 1, 1, 9, 1, 40, 3), (17, 55, 1, 30, 200, 90, 8), D=64, page=16),
           sm_scale=0.125)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_lengths_at_page_boundaries(page):
    lens = tuple(k * page + d for k in (1, 2, 7) for d in (-1, 0, 1) if k * page + d > 0)
    q_lens = tuple(min(L, 5) if i % 3 == 0 else 1 for i, L in enumerate(lens))
    _check(_case(3, q_lens, lens, page=page, D=8), sm_scale=0.3)


@pytest.mark.parametrize("D,Hq,Hkv", [(4, 4, 2), (12, 6, 2), (36, 3, 1), (20, 8, 2)],
                         ids=lambda x: str(x))
def test_head_dims_and_groups_off_the_vector_width(D, Hq, Hkv):
    """The kernel scores 8 keys at a time over 8 columns of D, and the query heads of a KV head
    two at a time: head dims not a multiple of 8 (and under 8), odd groups (a pair, then one)."""
    lens = (1, 9, 16, 17, 33, 100, 7, 250)
    q_lens = (1, 1, 1, 1, 1, 1, 5, 12)
    _check(_case(17, q_lens, lens, Hq=Hq, Hkv=Hkv, D=D, page=8), sm_scale=0.4)


def test_scores_far_apart():
    """Scores hundreds apart: most probabilities underflow (the vectorized exp's flush to zero
    under e^-87) and the running maximum jumps between chunks. Small integers and a power-of-two
    scale keep the scores exact in float32, so the outputs are not ill-conditioned."""
    case = list(_case(18, (1, 1, 3), (300, 47, 120), D=32, page=16))
    case[0], case[1] = np.round(case[0] * 2), np.round(case[1] * 2)
    got = _check(tuple(case), sm_scale=4.0)
    assert np.abs(got).max() > 0
    keys = case[1][case[3][0]][:, :, 0].reshape(-1, 32)[:300]  # sequence 0, KV head 0
    scores = keys @ case[0][0, 0] * 4.0
    assert scores.max() - scores.min() > 2 * 87  # wider than exp's float32 range


def test_one_token():
    _check(_case(4, (1,), (1,), T=1, S=1), sm_scale=1.0)
    _check(_case(5, (1,), (37,), T=1, S=1), sm_scale=1.0)


def test_long_contexts_of_thousands_of_pages():
    got = _check(_case(6, (1, 1, 1, 1), (4000, 3001, 2048, 77), Hq=8, Hkv=2, D=64, page=1),
                 sm_scale=0.125)
    assert np.abs(got).max() > 0


@pytest.mark.parametrize("kw", [{"sliding_window": 37}, {"soft_cap": 5.0},
                                {"sliding_window": 8, "soft_cap": -3.0}],
                         ids=["window", "softcap", "both"])
def test_window_and_soft_cap(kw):
    _check(_case(7, (1, 12, 1, 30), (300, 100, 9, 45), page=8), sm_scale=0.25, **kw)


def test_rows_past_num_seqs_and_empty_sequences_are_ignored():
    case = list(_case(8, (3, 0, 1, 2), (10, 5, 20, 2)))
    case[5] = np.array([3], np.int32)  # the 4th row is not real: its tokens are padding
    _check(tuple(case), sm_scale=0.5)


def test_bfloat16():
    case = _case(9, (1, 7, 1), (90, 30, 12), D=32, page=8)
    bf = (jnp.asarray(case[0], jnp.bfloat16), jnp.asarray(case[1], jnp.bfloat16)) + case[2:]
    got, want = _both(bf, sm_scale=0.2)
    ref = pa.dense_reference(np.asarray(bf[0], np.float32), np.asarray(bf[1], np.float32),
                             *case[2:], sm_scale=0.2)
    # the output is rounded to bfloat16 (8 bits); the portable path also rounds p to bfloat16
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(want, ref, atol=3e-2, rtol=3e-2)


def _lowered_text(**env):
    case = _case(10, (1, 1), (5, 9))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return jax.jit(lambda *a: pa.ragged_paged_attention(*a, sm_scale=0.5)).lower(
            *case).as_text()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def test_auto_picks_the_kernel_on_cpu_and_the_switch_turns_it_off():
    target = cpu_kernels.target("paged_attention")
    assert target in _lowered_text()
    assert target not in _lowered_text(TORCHTPU_CPU_ATTENTION_KERNEL="0")
    assert target not in _lowered_text(TORCHTPU_CPU_KERNELS="0")


NO_COMPILER = r"""
import json, jax, numpy as np
from torchtpu.lowering import paged_attention as pa
from torchtpu.runtime import cpu_kernels
q = np.ones((2, 2, 8), np.float32); kv = np.ones((4, 4, 2, 8), np.float32)
args = (q, kv, np.array([3, 1], np.int32), np.array([[0], [1]], np.int32),
        np.array([0, 1, 2], np.int32), np.array([2], np.int32))
f = jax.jit(lambda *a: pa.ragged_paged_attention(*a, sm_scale=0.5))
text = f.lower(*args).as_text()
print(json.dumps({"available": cpu_kernels.available("paged_attention"),
                  "kernel_in_program": cpu_kernels.target("paged_attention") in text,
                  "reason": cpu_kernels._state.get("paged_attention"),
                  "out": np.asarray(f(*args)).tolist()}))
"""


def test_without_a_compiler_the_portable_lowering_runs(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path), CXX="/nonexistent/c++")
    r = run_json(NO_COMPILER, env, timeout=300)
    assert r["available"] is False and r["kernel_in_program"] is False
    assert "C++ compiler" in r["reason"]
    np.testing.assert_allclose(r["out"], np.ones((2, 2, 8)), rtol=1e-6)


# The op on "tpu" tensors eagerly and under torch.compile; the second process reads both
# programs back from the cache (no lowering: the kernel must be registered by custom_calls).
CACHED = r"""
import json, numpy as np, torch
import torchtpu
from torchtpu.runtime import cpu_kernels
rng = np.random.default_rng(0)
q = torch.from_numpy(rng.standard_normal((6, 4, 16)).astype(np.float32))
kv = torch.from_numpy(rng.standard_normal((20, 4, 4, 16)).astype(np.float32))
meta = [torch.tensor(x, dtype=torch.int32) for x in
        ([9, 3, 13, 0], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
         [0, 3, 4, 5, 5], [3])]
f = lambda *a: torch.tpu.ops.ragged_paged_attention(*a, sm_scale=0.25)
dev = [t.to("tpu") for t in [q, kv] + meta]
eager = f(*dev).cpu()
compiled = torch.compile(f, backend="tpu")(*dev).cpu()
ref = torch.tpu.ops.ragged_paged_attention(q, kv, *meta, sm_scale=0.25)
c = torch.tpu.metrics()["counters"]
print(json.dumps({"eager": eager.tolist(), "compiled": compiled.tolist(), "ref": ref.tolist(),
                  "registered": cpu_kernels._state.get("paged_attention", "not asked"),
                  "counters": {k: v for k, v in c.items() if "disk" in k or "compile" in k}}))
"""


def test_second_process_runs_cached_programs_with_the_kernel(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TORCHTPU_CPU_ATTENTION_KERNEL", None)
    env.pop("TORCHTPU_CPU_KERNELS", None)
    cold = run_json(CACHED, env, timeout=400)
    warm = run_json(CACHED, env, timeout=400)
    for r in (cold, warm):
        for k in ("eager", "compiled"):
            np.testing.assert_allclose(r[k], r["ref"], atol=2e-6, rtol=2e-6, err_msg=k)
        assert r["registered"] is None, r["registered"]
    assert warm["eager"] == cold["eager"] and warm["compiled"] == cold["compiled"]
    c = warm["counters"]
    assert c.get("eager_xla_compiles", 0) == 0 and c["eager_disk_cache_hits"] >= 1, c
    assert c.get("xla_compiles", 0) == 0 and c["compile_disk_cache_hits"] >= 1, c
    assert not any("unsafe" in k or "errors" in k for k in c), json.dumps(c)


def _run_cpu(case, **kw):
    return np.asarray(jax.jit(lambda *a: pa.ragged_paged_attention(*a, impl="cpu", **kw))(*case))


@pytest.mark.parametrize("name", ["decode", "mixed", "one_long_sequence", "window_softcap",
                                  "bfloat16"])
def test_threads_split_the_work_and_give_the_same_bits(name):
    """A call with enough work splits it over XLA's intra-op pool (groups of tokens, or single
    KV heads when there are few groups); every output row is computed by the same code in the
    same order, so the bits equal the calling thread's alone (TORCHTPU_CPU_ATTENTION_THREADS=1)."""
    lens = tuple(int(x) for x in np.random.default_rng(11).integers(100, 400, 32))
    case, kw = {
        "decode": (_case(11, (1,) * 32, lens, Hq=4, Hkv=2, D=64, page=16), {}),
        "mixed": (_case(12, (1,) * 20 + (100,), lens[:20] + (300,), D=64, page=16), {}),
        "one_long_sequence": (_case(13, (1,), (3000,), Hq=8, Hkv=4, D=64, page=16, T=1, S=1),
                              {}),
        "window_softcap": (_case(14, (1, 40, 1, 9) * 4, (300, 100, 90, 45) * 4, page=8, D=32),
                           {"sliding_window": 50, "soft_cap": 7.0}),
        "bfloat16": (_case(15, (1,) * 16 + (30,), lens[:16] + (64,), D=64, page=16), {}),
    }[name]
    if name == "bfloat16":
        case = (jnp.asarray(case[0], jnp.bfloat16), jnp.asarray(case[1], jnp.bfloat16)) + case[2:]
    before = cpu_kernels.attention_split_calls()
    pooled = _run_cpu(case, sm_scale=0.125, **kw)
    middle = cpu_kernels.attention_split_calls()
    prev = cpu_kernels.set_attention_threads(1)
    try:
        alone = _run_cpu(case, sm_scale=0.125, **kw)
        assert cpu_kernels.attention_split_calls() == middle  # one thread: no split
    finally:
        cpu_kernels.set_attention_threads(prev)
    assert pooled.tobytes() == alone.tobytes()
    assert np.abs(pooled.astype(np.float32)).max() > 0
    if len(os.sched_getaffinity(0)) > 1:  # XLA's pool has a thread per core
        assert middle[0] == before[0] + 1, (before, middle)


def test_small_work_stays_on_the_calling_thread():
    before = cpu_kernels.attention_split_calls()
    _check(_case(16, (1,), (37,), T=1, S=1), sm_scale=1.0)
    assert cpu_kernels.attention_split_calls() == before


THREADS_ENV = r"""
import json, jax, numpy as np
from torchtpu.lowering import paged_attention as pa
from torchtpu.runtime import cpu_kernels
rng = np.random.default_rng(0)
S, pps, page = 32, 16, 16
q = rng.standard_normal((S, 4, 64)).astype(np.float32)
kv = rng.standard_normal((S * pps, page, 4, 64)).astype(np.float32)
lens = rng.integers(100, 256, S).astype(np.int32)
pages = np.arange(S * pps, dtype=np.int32).reshape(S, pps)
cu = np.arange(S + 1, dtype=np.int32)
out = np.asarray(jax.jit(lambda *a: pa.ragged_paged_attention(*a, sm_scale=0.125, impl="cpu"))(
    q, kv, lens, pages, cu, np.array([S], np.int32)))
print(json.dumps({"split": cpu_kernels.attention_split_calls()[0],
                  "cap": cpu_kernels.set_attention_threads(0),
                  "finite": bool(np.isfinite(out).all())}))
"""


@pytest.mark.parametrize("value,cap", [("1", 1), ("not-a-number", 0)])
def test_threads_switch_from_the_environment(tmp_path, value, cap):
    """TORCHTPU_CPU_ATTENTION_THREADS=1 keeps every call on the calling thread; a value that is
    not a number is ignored (a warning), not a reason to drop the kernel."""
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path), TORCHTPU_CPU_ATTENTION_THREADS=value)
    r = run_json(THREADS_ENV, env, timeout=300)
    assert r["cap"] == cap and r["finite"], r
    if cap == 1 or len(os.sched_getaffinity(0)) > 1:
        assert r["split"] == (0 if cap == 1 else 1), r
