"""One MLIR context per thread for JAX's lowerings, reused across modules.

JAX builds a fresh MLIR context for every module it lowers (``mlir.make_ir_context``), loading
every upstream dialect into it: 3-6 ms per lowering on this 2-core host, about a fifth of what a
first call of a one-op eager program costs in all (trace, lower, XLA compile). Eager execution
lowers one module per new op signature (a generate() with a growing KV cache: ~12 per token), so
each thread keeps its context and reuses it for ``TORCHTPU_IR_CONTEXT_REUSE`` modules (default
64; 0 turns reuse off). Then it starts a new one: a context keeps every attribute uniqued in it
(constants included) alive for its lifetime, so a bounded reuse count bounds what it holds. A
module's text does not depend on the context it was built in, so programs and cache keys are
unchanged. Counted as ``ir_contexts_created`` / ``ir_contexts_reused``.
"""
from __future__ import annotations

import os
import threading

from .metrics import count

REUSE = int(os.environ.get("TORCHTPU_IR_CONTEXT_REUSE", "64"))
_local = threading.local()
_installed: list = []


def install() -> None:
    """Route JAX's ``make_ir_context`` through the per-thread cache (idempotent)."""
    if _installed or REUSE <= 0:
        return
    from jax._src.interpreters import mlir

    make = mlir.make_ir_context

    def make_ir_context():
        ctx = getattr(_local, "ctx", None)
        if ctx is not None and _local.uses < REUSE:
            _local.uses += 1
            count("ir_contexts_reused")
            return ctx
        ctx = _local.ctx = make()
        _local.uses = 1
        count("ir_contexts_created")
        return ctx

    make_ir_context.__wrapped__ = make
    make_ir_context.__doc__ = make.__doc__
    mlir.make_ir_context = make_ir_context
    _installed.append(make)
