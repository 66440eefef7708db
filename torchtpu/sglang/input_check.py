"""Prompt token ids checked against the vocabulary before a request reaches the scheduler.

SGLang 0.5.23 checks a prompt's length (``TokenizerManager._validate_one_request``) but not
its token ids: ``/v1/completions`` with ``"prompt": [1000000000]`` reached the model's embedding,
whose index error on the device ended the scheduler process (a CUDA device assert would end
it too) -- one malformed request took the whole server down. The hook, before that check,
raises ``ValueError`` (SGLang answers it with a 400, as its own length check) for an id
outside ``[0, vocab_size)``. Multimodal requests are left alone: their placeholder ids are
hashes that SGLang maps into the vocabulary itself (``mm_utils``).
"""
from __future__ import annotations

_MM_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds")


def check_prompt_ids(self, obj, input_ids, *args, **kwargs):
    """BEFORE hook of ``TokenizerManager._validate_one_request(self, obj, input_ids)``."""
    if not input_ids or any(getattr(obj, f, None) is not None for f in _MM_FIELDS):
        return None
    vocab = getattr(getattr(self, "model_config", None), "vocab_size", None)
    if not vocab:
        return None
    bad = next((t for t in input_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"The input contains the token id {bad}, outside the model's "
                         f"vocabulary: valid ids are in [0, {vocab}).")
    return None
