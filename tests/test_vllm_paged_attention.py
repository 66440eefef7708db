"""torch.tpu.ops.ragged_paged_attention / kv_cache_update_ (the op behind the vLLM backend) and
compiled graphs that hold a functionalized mutable custom op (auto_functionalized_v2).

References: a per-sequence dense attention in float64 (``dense_reference``) and PyTorch on
CPU. The Pallas paths run in interpret mode on tiny shapes against the same reference.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.lowering import paged_attention as pa


def _case(seed=0, P=40, page=4, Hkv=2, D=16, Hq=4, S=6, pps=4, T=24,
          q_lens=(5, 1, 1, 7), kv_lens=(9, 3, 12, 7), dtype=np.float32):
    rng = np.random.default_rng(seed)
    n = len(q_lens)
    kv = rng.standard_normal((P, page, 2 * Hkv, D)).astype(dtype)
    cu = np.zeros(S + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    kvl = np.zeros(S, np.int32)
    kvl[:n] = kv_lens
    pi = rng.permutation(P)[:S * pps].reshape(S, pps).astype(np.int32)
    q = rng.standard_normal((T, Hq, D)).astype(dtype)
    return q, kv, kvl, pi, cu, np.array([n], np.int32)


def _torch(*arrays, device="cpu"):
    return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"soft_cap": 2.0}],
                         ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_ragged_paged_attention_matches_dense_reference(kw, device):
    case = _case()
    ref = pa.dense_reference(*case, sm_scale=0.25, **kw)
    out = torch.tpu.ops.ragged_paged_attention(*_torch(*case, device=device), sm_scale=0.25,
                                               **kw)
    assert out.device.type == device
    got = out.cpu().double().numpy()
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
    # tokens past the last sequence (bucket padding) are zeros
    assert not got[int(case[4][case[5][0]]):].any()


def test_ragged_paged_attention_long_sequences_many_blocks():
    """Sequences spanning several of the loop's KV blocks (128 positions each), GQA 4:1."""
    case = _case(seed=3, P=300, page=16, Hkv=2, D=8, Hq=8, S=4, pps=20, T=40,
                 q_lens=(1, 30, 1), kv_lens=(300, 250, 17))
    ref = pa.dense_reference(*case, sm_scale=0.3)
    out = torch.tpu.ops.ragged_paged_attention(*_torch(*case, device="tpu"), sm_scale=0.3)
    np.testing.assert_allclose(out.cpu().double().numpy(), ref, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("q_lens,kv_lens", [((1,) * 6, (264, 250, 17, 1, 64, 131)),
                                              ((1, 1, 70, 1), (233, 40, 200, 96))],
                         ids=["decode", "mixed"])
def test_ragged_paged_attention_blocks_of_both_paths(q_lens, kv_lens):
    """A page size whose decode block (~32 positions) and prefill block (~128) do not divide
    each other (12: 3 and 11 pages), decode tokens spanning many blocks, GQA 2:1."""
    case = _case(seed=7, P=300, page=12, Hkv=2, D=8, Hq=4, S=8, pps=22, T=80,
                 q_lens=q_lens, kv_lens=kv_lens)
    ref = pa.dense_reference(*case, sm_scale=0.3)
    out = torch.tpu.ops.ragged_paged_attention(*_torch(*case, device="tpu"), sm_scale=0.3)
    np.testing.assert_allclose(out.cpu().double().numpy(), ref, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 40, "soft_cap": 3.0}],
                         ids=["causal", "window_softcap"])
def test_decode_tokens_of_mixed_lengths_walk_only_their_own_blocks(kw):
    """A block of 32 decode tokens of lengths 1..400 (the per-token work list: items of one
    token straddle several of the loop's steps, the last step is part dead; a short sequence
    next to a long one), GQA 2:1, against the dense reference."""
    rng = np.random.default_rng(11)
    lens = tuple(int(x) for x in rng.integers(1, 400, 32))
    lens = (1, 400) + lens[2:]
    case = _case(seed=11, P=900, page=16, Hkv=2, D=8, Hq=4, S=32, pps=25, T=32,
                 q_lens=(1,) * 32, kv_lens=lens)
    ref = pa.dense_reference(*case, sm_scale=0.3, **kw)
    out = torch.tpu.ops.ragged_paged_attention(*_torch(*case, device="tpu"), sm_scale=0.3,
                                               **kw)
    np.testing.assert_allclose(out.cpu().double().numpy(), ref, atol=3e-5, rtol=3e-5)


def test_ragged_paged_attention_bfloat16():
    case = _case(seed=5)
    q, kv = case[0], case[1]
    ref = pa.dense_reference(torch.from_numpy(q).bfloat16().double().numpy(),
                             torch.from_numpy(kv).bfloat16().double().numpy(), *case[2:],
                             sm_scale=0.25)
    args = _torch(*case, device="tpu")
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    out = torch.tpu.ops.ragged_paged_attention(*args, sm_scale=0.25)
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.cpu().double().numpy(), ref, atol=3e-2, rtol=3e-2)


def test_ragged_paged_attention_pallas_gpu_interpret():
    """The GPU path (JAX's Pallas paged decode kernel behind a device-side decode check) in
    interpret mode: a decode batch takes the kernel, a mixed batch the portable path."""
    import jax.numpy as jnp

    for q_lens, kv_lens in (((1, 1, 1), (5, 9, 1)), ((5, 1, 1, 7), (9, 3, 12, 7))):
        case = _case(seed=1, q_lens=q_lens, kv_lens=kv_lens)
        ref = pa.dense_reference(*case, sm_scale=0.25)
        out = pa.ragged_paged_attention(*[jnp.asarray(a) for a in case], sm_scale=0.25,
                                        impl="pallas_gpu", interpret=True)
        np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"soft_cap": 2.0}],
                         ids=["causal", "window", "softcap"])
def test_ragged_paged_attention_pallas_tpu_interpret(kw):
    """JAX's Pallas TPU kernel itself, run by JAX's TPU interpreter (through
    lowering/pallas_interpret.py's rewrite of what that interpreter cannot run)."""
    import jax.numpy as jnp

    case = _case(seed=2, D=128)
    ref = pa.dense_reference(*case, sm_scale=0.25, **kw)
    if kw:  # the option changes the answer, so the comparison checks it is applied
        assert np.abs(ref - pa.dense_reference(*case, sm_scale=0.25)).max() > 1e-2
    out = pa.ragged_paged_attention(*[jnp.asarray(a) for a in case], sm_scale=0.25,
                                    impl="pallas_tpu", interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-5, rtol=2e-5)


def test_ragged_paged_attention_pallas_tpu_interpret_bfloat16():
    """The kernel's packed-bf16 path (KV read through a bitcast ref) in the interpreter."""
    import jax.numpy as jnp

    case = _case(seed=5, D=128)
    q, kv = (jnp.asarray(a).astype(jnp.bfloat16) for a in case[:2])
    ref = pa.dense_reference(np.asarray(q, np.float64), np.asarray(kv, np.float64), *case[2:],
                             sm_scale=0.25)
    out = pa.ragged_paged_attention(q, kv, *[jnp.asarray(a) for a in case[2:]], sm_scale=0.25,
                                    impl="pallas_tpu", interpret=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=3e-2, rtol=3e-2)


def test_pallas_tpu_path_is_chosen_only_where_it_applies():
    import jax.numpy as jnp

    q = jnp.zeros((8, 4, 128), jnp.float32)
    assert pa._pallas_tpu_applies(q, jnp.zeros((4, 16, 4, 128), jnp.float32))
    assert not pa._pallas_tpu_applies(q[..., :64], jnp.zeros((4, 16, 4, 64), jnp.float32))


def _kv_write_case():
    P, page, Hkv, D, T = 10, 4, 2, 8, 6
    kv = torch.randn(P, page, 2 * Hkv, D)
    k, v = torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    slots = torch.tensor([3, 17, 39, -1, 0, -1])  # -1: padding, not written
    want = kv.clone().view(P * page, 2 * Hkv, D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s, 0::2], want[s, 1::2] = k[t], v[t]
    return kv, k, v, slots, want.view(P, page, 2 * Hkv, D)


@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_kv_cache_update_writes_slots_in_place(device):
    kv, k, v, slots, want = _kv_write_case()
    kv = kv.to(device)
    alias = kv.view(-1)  # a view taken before the write sees it (in place)
    assert torch.tpu.ops.kv_cache_update_(kv, k.to(device), v.to(device),
                                          slots.to(device)) is None
    torch.testing.assert_close(kv.cpu(), want, rtol=0, atol=0)
    torch.testing.assert_close(alias.cpu(), want.view(-1), rtol=0, atol=0)


def test_kv_cache_update_out_of_range_slot_raises():
    kv, k, v, slots, _ = _kv_write_case()
    slots[0] = kv.shape[0] * kv.shape[1]
    with pytest.raises(IndexError, match="slot_mapping"):
        torch.tpu.ops.kv_cache_update_(kv.to("tpu"), k.to("tpu"), v.to("tpu"),
                                       slots.to("tpu"))
        torch.tpu.synchronize()


def test_compiled_kv_write_and_attention_donate_the_cache():
    """In a compiled graph the write arrives as auto_functionalized_v2 and the cache, a graph
    input it overwrites, is donated; results equal the CPU kernels'."""
    case = _case(seed=4, P=10, page=4, Hkv=2, D=8, Hq=4, S=3, pps=3, T=8,
                 q_lens=(2, 1), kv_lens=(6, 9))
    q, kvp, kvl, pi, cu, ns = _torch(*case)
    k, v = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    slots = torch.tensor([5, 6, 20, -1, -1, -1, -1, -1])

    def step(kv, q, k, v, slots, kvl, pi, cu, ns):
        torch.tpu.ops.kv_cache_update_(kv, k, v, slots)
        return torch.tpu.ops.ragged_paged_attention(q, kv, kvl, pi, cu, ns, sm_scale=0.35)

    kv_cpu = kvp.clone()
    want = step(kv_cpu, q, k, v, slots, kvl, pi, cu, ns)
    kv_tpu = kvp.to("tpu")
    args = [t.to("tpu") for t in (q, k, v, slots, kvl, pi, cu, ns)]
    torch.tpu.reset_metrics()
    got = torch.compile(step, backend="tpu", fullgraph=True)(kv_tpu, *args)
    c = torch.tpu.metrics()["counters"]
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_tpu.cpu(), kv_cpu, rtol=0, atol=0)
    assert c.get("compile_donated_buffers", 0) >= 1, c
    assert not c.get("compile_cpu_fallbacks"), c


def test_compiled_mutable_op_on_a_view_of_the_input():
    """A mutable custom op handed a slice of a graph input (pages 2..4 of the cache): the
    functionalized call regenerates the view, runs the op's lowering and writes the slice back
    into the input, as the CPU kernel writes through the view."""
    kv, k, v, _, _ = _kv_write_case()
    slots = torch.tensor([0, 5, 11, -1, 3, -1])  # slots of the 3-page slice

    def f(kv, k, v, slots):
        torch.tpu.ops.kv_cache_update_(kv[2:5], k, v, slots)
        return kv.sum()

    kv_cpu = kv.clone()
    want = f(kv_cpu, k, v, slots)
    kv_tpu = kv.to("tpu")
    got = torch.compile(f, backend="tpu", fullgraph=True)(
        kv_tpu, k.to("tpu"), v.to("tpu"), slots.to("tpu"))
    torch.testing.assert_close(kv_tpu.cpu(), kv_cpu, rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(kv_cpu, kv)  # the write happened


def test_auto_functionalized_v2_lowering_of_a_slice_view():
    """The HOP lowering on its own: a slice view of a base (what aot_autograd emits)."""
    import jax.numpy as jnp
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    from torchtpu.lowering import hops

    lower = hops.get(auto_functionalized_v2)
    base = jnp.asarray(np.arange(5 * 2 * 2 * 3, dtype=np.float32).reshape(5, 2, 2, 3))
    key = jnp.ones((2, 1, 3), jnp.float32)
    val = jnp.full((2, 1, 3), 7.0, jnp.float32)
    slots = jnp.asarray([1, 2], jnp.int32)  # rows of the slice (pages 1..3 of the base)
    out = lower(torch.ops.tpu.kv_cache_update_.default, key=key, value=val, slot_mapping=slots,
                _kv_pages_base_index=0, _kv_pages_slice_dim=0, _kv_pages_slice_start=1,
                _kv_pages_slice_end=4, _all_bases=[base])
    assert out[0] is None and len(out) == 2
    want = np.asarray(base).copy()
    sl = want[1:4].reshape(6, 2, 3)
    sl[1, 0], sl[1, 1], sl[2, 0], sl[2, 1] = 1, 7, 1, 7
    want[1:4] = sl.reshape(3, 2, 2, 3)
    np.testing.assert_array_equal(np.asarray(out[1]), want)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 20}], ids=["causal", "window"])
def test_ragged_paged_attention_prefill_blocks_of_one_sequence(kw):
    """Query blocks wholly inside one sequence (a prefill chunk) take the matrix-product path,
    mixed blocks the per-token one: both against the dense reference."""
    case = _case(seed=6, P=200, page=4, Hkv=2, D=8, Hq=4, S=4, pps=40, T=80,
                 q_lens=(40, 1, 3), kv_lens=(100, 5, 60))
    ref = pa.dense_reference(*case, sm_scale=0.3, **kw)
    out = torch.tpu.ops.ragged_paged_attention(*_torch(*case, device="tpu"), sm_scale=0.3, **kw)
    np.testing.assert_allclose(out.cpu().double().numpy(), ref, atol=3e-5, rtol=3e-5)


# ---- cost: a write or a read of the cache never copies the whole cache ----

def _cache_copies(hlo: str, shape) -> list[str]:
    """The instructions of an optimized HLO module that copy an array of the cache's shape
    (in any layout: a layout change is a full copy too)."""
    import re

    dims = ",".join(str(d) for d in shape)
    pat = re.compile(r"= \w+\[" + dims + r"\]\{[^}]*\} copy(-start)?\(")
    return [line.strip()[:200] for line in hlo.splitlines() if pat.search(line)]


def _decode_inputs(slots_n, page, B=8, width=64, Hkv=2, D=16, G=2, seed=0):
    """A decode step's inputs over a cache of ``slots_n`` slots in pages of ``page``."""
    rng = np.random.default_rng(seed)
    P = slots_n // page + 1
    kv = rng.standard_normal((P, page, 2 * Hkv, D)).astype(np.float32)
    q = rng.standard_normal((B, Hkv * G, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    pps = width // page
    pi = rng.permutation(P)[:B * pps].reshape(B, pps).astype(np.int32)
    kvl = rng.integers(1, width, B).astype(np.int32)
    # each sequence's new token goes to its last position's slot
    slots = np.array([pi[b, (kvl[b] - 1) // page] * page + (kvl[b] - 1) % page
                      for b in range(B)], np.int32)
    cu = np.arange(B + 1, dtype=np.int32)
    return kv, q, k, v, slots, kvl, pi, cu, np.array([B], np.int32)


@pytest.mark.parametrize("page", [1, 16])
def test_kv_write_and_decode_attention_do_not_copy_the_cache(page):
    """The lowered write, and a decode step (write + attention) with the cache donated, update
    the cache in place: their optimized HLO copies no array of the cache's shape. Through a
    flattened [slots, heads, dim] view, a page size of 1 (SGLang's) made XLA:CPU copy the
    whole cache in every write (a decode step's time grew with the pool, not the batch)."""
    import jax

    inputs = _decode_inputs(4096, page)
    kv = inputs[0]

    def step(kv, q, k, v, slots, kvl, pi, cu, ns):
        kv = pa.kv_cache_update(kv, k, v, slots)
        return kv, pa.ragged_paged_attention(q, kv, kvl, pi, cu, ns, sm_scale=0.25, impl="xla")

    write = lambda kv, k, v, slots: pa.kv_cache_update(kv, k, v, slots)  # noqa: E731
    for fn, args in ((write, (inputs[0], inputs[2], inputs[3], inputs[4])), (step, inputs)):
        hlo = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
        assert not _cache_copies(hlo, kv.shape), _cache_copies(hlo, kv.shape)
    if page == 1:  # the check finds the copy the flattened write made
        def flat_write(kv, k, v, slots):
            new = jax.numpy.stack([k, v], axis=2).reshape(k.shape[0], -1, k.shape[2])
            return kv.reshape(-1, *kv.shape[2:]).at[slots].set(new).reshape(kv.shape)

        hlo = jax.jit(flat_write, donate_argnums=0).lower(
            inputs[0], inputs[2], inputs[3], inputs[4]).compile().as_text()
        assert _cache_copies(hlo, kv.shape)


def _cache_converts(hlo: str, shape) -> list[str]:
    """The instructions of an optimized HLO module that convert an array of the cache's shape
    to another dtype."""
    import re

    dims = ",".join(str(d) for d in shape)
    pat = re.compile(r"= \w+\[" + dims + r"\]\{[^}]*\} convert\(")
    return [line.strip()[:200] for line in hlo.splitlines() if pat.search(line)]


@pytest.mark.parametrize("page", [1, 16])
def test_16bit_model_step_over_its_float32_cache_converts_no_cache(page):
    """A bf16 model's decode step over its cache as the serving engines store it on XLA:CPU
    (``ops/_kv_storage.py``: float32; SGLang's attention widens the query to the cache's
    dtype, vLLM's passes it as is): no cache-sized array is converted or copied. Over a bf16
    cache XLA:CPU converts the whole cache (what the widened storage avoids)."""
    import jax
    import jax.numpy as jnp

    from torchtpu.ops._kv_storage import kv_storage_dtype

    assert kv_storage_dtype(torch.bfloat16) == torch.float32  # this host runs XLA:CPU
    assert kv_storage_dtype(torch.float16) == torch.float32
    assert kv_storage_dtype(torch.float32) == torch.float32
    kv, q, k, v, *meta = _decode_inputs(4096, page)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))

    def step(kv, q, k, v, slots, kvl, pi, cu, ns, widen):
        kv = pa.kv_cache_update(kv, k, v, slots)
        qq = q.astype(kv.dtype) if widen else q
        out = pa.ragged_paged_attention(qq, kv, kvl, pi, cu, ns, sm_scale=0.25, impl="xla")
        return kv, out.astype(jnp.bfloat16)

    for widen in (True, False):
        fn = jax.jit(step, donate_argnums=0, static_argnums=9)
        hlo = fn.lower(jnp.asarray(kv), q, k, v, *meta, widen).compile().as_text()
        bad = _cache_converts(hlo, kv.shape) + _cache_copies(hlo, kv.shape)
        assert not bad, (widen, bad)
    # the check finds the conversion a bf16 cache costs
    hlo = jax.jit(step, donate_argnums=0, static_argnums=9).lower(
        jnp.asarray(kv, jnp.bfloat16), q, k, v, *meta, False).compile().as_text()
    assert _cache_converts(hlo, kv.shape)


def test_compiled_and_eager_decode_steps_over_a_page_size_1_pool():
    """SGLang's layout (page size 1): the compiled decode step (write + attention, the cache
    donated) and the eager write's program copy no cache-sized array, and their results equal
    the CPU kernels'."""
    from torchtpu.compile import backend
    from torchtpu.runtime import program_cache

    kv, q, k, v, slots, kvl, pi, cu, ns = _torch(*_decode_inputs(2048, 1))
    texts = []
    orig_compile, orig_build = backend.CompiledGraph._compile, program_cache.Program._build

    def spy_compile(self, *a, **kw):
        entry = orig_compile(self, *a, **kw)
        texts.append(("compiled", entry.compiled.as_text()))
        return entry

    def spy_build(self, *a, **kw):
        built = orig_build(self, *a, **kw)
        texts.append(("eager", built[0].as_text()))
        return built

    def step(kv, q, k, v, slots, kvl, pi, cu, ns):
        torch.tpu.ops.kv_cache_update_(kv, k, v, slots)
        return torch.tpu.ops.ragged_paged_attention(q, kv, kvl, pi, cu, ns, sm_scale=0.25)

    kv_cpu = kv.clone()
    want = step(kv_cpu, q, k, v, slots, kvl, pi, cu, ns)
    backend.CompiledGraph._compile = spy_compile
    program_cache.Program._build = spy_build
    try:
        torch._dynamo.reset()
        args = [t.to("tpu") for t in (q, k, v, slots, kvl, pi, cu, ns)]
        kv_c = kv.to("tpu")
        got_c = torch.compile(step, backend="tpu", fullgraph=True)(kv_c, *args)
        kv_e = kv.to("tpu")
        got_e = step(kv_e, *args)
        torch.tpu.synchronize()
    finally:
        backend.CompiledGraph._compile = orig_compile
        program_cache.Program._build = orig_build
        torch._dynamo.reset()
    for got, kv_t in ((got_c, kv_c), (got_e, kv_e)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv_t.cpu(), kv_cpu, rtol=0, atol=0)
    kinds = [kind for kind, _ in texts]
    assert "compiled" in kinds and "eager" in kinds, kinds
    for kind, hlo in texts:
        assert not _cache_copies(hlo, kv.shape), (kind, _cache_copies(hlo, kv.shape))
