"""Hugging Face transformers models (tiny configs, random weights, no downloads) on "tpu" vs CPU.

Each model is built from a config object on CPU with a fixed seed, deep-copied and moved to
"tpu"; forward logits, the loss, and a few SGD training steps (losses and final parameters) are
compared with ``torch.testing.assert_close`` at its float32 defaults, in Strict eager and under
``torch.compile(backend="tpu")`` (and Fused eager for one model). Greedy ``generate`` (KV cache)
must produce CPU's tokens. SGD rather than Adam: attention key biases have an exactly-zero true
gradient, and Adam would amplify its rounding noise into backend-dependent updates.

``transformers`` comes with the ``test`` extra (``make test`` installs it); without it this file
is skipped.
"""
from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (optional test dependency)")

TPU = torch.device("tpu")
VOCAB = 64
logging.getLogger("transformers").setLevel(logging.ERROR)


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=1,
        eos_token_id=2, pad_token_id=0))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, num_heads=4, d_kv=8, d_ff=64,
        vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))


def mixtral():
    # a mixture of experts with its router's auxiliary loss: transformers counts tokens per
    # expert with an int32 torch.histc off CPU (float on CPU), as it does on CUDA
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0))


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5, "mixtral": mixtral}


def make_pair(name):
    torch.manual_seed(0)
    cpu_model = MODELS[name]()
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    return cpu_model, tpu_model


def batches(n, seed=3):
    """(input_ids, attention_mask, labels): right padding on the second row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (2, 8), generator=g)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0
        labels = ids.clone()
        labels[1, 6:] = -100
        out.append(dict(input_ids=ids, attention_mask=mask, labels=labels))
    return out


def to(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def ctx(mode):
    if mode == "fused":
        return torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    return contextlib.nullcontext()


def train(model, device, data, mode="strict"):
    fn = model
    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(model, backend="tpu")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, logits = [], None
    with ctx(mode):
        for batch in data:
            opt.zero_grad(set_to_none=True)
            out = fn(**to(batch, device))
            if logits is None:
                logits = out.logits.detach().cpu()
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(out.loss.detach().cpu())
    return torch.stack(losses), logits


def assert_params_close(cpu_model, tpu_model):
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        assert pt.device.type == "tpu", n
        torch.testing.assert_close(pt.detach().cpu(), pc.detach(), msg=lambda m: f"{n}: {m}")


CASES = [pytest.param(n, m, id=f"{n}-{m}") for n in MODELS for m in ("strict", "compile")]
CASES.append(pytest.param("gpt2", "fused", id="gpt2-fused"))


@pytest.mark.parametrize("name,mode", CASES)
def test_forward_and_training(name, mode):
    cpu_model, tpu_model = make_pair(name)
    data = batches(2)
    cl, clog = train(cpu_model, "cpu", data)
    tl, tlog = train(tpu_model, TPU, data, mode)
    torch.testing.assert_close(tlog, clog)
    torch.testing.assert_close(tl, cl)
    assert_params_close(cpu_model, tpu_model)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_greedy_generate(name):
    cpu_model, tpu_model = make_pair(name)
    ids = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(5))
    outs = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        model.eval()
        with torch.no_grad():
            outs.append(model.generate(ids.to(dev), attention_mask=torch.ones_like(ids).to(dev),
                                       max_new_tokens=4, do_sample=False, pad_token_id=0).cpu())
    assert outs[1].shape == (1, 8)
    torch.testing.assert_close(outs[1], outs[0])


def test_gpt2_autocast_bfloat16_matches_cpu_autocast():
    """autocast("tpu", bfloat16): logits bf16 and loss fp32 as under CPU/CUDA autocast; values
    agree with CPU autocast to bfloat16 precision; backward leaves fp32 grads."""
    cpu_model, tpu_model = make_pair("gpt2")
    batch = batches(1)[0]
    outs = []
    for model, dev in ((cpu_model, "cpu"), (tpu_model, TPU)):
        with torch.autocast(dev if dev == "cpu" else "tpu", dtype=torch.bfloat16):
            out = model(**to(batch, dev))
        assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
        out.loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters()
                   if p.grad is not None)
        outs.append((out.loss.detach().cpu(), out.logits.detach().float().cpu()))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=2e-2, rtol=1.6e-2)


def test_bert_sequence_classification_token_types():
    torch.manual_seed(0)
    cpu_model = transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3))
    tpu_model = copy.deepcopy(cpu_model).to(TPU)
    batch = batches(1)[0]
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    batch["token_type_ids"][:, 4:] = 1
    batch["labels"] = torch.tensor([0, 2])
    oc, ot = cpu_model(**batch), tpu_model(**to(batch, TPU))
    torch.testing.assert_close(ot.logits.cpu(), oc.logits)
    torch.testing.assert_close(ot.loss.cpu(), oc.loss)
    oc.loss.backward(), ot.loss.backward()
    for (n, pc), (_, pt) in zip(cpu_model.named_parameters(), tpu_model.named_parameters()):
        torch.testing.assert_close(pt.grad.cpu(), pc.grad, msg=lambda m: f"{n}: {m}")


def test_longformer_sliding_window_attention_compiled():
    """Longformer chunks its sequence with ``as_strided`` on a transposed (non-contiguous)
    tensor: the compiled graph must address storage elements through the input's real layout."""
    torch.manual_seed(0)
    model = transformers.LongformerModel(transformers.LongformerConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=40, attention_window=[8, 8],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)).eval()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, VOCAB, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch._dynamo.reset()
        compiled = torch.compile(copy.deepcopy(model).to(TPU), backend="tpu")
        got = compiled(input_ids=ids.to(TPU), attention_mask=mask.to(TPU)).last_hidden_state
    torch.testing.assert_close(got.cpu(), want)
