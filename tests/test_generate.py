"""``generate()`` on "tpu" vs CPU: greedy, sampling, beam search; dynamic and static KV cache.

A tiny random-weight Llama (no downloads) is built on CPU and deep-copied to "tpu". Greedy and
beam search must produce CPU's tokens (left-padded batch); seeded sampling must repeat run to
run on "tpu" (its RNG is not CPU's, so tokens are not compared with CPU) and with ``top_k=1``
equal greedy. With a static cache, transformers compiles the decode step (backend "tpu"): one
compile serves every new token (``torch.tpu.metrics()`` counters).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 64
TPU = torch.device("tpu")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cpu = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)).eval()
    return cpu, copy.deepcopy(cpu).to(TPU)


def prompt():
    """Two prompts, the second left-padded by two tokens."""
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[1, :2] = 0
    mask[1, :2] = 0
    return ids, mask


def generate(model, device, **kw):
    ids, mask = prompt()
    with torch.no_grad():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), pad_token_id=0,
                             **kw)
    if isinstance(out, torch.Tensor):
        return out.cpu()
    return out


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_matches_cpu(models, cache):
    cpu, tpu = models
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation=cache)
    expect = generate(cpu, "cpu", **kw)
    got = generate(tpu, TPU, **kw)
    assert got.shape == (2, 12)
    torch.testing.assert_close(got, expect)


def test_static_cache_compiles_decode_once(models):
    cpu, _ = models
    tpu = copy.deepcopy(cpu).to(TPU)
    torch._dynamo.reset()
    # (new tokens, cache shapes new to this model): the cache grows for 7 (one more compile)
    # and is reused as it is for 5. Each new cache shape compiles one decode graph and one
    # prefill graph (on "tpu" the prefill is compiled too); every other prefill and decode step
    # is a cache hit
    for n, graphs in ((3, 1), (7, 1), (5, 0)):
        torch.tpu.reset_metrics()
        got = generate(tpu, TPU, max_new_tokens=n, do_sample=False, cache_implementation="static")
        c = torch.tpu.metrics()["counters"]
        # a miss is a new compiled graph (traced, or rebuilt from the AOT/program caches when
        # an earlier test compiled the same one), at most one XLA compile each
        assert c.get("compile_cache_misses", 0) == 2 * graphs, (n, c)
        assert c.get("xla_compiles", 0) <= 2 * graphs, (n, c)
        assert c.get("compile_cache_hits", 0) == (n - 1 - graphs) + (1 - graphs), (n, c)
        torch.testing.assert_close(got, generate(cpu, "cpu", max_new_tokens=n, do_sample=False,
                                                 cache_implementation="static"))


def test_static_cache_prompt_lengths_in_a_bucket_share_prefill_and_decode(models):
    """transformers sizes a static cache to prompt + new tokens; on "tpu" the size is rounded up
    to the compile buckets, so a longer prompt within the bucket reuses the cache shape and the
    compiled decode step. transformers runs the prefill eagerly (a program per op and prompt
    length); on "tpu" it is compiled with the prompt length dynamic and padded to its bucket,
    writing the cache only at the real positions (integrations/transformers.py): prompts of
    9, 11 and 13 tokens run one prefill program. Tokens are CPU's."""
    from torchtpu.integrations.transformers import static_cache_length

    assert [static_cache_length(n) for n in (3, 8, 9, 16, 17, 100)] == [8, 8, 16, 16, 32, 128]
    cpu, _ = models
    tpu = copy.deepcopy(cpu).to(TPU)
    torch._dynamo.reset()
    misses = []
    masked = []
    for length in (9, 11, 13):  # prompts of bucket 16, caches of 12, 14, 16: bucket 16
        ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static",
                  pad_token_id=0)
        torch.tpu.reset_metrics()
        with torch.no_grad():
            got = tpu.generate(ids.to(TPU), **kw).cpu()
            expect = cpu.generate(ids, **kw)
        c = torch.tpu.metrics()["counters"]
        misses.append(c.get("compile_cache_misses", 0))
        masked.append(c.get("compile_bucket_programs", 0))
        torch.testing.assert_close(got, expect)
    assert misses == [2, 0, 0], misses  # the decode and the prefill graph, then none
    assert masked[0] == 1, masked  # the prefill: padded to its bucket


def test_a_prefill_that_cannot_compile_runs_eagerly(models, monkeypatch):
    """A forward the compiler rejects: one warning, the prefill runs eagerly, CPU's tokens."""
    from torchtpu.compile.lower import Unsupported
    from torchtpu.integrations import transformers as integration

    def reject(fn):
        def compiled(*args, **kwargs):
            raise Unsupported("test: not compilable")
        return compiled

    monkeypatch.setattr(integration, "_compile", reject)
    cpu, _ = models
    tpu = copy.deepcopy(cpu).to(TPU)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=3, do_sample=False, cache_implementation="static", pad_token_id=0)
    with pytest.warns(UserWarning, match="could not be compiled"):
        with torch.no_grad():
            got = tpu.generate(ids.to(TPU), **kw).cpu()
    torch.testing.assert_close(got, cpu.generate(ids, **kw))
    assert tpu.__dict__["_torchtpu_prefill"] is False
    with torch.no_grad():  # eager from now on, without a second warning
        torch.testing.assert_close(tpu.generate(ids.to(TPU), **kw).cpu(), got)


def test_static_cache_left_padded_batch_prompts_share_the_prefill(models):
    """A left-padded batch: generate() builds the prefill's 4-d mask outside the model; its
    query dim is marked dynamic apart from the ids' and checked equal at each call. Batches
    of 9, 11 and 13 tokens: one prefill program, CPU's tokens."""
    cpu, _ = models
    tpu = copy.deepcopy(cpu).to(TPU)
    torch._dynamo.reset()
    misses = []
    for length in (9, 11, 13):
        ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        ids[0, :3] = 0
        mask[0, :3] = 0
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False,
                  cache_implementation="static", pad_token_id=0)
        torch.tpu.reset_metrics()
        with torch.no_grad():
            got = tpu.generate(ids.to(TPU), **{**kw, "attention_mask": mask.to(TPU)}).cpu()
            expect = cpu.generate(ids, **kw)
        misses.append(torch.tpu.metrics()["counters"].get("compile_cache_misses", 0))
        torch.testing.assert_close(got, expect)
    assert misses == [2, 0, 0], misses


def test_sampling_with_a_seed_repeats(models):
    _, tpu = models
    kw = dict(max_new_tokens=8, do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(generate(tpu, TPU, **kw))
    torch.testing.assert_close(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert ((runs[0] >= 0) & (runs[0] < VOCAB)).all()


def test_sampling_top_k_1_is_greedy(models):
    cpu, tpu = models
    torch.manual_seed(3)
    got = generate(tpu, TPU, max_new_tokens=6, do_sample=True, top_k=1)
    torch.testing.assert_close(got, generate(cpu, "cpu", max_new_tokens=6, do_sample=False))


@pytest.mark.slow
def test_beam_search_matches_cpu(models):
    cpu, tpu = models
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, num_return_sequences=2,
              return_dict_in_generate=True, output_scores=True)
    expect = generate(cpu, "cpu", **kw)
    got = generate(tpu, TPU, **kw)
    torch.testing.assert_close(got.sequences.cpu(), expect.sequences)
    torch.testing.assert_close(got.sequences_scores.cpu(), expect.sequences_scores)


def test_continuous_batching_pads_and_compiles_on_tpu(models, monkeypatch):
    """Continuous batching (``generate_batch``) gives CPU's greedy tokens. On "tpu" its forward
    is compiled by default (transformers' compile level 1), which makes it pad each batch to
    query/KV intervals: static shapes instead of a compile storm per new mix of request
    lengths. Other devices, explicit compile configs and TORCHTPU_CB_COMPILE_LEVEL=0 are left
    alone."""
    from transformers.generation.configuration_utils import (CompileConfig,
                                                             ContinuousBatchingConfig)
    from transformers.generation.continuous_batching import initialization

    from torchtpu.integrations import transformers as tt

    cpu, tpu = models
    resolve = initialization.resolve_continuous_batching_config
    cfg = cpu.config

    def level(device, cb=None):
        cb = cb or ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=32)
        return resolve(cfg, cb, None, False, device=torch.device(device)).default_compile_level

    assert level("tpu") == 1 and level("cpu") == 0
    mine = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=32,
                                    decode_compile_config=CompileConfig())
    assert level("tpu", mine) == 0 and mine.default_compile_level == 0
    monkeypatch.setattr(tt, "CB_COMPILE_LEVEL", 0)
    assert level("tpu") == 0
    monkeypatch.undo()

    prompts = [[5, 9, 12, 7], [3, 4, 5, 6, 7, 8, 9]]
    gc = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1,
                                       pad_token_id=0)

    def run(model):
        cb = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=32)
        out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb,
                                   progress_bar=False)
        return sorted((o.prompt_ids, o.generated_tokens) for o in out.values())

    assert run(tpu) == run(cpu)


# ---- the stop check read one step late (integrations/transformers.py) ----

def _early_eos(cpu):
    """An eos id that greedy decoding of the left-padded batch emits after a few tokens."""
    ids, mask = prompt()
    with torch.no_grad():
        out = cpu.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    return int(out[0, ids.shape[1] + 2])  # the first prompt's third new token


@pytest.mark.parametrize("mode", ["strict", pytest.param("fused", marks=pytest.mark.slow)])
def test_deferred_stop_check_keeps_cpu_tokens(models, mode):
    """On "tpu" generate() reads its stop flag one step late (transformers' DeferredStopCheck,
    otherwise "mps"-only): with an eos that ends a sequence early, with the returned cache
    cropped back (return_dict_in_generate) and with a streamer, the tokens are CPU's; in Fused
    mode a graph spans two tokens."""
    from transformers.generation import utils as gen_utils

    from torchtpu.integrations import STATUS

    assert STATUS["transformers.generation.utils.DeferredStopCheck.__call__"] == "applied"
    assert gen_utils.DeferredStopCheck.is_supported(TPU, None, False, is_assistant=False)
    assert not gen_utils.DeferredStopCheck.is_supported(torch.device("cpu"), None, False,
                                                        is_assistant=False)
    cpu, tpu = models
    eos = _early_eos(cpu)
    eager = {"strict": torch.tpu.EagerMode.DEFER_NEVER,
             "fused": torch.tpu.EagerMode.DEFER_AND_FUSE}[mode]
    for kw in (dict(max_new_tokens=8, eos_token_id=eos),  # the first sequence stops early
               dict(max_new_tokens=8, eos_token_id=[eos, 1]),
               dict(max_new_tokens=5, eos_token_id=eos, return_dict_in_generate=True)):
        expect = generate(cpu, "cpu", do_sample=False, **kw)
        with torch.tpu.set_eager_mode(eager):
            got = generate(tpu, TPU, do_sample=False, **kw)
        if kw.get("return_dict_in_generate"):
            assert got.cache.get_seq_length() == expect.cache.get_seq_length()
            got, expect = got.sequences.cpu(), expect.sequences
        torch.testing.assert_close(got, expect)

    class Collect(transformers.generation.BaseStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value.tolist())

        def end(self):
            pass

    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    streams = []
    for model, dev in ((cpu, "cpu"), (tpu, TPU)):
        s = Collect()
        with torch.no_grad(), torch.tpu.set_eager_mode(eager):
            model.generate(ids.to(dev), max_new_tokens=6, do_sample=False, pad_token_id=0,
                           streamer=s)
        streams.append(s.seen)
    assert streams[0] == streams[1]

    if mode == "fused":  # graphs cut by reads: about one per two tokens instead of per token
        from torchtpu.integrations import transformers as integration

        cuts = []
        for defer in (False, True):
            integration.DEFER_STOP_CHECK = defer
            try:
                with torch.no_grad(), torch.tpu.set_eager_mode(eager):
                    tpu.generate(ids.to(TPU), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
                    torch.tpu.reset_metrics()
                    tpu.generate(ids.to(TPU), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            finally:
                integration.DEFER_STOP_CHECK = True
            cuts.append(torch.tpu.metrics()["per_op"].get("fused_graph_cuts", {}).get("read", 0))
        assert cuts[0] >= 12 and cuts[1] <= cuts[0] // 2 + 3, cuts


def test_min_length_processors_skip_the_unused_eos_mask():
    """Past the minimum length the processors' ``isin(arange(vocab), eos)`` is not built on
    "tpu" (integrations/generate_steps.py); below it the mask is made once per processor and
    remade when the eos ids change in place. Scores equal CPU's in both cases."""
    from transformers.generation import logits_process as lp

    from torchtpu.integrations import STATUS

    for name in ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"):
        assert STATUS[f"transformers.generation.logits_process.{name}.__call__"] == "applied"
    scores = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    # 10 columns: the lengths below reach past both minimums (with 6, ids[:, :9] had 6)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))

    def procs(device):
        return [lp.MinLengthLogitsProcessor(8, [2, 5], device=device),
                lp.MinNewTokensLengthLogitsProcessor(4, 3, torch.tensor([2], device=device))]

    cpu_procs, tpu_procs = procs("cpu"), procs(TPU)
    for length in (5, 6, 7, 8, 9):  # below and past both minimums
        torch.tpu.reset_metrics()
        for pc, pt in zip(cpu_procs, tpu_procs):
            expect = pc(ids[:, :length], scores)
            got = pt(ids[:, :length].to(TPU), scores.to(TPU))
            assert got.device.type == "tpu"
            torch.testing.assert_close(got.cpu(), expect, rtol=0, atol=0)
        saved = torch.tpu.metrics()["per_op"].get("generate_programs_saved", {})
        # length 5: both masks made; later: made masks reused (2), or past the minimum no mask
        # (2) and the clone of the scores made without a program (1)
        assert saved == ({} if length == 5 else {
            "MinLengthLogitsProcessor": 3 if length >= 8 else 2,
            "MinNewTokensLengthLogitsProcessor": 3 if length >= 7 else 2}), saved
    for pc, pt in zip(cpu_procs, tpu_procs):  # an eos id changed in place: a new mask
        pc.eos_token_id.fill_(7)
        pt.eos_token_id.fill_(7)
        torch.testing.assert_close(pt(ids[:, :3].to(TPU), scores.to(TPU)).cpu(),
                                   pc(ids[:, :3], scores), rtol=0, atol=0)


def test_min_length_clone_shares_the_array_and_stays_independent():
    """Past the minimum length the processor returns ``scores.clone()`` made without a program
    (generate_steps._clone): a tensor of its own holding the same immutable array. A write to
    either leaves the other as it was (the shared array is never donated to the write)."""
    from transformers.generation import logits_process as lp

    from torchtpu.integrations import generate_steps
    from torchtpu.runtime.buffer import buffer_of

    proc = lp.MinLengthLogitsProcessor(2, [2], device=TPU)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4)).to(TPU)
    base = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    for write_clone in (True, False):
        scores = base.to(TPU)
        hits0 = torch.tpu.metrics()["counters"].get("eager_cache_hits", 0)
        misses0 = torch.tpu.metrics()["counters"].get("eager_cache_misses", 0)
        out = proc(ids, scores)
        c = torch.tpu.metrics()["counters"]
        assert (c.get("eager_cache_hits", 0), c.get("eager_cache_misses", 0)) == (hits0, misses0)
        assert out is not scores and out.untyped_storage().data_ptr() != \
            scores.untyped_storage().data_ptr()
        assert buffer_of(out).array is buffer_of(scores).array
        torch.testing.assert_close(out.cpu(), base, rtol=0, atol=0)
        if write_clone:
            out[:, 0] = -1.0
            out.mul_(2)
            torch.testing.assert_close(scores.cpu(), base, rtol=0, atol=0)
            want = base.clone()
            want[:, 0] = -1.0
            torch.testing.assert_close(out.cpu(), want * 2, rtol=0, atol=0)
        else:
            scores.mul_(3)
            scores.add_(1)
            torch.testing.assert_close(out.cpu(), base, rtol=0, atol=0)
            torch.testing.assert_close(scores.cpu(), base * 3 + 1, rtol=0, atol=0)
    # a view that is not its storage's whole array is cloned by a program, as before
    view = base.to(TPU)[:, 1:]
    got, shared = generate_steps._clone(view)
    assert not shared and torch.equal(got.cpu(), base[:, 1:])


def test_stopping_criteria_list_results_equal_cpu():
    """On "tpu" the list ORs its criteria without the ``full(False)`` it starts from: the
    results (a fresh tensor even for one criterion) equal CPU's, also with a criterion that
    returns a Python bool."""
    from transformers.generation import stopping_criteria as sc

    class Always(sc.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return True

    ids = torch.tensor([[3, 4, 2], [5, 6, 7]])
    lists = [lambda d: [sc.MaxLengthCriteria(3)],
             lambda d: [sc.EosTokenCriteria(torch.tensor([2], device=d))],
             lambda d: [sc.MaxLengthCriteria(8), sc.EosTokenCriteria(torch.tensor([2], device=d))],
             lambda d: [sc.MaxLengthCriteria(3), sc.EosTokenCriteria(torch.tensor([7], device=d))],
             lambda d: [sc.EosTokenCriteria(torch.tensor([9], device=d)), sc.MaxLengthCriteria(2)],
             lambda d: [sc.MaxLengthCriteria(8, 2)],
             lambda d: [Always(), sc.MaxLengthCriteria(8)],
             lambda d: [Always(), sc.EosTokenCriteria(torch.tensor([2], device=d))],
             lambda d: [sc.EosTokenCriteria(torch.tensor([2], device=d)), Always()]]
    for make in lists:
        expect = sc.StoppingCriteriaList(make("cpu"))(ids, None)
        crit = sc.StoppingCriteriaList(make(TPU))
        got = crit(ids.to(TPU), None)
        assert got.dtype == torch.bool and got.shape == (2,)
        assert got.device.type == "tpu"
        torch.testing.assert_close(got.cpu(), expect, rtol=0, atol=0)
    mine = torch.tensor([True, False], device=TPU)

    class Held(sc.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return mine

    got = sc.StoppingCriteriaList([Held()])(ids.to(TPU), None)
    assert got is not mine and got.tolist() == [True, False]
    # generate()'s list: MaxLengthCriteria's full((batch,), done) is a host bool, so the
    # EosTokenCriteria's fresh result is the list's (no full, no or, no copy)
    crit = sc.StoppingCriteriaList([sc.MaxLengthCriteria(8),
                                    sc.EosTokenCriteria(torch.tensor([2], device=TPU))])
    ids_t = ids.to(TPU)[:, 1:]
    crit(ids_t, None)
    torch.tpu.reset_metrics()
    got = crit(ids_t, None)
    c = torch.tpu.metrics()["counters"]
    assert got.tolist() == [True, False]
    assert c["generate_programs_saved"] == 4  # full(False), full(done), two ors
    assert c.get("eager_cache_hits", 0) + c.get("eager_cache_misses", 0) == 2  # isin, any


def test_logits_processor_list_reads_signatures_once():
    """On "tpu" ``LogitsProcessorList`` reads each processor's ``__call__`` parameters once per
    function (integrations/generate_steps.py): scores equal CPU's, a processor that takes extra
    keyword arguments gets them, and a missing one raises transformers' own error."""
    from transformers.generation import logits_process as lp

    from torchtpu.integrations import STATUS, generate_steps

    assert STATUS["transformers.generation.logits_process.LogitsProcessorList.__call__"] \
        == "applied"

    class Extra(lp.LogitsProcessor):
        def __call__(self, input_ids, scores, bonus):
            return scores + bonus

    scores = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))

    def procs(device):
        return lp.LogitsProcessorList([
            lp.MinLengthLogitsProcessor(8, [2, 5], device=device),
            lp.RepetitionPenaltyLogitsProcessor(1.3), Extra()])

    expect = procs("cpu")(ids, scores, bonus=0.5)
    tpu = procs(TPU)
    for _ in range(2):
        got = tpu(ids.to(TPU), scores.to(TPU), bonus=0.5)
        assert got.device.type == "tpu"
        torch.testing.assert_close(got.cpu(), expect, rtol=0, atol=0)
    assert generate_steps._PARAMS[Extra.__call__] == ("input_ids", "scores", "bonus")
    with pytest.raises(ValueError, match="required parameters"):
        tpu(ids.to(TPU), scores.to(TPU))
    with pytest.raises(ValueError, match="required parameters"):
        procs("cpu")(ids, scores)


def test_sdpa_mask_positions_made_once():
    """A static-cache decode step's causal mask (``masking_utils.sdpa_mask``, built outside the
    compiled step every token) takes its key and query positions from tensors made once on
    "tpu" (integrations/generate_steps.py): the mask equals transformers' own on CPU for a
    tensor (int64 or int32) or int query offset, key offsets, several queries and a
    left-padded batch, and a later token (one query at a 0-d tensor offset, a static cache's
    ``cumulative_length``) runs one program: the comparison, the offset add left out."""
    from transformers import masking_utils as mu

    from torchtpu.integrations import STATUS

    assert STATUS["transformers.masking_utils.sdpa_mask"] == "applied"
    assert mu.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is mu.sdpa_mask
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :3] = False  # a left-padded row
    cases = [dict(batch_size=1, q_length=1, kv_length=16, q_offset=torch.tensor(5)),
             dict(batch_size=1, q_length=1, kv_length=16,
                  q_offset=torch.tensor(9, dtype=torch.int32), kv_offset=3),
             dict(batch_size=1, q_length=1, kv_length=16, q_offset=7),
             dict(batch_size=1, q_length=3, kv_length=12, q_offset=4, kv_offset=2),
             dict(batch_size=2, q_length=1, kv_length=16, q_offset=torch.tensor(8),
                  attention_mask=pad),
             dict(batch_size=2, q_length=2, kv_length=8, q_offset=3, kv_offset=1,
                  attention_mask=pad)]
    for kw in cases:
        expect = mu.sdpa_mask(allow_is_causal_skip=False, device="cpu", **kw)
        on_tpu = {k: v.to(TPU) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        for _ in range(2):
            got = mu.sdpa_mask(allow_is_causal_skip=False, device=torch.device(TPU), **on_tpu)
            assert got.device.type == "tpu" and got.shape == expect.shape
            assert torch.equal(got.cpu(), expect), kw
    # a later decode token: the comparison only (arange(1) + q_offset is q_offset)
    q_offset = torch.tensor(6, device=TPU)
    mu.sdpa_mask(1, 1, 16, q_offset=q_offset, allow_is_causal_skip=False, device=TPU)
    torch.tpu.reset_metrics()
    got = mu.sdpa_mask(1, 1, 16, q_offset=q_offset, allow_is_causal_skip=False, device=TPU)
    m = torch.tpu.metrics()
    c = m["counters"]
    assert c.get("eager_cache_hits", 0) + c.get("eager_cache_misses", 0) == 1
    assert m["per_op"]["generate_programs_saved"]["sdpa_mask"] == 6
    assert torch.equal(got.cpu(), mu.sdpa_mask(1, 1, 16, q_offset=6, allow_is_causal_skip=False))
    q_offset.add_(1)  # the cache's in-place step: the next mask reads the new offset
    got = mu.sdpa_mask(1, 1, 16, q_offset=q_offset, allow_is_causal_skip=False, device=TPU)
    assert torch.equal(got.cpu(), mu.sdpa_mask(1, 1, 16, q_offset=7, allow_is_causal_skip=False))
    # what it does not take stays transformers' (a skip is allowed: no mask at all)
    assert mu.sdpa_mask(1, 4, 4, device=TPU) is None


def test_update_model_kwargs_positions_one_add():
    """On "tpu" ``_update_model_kwargs_for_generation`` makes the next position ids as
    ``position_ids[..., -1:] + (arange(n) + 1)``, the second term made once
    (integrations/generate_steps.py): the kwargs equal transformers' own on CPU for 2D and 3D,
    int64 and int32 (wrapping past the int32 maximum) position ids and several new tokens, the
    keys keep their order, and a later token runs two programs (the add and the cat) for the
    position ids, where transformers runs four."""
    from transformers.generation.utils import GenerationMixin

    from torchtpu.integrations import STATUS

    assert STATUS["transformers.generation.utils.GenerationMixin._update_model_kwargs_for_"
                  "generation"] == "applied"
    update = GenerationMixin._update_model_kwargs_for_generation
    big = 2 ** 31 - 2
    cases = [(torch.arange(6).view(1, 6).repeat(2, 1), 1),
             (torch.arange(6).view(1, 6).repeat(2, 1) + 3, 3),
             (torch.arange(5, dtype=torch.int32).view(1, 1, 5).repeat(3, 2, 1) + big, 2)]
    for pos, n in cases:
        def kwargs(device):
            return {"attention_mask": torch.ones(2, pos.shape[-1], dtype=torch.long,
                                                 device=device),
                    "position_ids": pos.to(device), "use_cache": True}
        expect = update(None, {}, kwargs("cpu"), num_new_tokens=n)
        for _ in range(2):
            got = update(None, {}, kwargs(TPU), num_new_tokens=n)
            assert list(got) == list(expect)
            for k, v in expect.items():
                if isinstance(v, torch.Tensor):
                    assert got[k].device.type == "tpu" and got[k].dtype == v.dtype, k
                    assert torch.equal(got[k].cpu(), v), (k, got[k], v)
                else:
                    assert got[k] == v
    pos = torch.arange(6, device=TPU).view(1, 6)
    update(None, {}, {"position_ids": pos}, num_new_tokens=1)
    torch.tpu.reset_metrics()
    got = update(None, {}, {"position_ids": pos}, num_new_tokens=1)
    m = torch.tpu.metrics()
    c = m["counters"]
    assert c.get("eager_cache_hits", 0) + c.get("eager_cache_misses", 0) == 2  # add, cat
    assert m["per_op"]["generate_programs_saved"] == {"position_ids": 2}
    assert got["position_ids"].cpu().tolist() == [[0, 1, 2, 3, 4, 5, 6]]


def test_prepare_inputs_takes_the_fresh_next_positions(models):
    """On "tpu" ``prepare_inputs_for_generation`` takes the next position ids the kwargs update
    made (integrations/generate_steps.py) instead of slicing and cloning them from the grown
    ``position_ids``: the model inputs equal transformers' own on CPU, the position ids are a
    fresh contiguous tensor (not a view of the kwargs'), handed out once, and not taken after
    an in-place change or for another length."""
    cpu, tpu = models
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(6).view(1, 6).repeat(2, 1)

    def step(model, device, n=1):
        kw = model._update_model_kwargs_for_generation(
            {}, {"position_ids": pos.to(device), "use_cache": True}, num_new_tokens=n)
        return kw

    expect = cpu.prepare_inputs_for_generation(ids, next_sequence_length=1, **step(cpu, "cpu"))
    for _ in range(2):
        kw = step(tpu, TPU)
        full = kw["position_ids"]
        torch.tpu.reset_metrics()
        got = tpu.prepare_inputs_for_generation(ids.to(TPU), next_sequence_length=1, **kw)
        saved = torch.tpu.metrics()["per_op"]["generate_programs_saved"]
        assert saved == {"position_ids": 1}, saved
        assert list(got) == list(expect)
        for k, v in expect.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got[k].cpu(), v), k
        p = got["position_ids"]
        assert p.is_contiguous() and p.untyped_storage().data_ptr() \
            != full.untyped_storage().data_ptr()
        # handed out once: a second prepare from the same kwargs slices and clones
        again = tpu.prepare_inputs_for_generation(ids.to(TPU), next_sequence_length=1, **kw)
        assert again["position_ids"] is not p and torch.equal(again["position_ids"].cpu(),
                                                              expect["position_ids"])
    kw = step(tpu, TPU)
    kw["position_ids"].add_(10)  # changed in place: its own values are taken
    got = tpu.prepare_inputs_for_generation(ids.to(TPU), next_sequence_length=1, **kw)
    assert got["position_ids"].cpu().tolist() == [[16], [16]]
    kw = step(tpu, TPU, n=2)  # two new positions, one asked for
    got = tpu.prepare_inputs_for_generation(ids.to(TPU), next_sequence_length=1, **kw)
    assert got["position_ids"].cpu().tolist() == [[7], [7]]
