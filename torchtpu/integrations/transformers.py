"""Hugging Face transformers on "tpu" (placeholder, filled below)."""
from __future__ import annotations


def install() -> None:
    pass
