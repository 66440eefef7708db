"""Pieces of the device layer beyond registration (serialization, accelerator APIs, ...)."""
from __future__ import annotations


def install() -> None:
    pass
