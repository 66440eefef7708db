"""A tiny random-weight Llama model with an offline word-level tokenizer, and synthetic parquet
data for VeRL's SFT trainer and GRPO: built from configs, nothing downloaded.

    python tests/verl_scripts/tiny_setup.py OUT_DIR   # OUT_DIR/model, OUT_DIR/sft_*.parquet,
                                                      # OUT_DIR/rl_*.parquet

SFT rows are arithmetic chats ("what is three plus four" -> "seven"). RL rows are prompts whose
reward (``reward.py`` beside this file) a tiny random model can learn within a few GRPO steps.
"""
from __future__ import annotations

import os
import random
import sys

NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
           "fourteen fifteen sixteen seventeen eighteen").split()
WORDS = NUMBERS + "what is plus minus the answer yes no ok".split()
SPECIAL = ["<pad>", "<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant",
           "system"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
                 "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
                 "{% endif %}")


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_model(path, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, seed=0):
    import torch
    import transformers

    tok = tokenizer()
    # Llama: VeRL's agent loop picks a chat-boundary builder per model type, and its Qwen one
    # needs a newline token, which this word-level vocabulary has not
    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=len(tok),
        max_position_embeddings=512, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    model.generation_config.do_sample = True
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _problems(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(9)
        if rng.random() < 0.5:
            out.append((f"what is {NUMBERS[a]} plus {NUMBERS[b]}", NUMBERS[a + b]))
        else:
            a, b = max(a, b), min(a, b)
            out.append((f"what is {NUMBERS[a]} minus {NUMBERS[b]}", NUMBERS[a - b]))
    return out


def save_sft(path, n, seed):
    import pandas as pd

    rows = [{"messages": [{"role": "user", "content": q},
                          {"role": "assistant", "content": f"the answer is {a}"}]}
            for q, a in _problems(n, seed)]
    pd.DataFrame(rows).to_parquet(path)


def save_rl(path, n, seed):
    """VeRL's RL dataset layout: a chat prompt, data_source naming the reward, ground truth."""
    import pandas as pd

    rows = [{"data_source": "tiny_arith", "prompt": [{"role": "user", "content": q}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"index": i}}
            for i, (q, a) in enumerate(_problems(n, seed))]
    pd.DataFrame(rows).to_parquet(path)


def main(out):
    os.makedirs(out, exist_ok=True)
    save_model(os.path.join(out, "model"))
    save_sft(os.path.join(out, "sft_train.parquet"), 64, 1)
    save_sft(os.path.join(out, "sft_val.parquet"), 16, 2)
    save_rl(os.path.join(out, "rl_train.parquet"), 256, 3)
    save_rl(os.path.join(out, "rl_val.parquet"), 16, 4)
    print("tiny VeRL setup in", out)


if __name__ == "__main__":
    main(sys.argv[1])
