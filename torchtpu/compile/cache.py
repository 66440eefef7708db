"""Persistent compile cache: serialized XLA executables on disk, shared across processes.

The key is a hash of the lowered StableHLO module (which includes input/output aliasing from
donation), the XLA compiler options, and everything that could make an executable foreign: jax
and jaxlib versions, the PJRT platform and device kind, torchtpu's version. An entry is one
file: a magic line, the key, then the payload. A missing, truncated, corrupt or foreign entry is
a miss (counted); the executable is rebuilt and the entry rewritten atomically. Nothing here can
fail a compile: every error degrades to a plain XLA compile.

Directory: $TORCHTPU_CACHE_DIR, else ``$XDG_CACHE_HOME/torchtpu/xla`` (``~/.cache/torchtpu/xla``).
Set ``TORCHTPU_CACHE_DIR=`` (empty) to turn the persistent cache off.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import warnings

import jax

from ..runtime.metrics import count

_MAGIC = b"TORCHTPU-XLA-CACHE-1\n"
_warned = [False]


def cache_dir() -> str | None:
    d = os.environ.get("TORCHTPU_CACHE_DIR")
    if d is not None:
        return d or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def _env_fingerprint() -> str:
    import jaxlib

    from .. import __version__

    dev = jax.devices()[0]
    return "|".join([jax.__version__, getattr(jaxlib, "__version__", "?"), dev.platform,
                     getattr(dev, "device_kind", "?"), __version__])


_fp = []


def key_of(hlo_text: str, compiler_options: dict) -> str:
    if not _fp:
        _fp.append(_env_fingerprint())
    h = hashlib.sha256()
    h.update(_fp[0].encode())
    h.update(repr(sorted((str(k), str(v)) for k, v in compiler_options.items())).encode())
    h.update(hlo_text.encode())
    return h.hexdigest()


def _path(key: str) -> str | None:
    d = cache_dir()
    return None if d is None else os.path.join(d, key[:2], key + ".xla")


def load(key: str, lowered):
    """The compiled executable for ``key`` from disk, or None (a miss)."""
    path = _path(key)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        count("compile_disk_cache_misses")
        return None
    try:
        head = _MAGIC + key.encode() + b"\n"
        if not data.startswith(head):
            raise ValueError("foreign or corrupt cache entry")
        from jax.experimental.serialize_executable import deserialize_and_load

        compiled = deserialize_and_load(data[len(head):], lowered.in_tree, lowered.out_tree)
    except Exception as e:  # noqa: BLE001 - any bad entry is just a miss
        count("compile_disk_cache_errors")
        count("compile_disk_cache_misses")
        if not _warned[0]:
            _warned[0] = True
            warnings.warn(f"torchtpu.compile: ignoring unusable compile-cache entry {path} "
                          f"({type(e).__name__}: {e}); recompiling", stacklevel=3)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    count("compile_disk_cache_hits")
    return compiled


def store(key: str, compiled) -> None:
    path = _path(key)
    if path is None:
        return
    try:
        from jax.experimental.serialize_executable import serialize

        payload = serialize(compiled)[0]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + key.encode() + b"\n")
            f.write(payload)
        os.replace(tmp, path)
        count("compile_disk_cache_writes")
    except Exception as e:  # noqa: BLE001 - an unwritable cache is not an error
        count("compile_disk_cache_write_errors")
        if not _warned[0]:
            _warned[0] = True
            warnings.warn(f"torchtpu.compile: could not write compile-cache entry ({e})",
                          stacklevel=3)
