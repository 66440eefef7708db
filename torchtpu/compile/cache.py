"""Persistent compile cache: serialized XLA executables on disk, shared across processes.

The key is a hash of the lowered StableHLO module (which includes input/output aliasing from
donation), the XLA compiler options, and everything that could make an executable foreign: jax
and jaxlib versions, the PJRT platform and device kind, torchtpu's version. An entry is one
file: a magic line, the key, then the payload. A missing, truncated, corrupt or foreign entry is
a miss (counted); the executable is rebuilt and the entry rewritten atomically. Nothing here can
fail a compile: every error degrades to a plain XLA compile.

Directory: $TORCHTPU_CACHE_DIR, else ``$XDG_CACHE_HOME/torchtpu/xla`` (``~/.cache/torchtpu/xla``).
Set ``TORCHTPU_CACHE_DIR=`` (empty) to turn the persistent cache off.

Size: the folder is kept under ``TORCHTPU_CACHE_MAX_BYTES`` (default 4 GiB; 0: no limit). A
hit marks its entry used (mtime); a process prunes at its first write and after every further
tenth of the limit it has written: when the entries exceed the limit, the least recently used
go until 80% of it is left (counted: ``disk_cache_pruned_entries``), and temporary files that
crashed writers left behind for over an hour go too. Pruning races with other processes
harmlessly: a reader whose entry vanishes sees a miss; an entry is never partly deleted.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import types
import warnings

import jax

from ..runtime.metrics import count

_MAGIC = b"TORCHTPU-XLA-CACHE-2\n"
_MAGIC_G = b"TORCHTPU-XLA-GRAPH-2\n"
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

    from ..runtime import devices as _devices

    # an executable is bound to its device: ranks sharing a cache folder must not share entries
    dev = _devices.jax_device(0)
    return "|".join([jax.__version__, getattr(jaxlib, "__version__", "?"), dev.platform,
                     getattr(dev, "device_kind", "?"), __version__,
                     f"device {dev.id} of {jax.device_count(dev.platform)}"])


_fp = []


def key_of(hlo_text: str, compiler_options: dict, devices=()) -> str:
    """``devices``: the ids of the devices the executable runs on (the HLO does not say)."""
    if not _fp:
        _fp.append(_env_fingerprint())
    h = hashlib.sha256()
    h.update(_fp[0].encode())
    if devices:
        h.update(repr(tuple(devices)).encode())
    h.update(repr(sorted((str(k), str(v)) for k, v in compiler_options.items())).encode())
    h.update(hlo_text.encode())
    return h.hexdigest()


def _path(key: str) -> str | None:
    d = cache_dir()
    return None if d is None else os.path.join(d, key[:2], key + ".xla")


# Executables loaded or stored in this process, by key, so a payload is deserialized at most once
# per process and a recompile after torch._dynamo.reset() reuses the executable.
_MEMO: dict = {}
# The serialized bytes behind each executable in _MEMO (keyed like it). A graph entry copies the
# payload of its program entry from here: XLA:CPU (jaxlib 0.10) drops kernels when an executable
# that was itself deserialized is serialized again ("Function ... not found" when the copy runs in
# another process), so an executable is serialized once, right after XLA compiled it.
_PAYLOADS: dict = {}


def _warn_once(msg: str) -> None:
    if not _warned[0]:
        _warned[0] = True
        warnings.warn(msg, stacklevel=4)


MAX_BYTES = int(os.environ.get("TORCHTPU_CACHE_MAX_BYTES", str(4 << 30)))
_written = [0, True]  # bytes written since the last prune; whether this process has pruned yet


def prune(max_bytes: int | None = None, keep: float = 0.8) -> int:
    """Delete the least recently used entries while the folder holds more than ``max_bytes``
    (default ``MAX_BYTES``), down to ``keep`` of it; also stale temporary files. Returns the
    number of entries deleted."""
    d = cache_dir()
    limit = MAX_BYTES if max_bytes is None else max_bytes
    if d is None or limit <= 0 or not os.path.isdir(d):
        return 0
    import time

    entries = []
    total = 0
    now = time.time()
    for sub in os.scandir(d):
        if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
            continue  # only the two-hex-digit entry folders (native/ and others are not ours)
        try:
            files = list(os.scandir(sub.path))
        except OSError:
            continue
        for f in files:
            try:
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue
            if f.name.endswith(".tmp"):
                if now - st.st_mtime > 3600:
                    _unlink(f.path)
                continue
            if f.name.endswith(".xla"):
                entries.append((st.st_mtime, st.st_size, f.path))
                total += st.st_size
    if total <= limit:
        return 0
    entries.sort()
    removed = 0
    for _, size, path in entries:
        if total <= limit * keep:
            break
        if _unlink(path):
            removed += 1
        total -= size
    count("disk_cache_pruned_entries", removed)
    return removed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _after_write(nbytes: int) -> None:
    _written[0] += nbytes
    if _written[1] or (MAX_BYTES > 0 and _written[0] > MAX_BYTES // 10):
        _written[0] = 0
        _written[1] = False
        try:
            prune()
        except Exception:  # noqa: BLE001 - pruning never fails a compile
            pass


def _read(key: str, magic: bytes, kind: str = "compile") -> bytes | None:
    """The body of the entry for ``key`` (after its header), or None (a miss, counted as
    ``<kind>_disk_cache_misses``)."""
    path = _path(key)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        count(f"{kind}_disk_cache_misses")
        return None
    head = magic + key.encode() + b"\n"
    if data.startswith(head):
        try:
            os.utime(path)  # used now: pruning removes the least recently used entries first
        except OSError:
            pass
        return data[len(head):]
    if data.startswith(b"TORCHTPU-XLA-") and not data.startswith(magic):
        # written by an older torchtpu (another entry format): replaced without a warning
        count(f"{kind}_disk_cache_misses")
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    _discard(path, ValueError("foreign or corrupt cache entry"), kind)
    return None


def _discard(path: str, err: Exception, kind: str = "compile") -> None:
    """An unusable entry is a miss: counted, warned about once, removed so it is rewritten."""
    count(f"{kind}_disk_cache_errors")
    count(f"{kind}_disk_cache_misses")
    _warn_once(f"torchtpu.compile: ignoring unusable compile-cache entry {path} "
               f"({type(err).__name__}: {err}); recompiling")
    try:
        os.unlink(path)
    except OSError:
        pass


def _write(key: str, magic: bytes, *parts: bytes, kind: str = "compile") -> None:
    """Atomically write an entry (header, then ``parts``); an unwritable cache is not an error."""
    path = _path(key)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(magic + key.encode() + b"\n")
            for p in parts:
                f.write(p)
        os.replace(tmp, path)
        count(f"{kind}_disk_cache_writes")
        _after_write(sum(len(p) for p in parts))
    except Exception as e:  # noqa: BLE001
        count(f"{kind}_disk_cache_write_errors")
        try:
            os.unlink(tmp)
        except Exception:  # noqa: BLE001
            pass
        _warn_once(f"torchtpu.compile: could not write compile-cache entry ({e})")


def _deserialize(key: str, payload: bytes, in_tree, out_tree, device=None):
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        if device is None:
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        else:  # loaded onto its own device only (not every device of the platform)
            compiled = deserialize_and_load(payload, in_tree, out_tree, backend=device.client,
                                            execution_devices=[device])
    except Exception as e:  # noqa: BLE001 - any bad entry is just a miss
        _discard(_path(key), e)
        return None
    count("compile_disk_cache_hits")
    _PAYLOADS[key] = payload
    return compiled


def load(key: str, lowered, device=None):
    """The compiled executable for ``key`` (this process's, else from disk), or None (a miss)."""
    hit = _MEMO.get(key)
    if hit is not None:
        count("compile_process_cache_hits")
        return hit
    body = _read(key, _MAGIC)
    compiled = None if body is None else _deserialize(key, body, lowered.in_tree,
                                                      lowered.out_tree, device)
    if compiled is not None:
        _MEMO[key] = compiled
    return compiled


def store(key: str, compiled) -> None:
    """Keep a freshly compiled executable, and write it to disk (serialized once, here)."""
    _MEMO[key] = compiled
    if _path(key) is None:
        return
    try:
        from jax.experimental.serialize_executable import serialize

        _PAYLOADS[key] = serialize(compiled)[0]
    except Exception as e:  # noqa: BLE001 - an unserializable executable is just not cached
        count("compile_disk_cache_write_errors")
        _warn_once(f"torchtpu.compile: could not serialize an executable for the cache ({e})")
        return
    _write(key, _MAGIC, _PAYLOADS[key])


# ---- graph-level entries: skip tracing and lowering on a warm start ----
#
# Keyed by the aten graph's code, its constants, the input signature, donation, compiler
# options, the source of the lowering table and of this package, and the code of each lowering
# the graph uses. A hit gives the executable plus what the trace would have recorded (the
# pytree structures and the non-array outputs), so no JAX tracing happens at all.

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
    # comments are node metadata (source lines), absent from graphs aot_cache.py reloads
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("#"))
    for part in (_fp[0], _sources_hash(), code, repr(signature), repr(donate), repr(n_random),
                 repr(sorted((str(k), str(v)) for k, v in compiler_options.items()))):
        h.update(part.encode())
        h.update(b"\0")
    for c in constants:
        h.update(c)
    for fn in lowerings:
        h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}".encode())
        code_obj = getattr(fn, "__code__", None)
        if code_obj is not None:
            _hash_code(h, code_obj)
    return "g" + h.hexdigest()


def _hash_code(h, code_obj) -> None:
    """Hash a function's bytecode and constants, recursing into nested code objects (whose repr
    holds a memory address, which would make the key differ in every process)."""
    h.update(code_obj.co_code)
    for c in code_obj.co_consts:
        if isinstance(c, types.CodeType):
            _hash_code(h, c)
        else:
            h.update(repr(c).encode())


def load_graph(key: str, device=None):
    """(compiled, meta) for a graph key (this process's, else from disk), or None."""
    import pickle
    import struct

    hit = _MEMO.get(key)
    if hit is not None:
        count("compile_process_cache_hits")
        return hit
    body = _read(key, _MAGIC_G)
    if body is None:
        return None
    try:
        (n,) = struct.unpack("<Q", body[:8])
        meta = pickle.loads(body[8:8 + n])
    except Exception as e:  # noqa: BLE001
        _discard(_path(key), e)
        return None
    compiled = _deserialize(key, body[8 + n:], meta["in_tree"], meta["out_tree"], device)
    if compiled is None:
        return None
    _MEMO[key] = (compiled, meta)
    return compiled, meta


def store_graph(key: str, program_key: str, meta: dict) -> None:
    """Write a graph entry for the executable stored or loaded under ``program_key``."""
    import pickle
    import struct

    _MEMO[key] = (_MEMO[program_key], meta)
    payload = _PAYLOADS.get(program_key)
    if payload is None or _path(key) is None:
        return
    m = pickle.dumps(meta)
    _write(key, _MAGIC_G, struct.pack("<Q", len(m)), m, payload)
