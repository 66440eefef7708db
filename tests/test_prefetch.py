"""Programs of growing inputs built ahead on worker threads (runtime/prefetch.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.runtime import prefetch
from torchtpu.runtime import program_cache as pc
from torchtpu.runtime.metrics import COUNTERS

_tags = iter(range(10**9))


def _aval(shape, dtype=jnp.float32, weak=False):
    return jax.core.ShapedArray(shape, jnp.dtype(dtype), weak_type=weak)


def test_next_signature_continues_one_step():
    a, b = _aval((1, 2, 9, 16)), _aval((1, 2, 10, 16))
    k = _aval((1, 2, 1, 16))
    assert prefetch.next_signature((a, k, int), (b, k, int)) == (_aval((1, 2, 11, 16)), k, int)
    # several growing dimensions, by the same step
    assert prefetch.next_signature((_aval((3, 5)),), (_aval((5, 7)),)) == (_aval((7, 9)),)


@pytest.mark.parametrize("prev,cur", [
    ((_aval((4,)),), (_aval((4,)),)),                      # nothing grew
    ((_aval((5,)),), (_aval((4,)),)),                      # shrank
    ((_aval((3, 5)),), (_aval((4, 7)),)),                  # two different steps
    ((_aval((3,)),), (_aval((4,), jnp.float64),)),         # dtype changed
    ((_aval((3,)),), (_aval((4,), weak=True),)),           # weak type changed
    ((_aval((3,)),), (_aval((3, 1)),)),                    # rank changed
    ((_aval((3,)), int), (_aval((4,)), float)),            # a scalar's kind changed
    ((_aval((3,)),), (_aval((4,)), int)),                  # arity changed
])
def test_next_signature_refuses_anything_else(prev, cur):
    assert prefetch.next_signature(prev, cur) is None


def _growing(n_calls, fn=lambda x, s: jnp.cumsum(jnp.tanh(x) * s), start=5):
    p = pc.Program("eager", fn, ("test.prefetch", next(_tags)))
    outs = []
    for n in range(start, start + n_calls):
        x = jnp.linspace(-3, 3, n, dtype=jnp.float32)
        outs.append(np.asarray(p(x, 0.5)))
    return p, outs


def test_predict_needs_a_progression_of_three():
    a3, a4, a5, a6 = ((_aval((n, 8)),) for n in (3, 4, 5, 6))
    assert prefetch.predict([a3], a4) is None  # one step could be anything
    assert prefetch.predict([a3, a4], a5) == a6
    assert prefetch.predict([a3, a4], (_aval((9, 8)),)) is None  # 3, 4, 9: no progression
    # a Program shared by call sites: its misses interleave, each site progresses
    w1, w2 = _aval((8, 16)), _aval((8, 40))
    hist = [(a3[0], w1), (a3[0], w2), (a4[0], w1), (a4[0], w2)]
    assert prefetch.predict(hist, (a5[0], w1)) == (a6[0], w1)
    assert prefetch.predict(hist, (a5[0], w2)) == (a6[0], w2)


def test_growing_program_is_built_ahead_with_the_same_results(monkeypatch):
    before = dict(COUNTERS)
    p, outs = _growing(8)
    hits = COUNTERS["eager_prefetch_hits"] - before.get("eager_prefetch_hits", 0)
    subs = COUNTERS["eager_prefetches"] - before.get("eager_prefetches", 0)
    assert subs == 6 and hits == 5  # calls 4..8 were built ahead; the 9th is pending
    assert len(p._pending) == 1 and p._wasted == 0
    monkeypatch.setattr(prefetch, "THREADS", 0)
    q, ref = _growing(8)
    assert q._pending is None
    for u, v in zip(outs, ref):
        np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8))


def test_call_sites_sharing_a_program_each_get_theirs_built_ahead():
    p = pc.Program("eager", lambda x, w: x @ w, ("test.prefetch", next(_tags)))
    ws = [jnp.ones((8, n), jnp.float32) for n in (16, 40, 24)]  # no progression
    before = COUNTERS["eager_prefetch_hits"]
    for t in range(3, 9):
        for w in ws:
            x = jnp.ones((t, 8), jnp.float32)
            np.testing.assert_array_equal(np.asarray(p(x, w)), 8 * np.ones((t, w.shape[1])))
    assert COUNTERS["eager_prefetch_hits"] - before == 3 * 3  # lengths 6, 7, 8 at each site


def test_unused_guesses_are_dropped_and_stop_a_program_guessing(monkeypatch):
    monkeypatch.setattr(prefetch, "HISTORY", 4)
    monkeypatch.setattr(prefetch, "PAUSE", 1000)
    p = pc.Program("eager", lambda x: x * 2, ("test.prefetch", next(_tags)))
    subs = []
    for r, (start, step) in enumerate(((3, 1), (100, 2), (200, 3), (300, 4), (400, 5))):
        # new sizes (a miss ages the guesses), no three of them in a progression
        junk = [n + 1000 * r for n in (1057, 1023, 1090, 1061, 1038)]
        for n in [start, start + step, start + 2 * step] + junk:  # a run that stops
            np.testing.assert_array_equal(np.asarray(p(jnp.ones(n))), 2 * np.ones(n))
        subs.append(COUNTERS["eager_prefetches"])
    assert p._hits == 0 and not p._pending
    assert p._wasted == prefetch.MAX_WASTED + 1  # each run's guess aged out unused...
    assert subs[-1] == subs[-2] == subs[-3]  # ...and after the third, no more guesses
    assert subs[2] == subs[0] + 2
    # until PAUSE misses later: then a new growing workload is guessed again
    monkeypatch.setattr(prefetch, "PAUSE", p._quiet + 4)
    for k in range(4):  # the misses that end the pause (powers of 2: no progression)
        p(jnp.ones(9000 + 2 ** k))
    assert COUNTERS["eager_prefetches"] == subs[-1] and p._wasted == p._quiet == 0
    for n in (8000, 8001, 8002, 8003):
        p(jnp.ones(n))
    assert COUNTERS["eager_prefetches"] == subs[-1] + 2 and p._hits == 1


def test_a_prediction_that_fails_to_build_costs_nothing():
    def fn(x):
        if x.shape[0] == 7:
            raise ValueError("no program for 7")
        return x + 1
    p = pc.Program("eager", fn, ("test.prefetch", next(_tags)))
    before = COUNTERS["eager_prefetch_errors"]
    p(jnp.ones(4))
    p(jnp.ones(5))
    p(jnp.ones(6))  # predicts 7, whose build fails on the worker
    with pytest.raises(ValueError, match="no program for 7"):  # the call raises it itself
        p(jnp.ones(7))
    assert COUNTERS["eager_prefetch_errors"] == before + 1


_GENERATE = textwrap.dedent("""
    import json, sys, torch, transformers, torchtpu
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, vocab_size=64,
                                   max_position_embeddings=64)
    cpu = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = cpu.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        out = cpu.to("tpu").generate(ids.to("tpu"), max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False)
    c = torch.tpu.metrics()["counters"]
    print(json.dumps({"equal": torch.equal(out.cpu(), ref), "hits": c.get("eager_prefetch_hits", 0),
                      "misses": c.get("eager_disk_cache_misses", 0)}))
""")


def test_generate_with_dynamic_cache_uses_programs_built_ahead(tmp_path):
    """A real growing workload, in a fresh process (a Program's guesses depend on what it saw
    before): decode steps of a tiny Llama on "tpu" match CPU's tokens, and from the fourth new
    token on, the per-length programs were built ahead."""
    pytest.importorskip("transformers")
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _GENERATE], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["equal"]
    assert res["hits"] >= 8 * 6  # 8 tokens built ahead, ~8 growing programs each


def test_exit_with_predictions_pending_is_clean():
    code = textwrap.dedent("""
        import time, jax.numpy as jnp
        from torchtpu.runtime import program_cache as pc
        ps = [pc.Program("eager", lambda x, i=i: jnp.sort(x) * i, ("test.exit", i))
              for i in range(40)]
        for p in ps:
            p(jnp.ones(3)); p(jnp.ones(4)); p(jnp.ones(5))  # 40 predictions queued
        t = time.perf_counter()
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"


def test_drain_drops_queued_guesses_and_waits_for_running_ones():
    import threading
    gate = threading.Event()
    started = threading.Event()

    def slow():
        started.set()
        gate.wait(30)
        return "built"

    running = prefetch.submit(slow)
    started.wait(30)
    queued = [prefetch.submit(lambda: "never") for _ in range(2 * prefetch.THREADS)]
    t = threading.Thread(target=prefetch.drain)
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waiting for the running job
    gate.set()
    t.join(30)
    assert not t.is_alive()
    assert running.result() == "built"
    assert all(j.state in ("dropped", "done") for j in queued)
    assert [j.result() for j in queued if j.state == "dropped"] == [None] * sum(
        j.state == "dropped" for j in queued)


# ---- guessing the next executor key (eager/key_guess.py) ----

def test_key_progression_helpers():
    from torchtpu.eager import key_guess as kg

    ints: list = []
    fam = kg._split(("op", 1, (3, (16, 4)), 2.5, None), ints)
    assert ints == [1, 3, 16, 4] and kg._join(fam, iter([1, 4, 20, 4])) == (
        "op", 1, (4, (20, 4)), 2.5, None)
    # the arguments hold the key's ints: a list becomes a tuple in the key
    assert kg._subst((5, [3, 7], "x"), (5, (3, 7), "x"), (6, (4, 7), "x")) == (6, [4, 7], "x")
    with pytest.raises(kg._NoGuess):  # a key int the arguments do not hold
        kg._subst(("t",), ((float, 1),), ((float, 2),))
    s = [(_aval((1, n, 8)), int) for n in (5, 6, 7)]
    assert kg._next_sig(*s) == (_aval((1, 8, 8)), int)
    assert kg._next_sig(s[0], s[1], (_aval((1, 9, 8)), int)) is None  # 5, 6, 9
    pts = [([3, 48], s[0]), ([3, 96], s[0]), ([4, 48], s[1]), ([4, 96], s[1])]
    assert kg._progression(pts, [5, 48], s[2]) == ([6, 48], (_aval((1, 8, 8)), int))
    assert kg._progression(pts, [5, 50], s[2]) is None


_SAMPLE = textwrap.dedent("""
    import json, sys, torch, torchtpu
    import torch.nn.functional as F
    sys.path.insert(0, sys.argv[1])
    from train_gpt import GPT
    torch.manual_seed(0)
    model = GPT(65, 16, n_layer=1, n_head=2, n_embd=16).eval().to("tpu")
    idx = torch.zeros((1, 1), dtype=torch.long, device="tpu")
    torch.manual_seed(1)
    with torch.no_grad():
        for _ in range(20):  # minGPT's sampling: no cache, the context cropped to the block
            logits = model(idx if idx.size(1) <= 16 else idx[:, -16:])[:, -1, :]
            v, _ = torch.topk(logits, 5)
            logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, -1), 1)), dim=1)
    c = torch.tpu.metrics()["counters"]
    print(json.dumps({"tokens": idx.cpu().tolist(), "key_hits": c.get("eager_key_guess_hits", 0),
                      "hits": c.get("eager_prefetch_hits", 0), "misses": c.get("eager_cache_misses", 0)}))
""")


def test_sampling_programs_keyed_by_the_length_are_built_ahead_same_tokens(tmp_path):
    """minGPT-style sampling: most per-length programs are new executor keys (a view's shape,
    arange(T)); they are guessed and built ahead, and the sampled tokens (multinomial with the
    same seed) are the same as without building ahead."""
    examples = os.path.join(os.path.dirname(__file__), "..", "examples")
    runs = {}
    for threads in ("2", "0"):
        env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / threads),
                   TORCHTPU_PREFETCH_THREADS=threads)
        r = subprocess.run([sys.executable, "-c", _SAMPLE, examples], capture_output=True,
                           text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[threads] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs["2"]["tokens"] == runs["0"]["tokens"]
    assert runs["0"]["key_hits"] == 0
    # lengths 4..16 guessed: ~10 per-length keys each (views, arange, sdpa)
    assert runs["2"]["key_hits"] >= 10 * 8, runs["2"]


def test_an_unused_key_guess_leaves_the_executor_cache():
    from torchtpu.eager import executor

    before = dict(COUNTERS)
    for n in (10, 17, 24):  # arange's end is in the key: a progression of keys
        torch.arange(3, n, 7, dtype=torch.int16, device="tpu")
    assert COUNTERS["eager_key_guesses"] == before.get("eager_key_guesses", 0) + 1
    guessed = [k for k in executor._CACHE if k[2] == (3, 31, 7)]
    assert len(guessed) == 1
    for n in (1000 + 2 ** k for k in range(prefetch.HISTORY + 1)):  # no progression
        torch.arange(3, n, 7, dtype=torch.int16, device="tpu")
    assert guessed[0] not in executor._CACHE
    assert COUNTERS["eager_key_guesses_wasted"] == before.get("eager_key_guesses_wasted", 0) + 1
    np.testing.assert_array_equal(torch.arange(3, 31, 7, dtype=torch.int16, device="tpu").cpu(),
                                  np.arange(3, 31, 7))


def test_a_failing_guess_never_fails_the_op(monkeypatch):
    from torchtpu.eager import key_guess

    def broken(*a, **k):
        raise RuntimeError("a bug in guessing")

    monkeypatch.setattr(key_guess, "_advance", broken)
    before = COUNTERS["eager_key_guess_errors"]
    out = torch.arange(5, 23, 3, dtype=torch.int8, device="tpu")  # a new key: a miss
    np.testing.assert_array_equal(out.cpu(), np.arange(5, 23, 3))
    assert COUNTERS["eager_key_guess_errors"] == before + 1
