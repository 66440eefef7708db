"""Options of the "tpu" compile backend: torch.compile's ``mode=``/``options=`` and the XLA
compiler options set through ``torch.tpu.compiler.custom_compiler_options``.

Recognised ``options=`` keys:
- ``donate`` (bool, default True): donate the buffers of inputs the graph overwrites.
- ``persistent_cache`` (bool, default True): use the on-disk compile cache.
- ``xla_options`` / ``compiler_options`` (dict): XLA compiler options for this model's programs.
- ``bucket_size`` / ``num_dynamic_buckets`` (int): how dynamic sizes round up to buckets for
  graphs that can be padded exactly (compile/buckets.py); ``bucket_size=0`` turns it off.
  Process-wide defaults: ``torch.tpu.compiler.set_dynamic_buckets``.
Anything else, and any ``mode=``, does not apply to XLA: ignored with a one-time warning.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

KNOWN = {"donate", "persistent_cache", "xla_options", "compiler_options", "bucket_size",
         "num_dynamic_buckets"}
_warned: set = set()
_global = {"compiler_options": {}, "buckets": {}}
_local = threading.local()


def _warn_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"torch.compile(backend='tpu'): {what} does not apply to the tpu backend "
                      "and is ignored", stacklevel=4)


def resolve(mode, options, extra) -> dict:
    opts = {}
    if mode not in (None, "default"):
        _warn_once(f"mode={mode!r}")
    for k, v in dict(options or {}).items():
        if k in KNOWN:
            opts[k] = v
        else:
            _warn_once(f"option {k!r}")
    for k in extra:
        _warn_once(f"argument {k!r}")
    return opts


def get(opts: dict, name: str, default=None):
    return opts.get(name, default)


def current_compiler_options() -> dict:
    stack = getattr(_local, "stack", None)
    merged = dict(_global["compiler_options"])
    for d in stack or ():
        merged.update(d)
    return merged


def compiler_options(opts: dict) -> dict:
    """The XLA compiler options for one compile: global, then context, then per-model."""
    merged = current_compiler_options()
    merged.update(opts.get("compiler_options") or {})
    merged.update(opts.get("xla_options") or {})
    return {str(k): v for k, v in merged.items()}


class custom_compiler_options(contextlib.ContextDecorator):
    """Pass XLA compiler options (e.g. ``{"xla_cpu_enable_fast_math": False}``) to the programs
    that torch.compile(backend="tpu") builds.

    As a context manager (or decorator) the options apply to programs compiled inside it;
    called on its own, ``custom_compiler_options({...})`` sets them for the whole process
    (``custom_compiler_options({})`` clears them). The options are part of the compile-cache
    key, so changing them recompiles.
    """

    def __init__(self, options: dict | None = None, **kwargs):
        self.options = dict(options or {}, **kwargs)
        self._prev = dict(_global["compiler_options"])
        _global["compiler_options"] = dict(self.options)
        self._entered = False

    def __enter__(self):
        # undo the process-wide setting made by __init__; scope the options instead
        _global["compiler_options"] = self._prev
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self.options)
        self._entered = True
        return self

    def __exit__(self, *exc):
        _local.stack.pop()
        return False


def set_dynamic_buckets(num_dynamic_buckets: int | None = None,
                        bucket_size: int | None = None) -> None:
    """Process-wide defaults for how dynamic sizes round up to buckets (compile/buckets.py);
    ``torch.compile(..., options={"bucket_size": ..., "num_dynamic_buckets": ...})`` overrides
    them per model. ``bucket_size=0`` turns bucketing off."""
    b = {}
    if num_dynamic_buckets is not None:
        b["num_dynamic_buckets"] = int(num_dynamic_buckets)
    if bucket_size is not None:
        b["bucket_size"] = int(bucket_size)
    _global["buckets"] = b


def dynamic_bucket_defaults() -> dict:
    return dict(_global["buckets"])


def get_custom_compiler_options() -> dict:
    return current_compiler_options()
