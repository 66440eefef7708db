"""Save a tiny random-weight chat model (Llama, word-level tokenizer, chat template) to a folder.

    python examples/tiny_chat_model.py tiny-chat

No download: the tokenizer is built from a fixed word list, the weights are random (seed 0), so
the model's answers are random words. Used by examples/serve.md and tests/test_serve.py.
"""
from __future__ import annotations

import sys

import torch
import transformers

WORDS = ("the a cat dog sat on mat ran far fast slow big small red blue green tree house sun "
         "moon star sky sea hello world how are you today what is your name my friend good day "
         "night").split()


def save_tiny_chat_model(path) -> None:
    """A tiny Llama, its word-level tokenizer and a chat template, saved to ``path``."""
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
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=len(vocab), max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    fast.save_pretrained(path)


if __name__ == "__main__":
    save_tiny_chat_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-chat")
    print(f"saved to {sys.argv[1] if len(sys.argv) > 1 else 'tiny-chat'}")
