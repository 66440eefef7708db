"""Persistent compile cache of torch.compile graphs: serialized XLA executables on disk.

Two kinds of entry, in the folder ``runtime/disk_cache.py`` manages (location, atomic writes,
damaged entries as misses, size limit): program entries, keyed by a hash of the lowered
StableHLO module (which includes input/output aliasing from donation), the XLA compiler options,
and everything that could make an executable foreign (jax and jaxlib versions, the PJRT platform
and device kind, torchtpu's version); and graph entries (below), which let a warm process skip
JAX tracing too. Both record the module's custom-call targets: an entry whose targets cannot be
made ready in this process (``runtime/custom_calls.py``) is a counted miss and is rebuilt.
"""
from __future__ import annotations

import hashlib
import os
import types

import jax

from ..runtime import custom_calls as _custom_calls
from ..runtime.disk_cache import (MAX_BYTES, _discard, _path, _read, _warn_once, _write,  # noqa: F401
                                  cache_dir, prune)
from ..runtime.metrics import count

_MAGIC = b"TORCHTPU-XLA-CACHE-2\n"
_MAGIC_G = b"TORCHTPU-XLA-GRAPH-3\n"  # 3: graph entries record their custom-call targets


def _env_fingerprint() -> str:
    import jaxlib

    from .._version import __version__

    from ..runtime import cpu_kernels as _cpu_kernels
    from ..runtime import devices as _devices

    # an executable is bound to its device: ranks sharing a cache folder must not share entries
    dev = _devices.jax_device(0)
    return "|".join([jax.__version__, getattr(jaxlib, "__version__", "?"), dev.platform,
                     getattr(dev, "device_kind", "?"), __version__,
                     f"device {dev.id} of {jax.device_count(dev.platform)}",
                     _cpu_kernels.switches()])


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


# Executables loaded or stored in this process, by key, so a payload is deserialized at most once
# per process and a recompile after torch._dynamo.reset() reuses the executable.
_MEMO: dict = {}
# The serialized bytes behind each executable in _MEMO (keyed like it). A graph entry copies the
# payload of its program entry from here: XLA:CPU (jaxlib 0.10) drops kernels when an executable
# that was itself deserialized is serialized again ("Function ... not found" when the copy runs in
# another process), so an executable is serialized once, right after XLA compiled it.
_PAYLOADS: dict = {}


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


def _unready(key: str, targets, kind: str = "compile") -> bool:
    """Whether an entry's custom calls cannot be made ready in this process (a counted miss,
    with its reason: the executable is rebuilt, never run)."""
    reason = _custom_calls.ready(targets)
    if reason is None:
        return False
    count(f"{kind}_disk_cache_misses")
    count(f"{kind}_disk_cache_unsafe", op=reason)
    return True


def load(key: str, lowered, device=None, targets=()):
    """The compiled executable for ``key`` (this process's, else from disk), or None (a miss).
    ``targets``: the module's custom-call targets (``custom_calls.targets``)."""
    hit = _MEMO.get(key)
    if hit is not None:
        count("compile_process_cache_hits")
        return hit
    if _unready(key, targets):
        return None
    body = _read(key, _MAGIC)
    compiled = None if body is None else _deserialize(key, body, lowered.in_tree,
                                                      lowered.out_tree, device)
    if compiled is not None:
        _MEMO[key] = compiled
    return compiled


def store(key: str, compiled, targets=()) -> None:
    """Keep a freshly compiled executable, and write it to disk (serialized once, here), unless
    one of its custom calls binds it to this process (a host callback)."""
    _MEMO[key] = compiled
    if _path(key) is None:
        return
    reason = _custom_calls.storable(targets)
    if reason is not None:
        count("compile_disk_cache_unstorable", op=reason)
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
    if _unready(key, meta.get("custom_calls", ())):
        return None
    compiled = _deserialize(key, body[8 + n:], meta["in_tree"], meta["out_tree"], device)
    if compiled is None:
        return None
    _MEMO[key] = (compiled, meta)
    return compiled, meta


def store_graph(key: str, program_key: str, meta: dict) -> None:
    """Write a graph entry for the executable stored or loaded under ``program_key``
    (``meta["custom_calls"]``: its module's custom-call targets, checked before a load)."""
    import pickle
    import struct

    _MEMO[key] = (_MEMO[program_key], meta)
    payload = _PAYLOADS.get(program_key)
    if payload is None or _path(key) is None:
        return
    m = pickle.dumps(meta)
    _write(key, _MAGIC_G, struct.pack("<Q", len(m)), m, payload)
