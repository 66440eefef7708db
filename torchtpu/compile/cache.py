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


# Executables loaded or stored in this process, by key: a payload is deserialized at most once
# per process (XLA:CPU failed with "Function ... not found" when the same large executable was
# deserialized twice and both copies were alive), and a recompile after torch._dynamo.reset()
# reuses the executable.
_MEMO: dict = {}


def load(key: str, lowered):
    """The compiled executable for ``key`` (this process's, else from disk), or None (a miss)."""
    hit = _MEMO.get(key)
    if hit is not None:
        count("compile_process_cache_hits")
        return hit
    compiled = _load(key, lowered)
    if compiled is not None:
        _MEMO[key] = compiled
    return compiled


def _load(key: str, lowered):
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
    _MEMO[key] = compiled
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


# ---- graph-level entries: skip tracing and lowering on a warm start ----
#
# Keyed by the aten graph's code, its constants, the input signature, donation, compiler
# options, the source of the lowering table and of this package, and the code of each lowering
# the graph uses. A hit gives the executable plus what the trace would have recorded (the
# pytree structures and the non-array outputs), so no JAX tracing happens at all.

_MAGIC_G = b"TORCHTPU-XLA-GRAPH-1\n"
_src_hash = []


def _sources_hash() -> str:
    if not _src_hash:
        import glob

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        h = hashlib.sha256()
        for sub in ("lowering", "compile", "eager"):
            for p in sorted(glob.glob(os.path.join(root, sub, "*.py"))):
                with open(p, "rb") as f:
                    h.update(p[len(root):].encode())
                    h.update(f.read())
        _src_hash.append(h.hexdigest())
    return _src_hash[0]


def graph_key(code: str, constants: list, signature, donate, n_random, compiler_options,
              lowerings) -> str:
    if not _fp:
        _fp.append(_env_fingerprint())
    h = hashlib.sha256()
    for part in (_fp[0], _sources_hash(), code, repr(signature), repr(donate), repr(n_random),
                 repr(sorted((str(k), str(v)) for k, v in compiler_options.items()))):
        h.update(part.encode())
        h.update(b"\0")
    for c in constants:
        h.update(c)
    for fn in lowerings:
        code_obj = getattr(fn, "__code__", None)
        h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}".encode())
        if code_obj is not None:
            h.update(code_obj.co_code)
            h.update(repr(code_obj.co_consts).encode())
    return "g" + h.hexdigest()


def load_graph(key: str):
    """(compiled, meta) for a graph key (this process's, else from disk), or None."""
    hit = _MEMO.get(key)
    if hit is not None:
        count("compile_process_cache_hits")
        return hit
    got = _load_graph(key)
    if got is not None:
        _MEMO[key] = got
    return got


def _load_graph(key: str):
    import pickle
    import struct

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
        head = _MAGIC_G + key.encode() + b"\n"
        if not data.startswith(head):
            raise ValueError("foreign or corrupt cache entry")
        (n,) = struct.unpack("<Q", data[len(head):len(head) + 8])
        meta = pickle.loads(data[len(head) + 8:len(head) + 8 + n])
        from jax.experimental.serialize_executable import deserialize_and_load

        compiled = deserialize_and_load(data[len(head) + 8 + n:], meta["in_tree"], meta["out_tree"])
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
    return compiled, meta


def store_graph(key: str, compiled, meta: dict) -> None:
    import pickle
    import struct

    _MEMO[key] = (compiled, meta)
    path = _path(key)
    if path is None:
        return
    try:
        from jax.experimental.serialize_executable import serialize

        payload = serialize(compiled)[0]
        m = pickle.dumps(meta)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC_G + key.encode() + b"\n")
            f.write(struct.pack("<Q", len(m)))
            f.write(m)
            f.write(payload)
        os.replace(tmp, path)
        count("compile_disk_cache_writes")
    except Exception as e:  # noqa: BLE001
        count("compile_disk_cache_write_errors")
        if not _warned[0]:
            _warned[0] = True
            warnings.warn(f"torchtpu.compile: could not write compile-cache entry ({e})",
                          stacklevel=3)
