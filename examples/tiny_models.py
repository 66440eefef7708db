"""Tiny random-weight causal LMs built from configs (Llama, Qwen2, Mistral style), saved with an
offline word-level tokenizer: what the vLLM tests and benchmark serve. No download.

    python examples/tiny_models.py llama /tmp/tiny-llama
"""
from __future__ import annotations

import sys

import torch
import transformers

WORDS = ("the a cat dog sat on mat ran far fast slow big small red blue green tree house sun "
         "moon star sky sea hello world how are you today what is your name my friend good day "
         "night one two three four five six seven eight nine ten up down left right in out of "
         "and or not yes no").split()

ARCHS = ("llama", "qwen2", "mistral")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(special + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return fast, len(vocab)


def save_tiny_model(path, arch: str = "llama", layers: int = 2, hidden: int = 64,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                    max_positions: int = 1024, seed: int = 0, dtype=torch.float32) -> str:
    """Save a tiny ``arch`` model (random weights, ``seed``) and its tokenizer to ``path``."""
    tok, vocab = _tokenizer()
    common = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate,
                  vocab_size=vocab, max_position_embeddings=max_positions, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                  torch_dtype=dtype)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg, cls = (transformers.MistralConfig(sliding_window=None, **common),
                    transformers.MistralForCausalLM)
    else:
        raise ValueError(f"arch must be one of {ARCHS}")
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    if arch == "qwen2":  # qkv biases (Qwen's) random too, so a missing bias shows
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias,
                          layer.self_attn.v_proj.bias):
                    p.normal_(0, 0.5)
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def hf_greedy(path, prompts_ids, max_tokens: int, dtype=torch.float32) -> list[list[int]]:
    """Greedy continuation ids of each prompt by transformers on CPU (the reference), the
    model computing in ``dtype``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts_ids:
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=max_tokens, do_sample=False,
                               attention_mask=torch.ones_like(x), pad_token_id=0,
                               eos_token_id=None)
            out.append(y[0, len(ids):].tolist())
    return out


if __name__ == "__main__":
    arch = sys.argv[1] if len(sys.argv) > 1 else "llama"
    path = sys.argv[2] if len(sys.argv) > 2 else f"tiny-{arch}"
    print("saved to", save_tiny_model(path, arch))
