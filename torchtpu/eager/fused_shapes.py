"""The Fused executor's per-op output shapes, kept across processes.

Recording an op in Fused mode needs its outputs' shapes and dtypes before anything runs; the
first time a process meets an (op, static arguments, view specs, input shapes/dtypes) key it
gets them from ``jax.eval_shape`` of the op's traced function (a trace: 0.5-3 ms). A warm
process, whose programs all come from the compile cache folder, would still pay one trace per
op kind (a tiny Llama's ``generate``: ~360). So the abstract outputs of each key are kept in
the cache folder next to the programs: ``<cache folder>/fused-shapes/<fingerprint>``, one file
per ``program_cache.fingerprint()`` (the package's source, jax/jaxlib/torch versions, platform,
the jax options a lowering reads, ``XLA_FLAGS``: everything outside the key that decides what a
trace gives), read once at the first miss of a process, merged and rewritten atomically at
exit with what the process traced. A key is the executor key's process-independent spelling
(``program_cache.stable``) and the inputs' abstract values; a key part without one (a user's
``jax_op`` lowering) is traced every process, as before.

Results cannot change: what is kept is what the trace returned for the same key under the
same fingerprint; ops whose trace failed (an error, a lowering that branches on a traced
scalar) are never kept, so they trace and fail as before. A damaged or foreign file is
ignored (and replaced at exit). Counted: ``fused_op_shapes_loaded`` (a trace avoided),
``fused_op_shapes_unkeyable``.
"""
from __future__ import annotations

import atexit
import os
import pickle
import tempfile

import jax
import numpy as np

from ..runtime import disk_cache as _disk
from ..runtime import program_cache as _program_cache
from ..runtime.metrics import count

ENABLED = os.environ.get("TORCHTPU_FUSED_SHAPE_CACHE", "1") not in ("0", "")
MAX_ENTRIES = 65536
_MAGIC = "torchtpu-fused-shapes-1"

_known: list = []  # [dict: key text -> encoded outputs], read at the first lookup
_new: dict = {}  # traced by this process, written at exit
_aval = None  # fused._aval (set by fused.py): the canonical ShapeDtypeStruct factory
_static = None  # executor._Static


def _file() -> str | None:
    d = _disk.cache_dir()
    if d is None:
        return None
    return os.path.join(d, "fused-shapes", _program_cache.fingerprint()[:40])


def _read() -> dict:
    path = _file()
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            magic, entries = pickle.load(f)
        if magic != _MAGIC or type(entries) is not dict:
            return {}
        return entries
    except FileNotFoundError:
        return {}
    except Exception:  # noqa: BLE001 - damaged: traced again, rewritten at exit
        count("fused_op_shapes_damaged")
        return {}


def spell(skey) -> str | None:
    """The process-independent spelling of a node's executor key (``program_cache.stable``),
    or None (a part without one: a user's ``jax_op`` lowering)."""
    try:
        return _program_cache.stable(skey)
    except _program_cache.NotStable:
        count("fused_op_shapes_unkeyable")
        return None


def key_text(skey_text: str | None, flat_avals) -> str | None:
    """The persistent spelling of a recording key (the executor key's ``spell``ing and the
    inputs' abstract values), or None."""
    if skey_text is None or not ENABLED:
        return None
    return skey_text + "|" + ";".join([_program_cache.stable(a) for a in flat_avals])


def encode(x):
    if x is None:
        return None
    if type(x) is jax.ShapeDtypeStruct:
        return ("A", tuple(x.shape), x.dtype.name, bool(x.weak_type))
    if _static is not None and type(x) is _static:
        return ("S", x.value)
    if type(x) is tuple:
        return ("T", tuple(encode(e) for e in x))
    if type(x) is list:
        return ("L", tuple(encode(e) for e in x))
    raise TypeError(type(x).__name__)


def decode(x):
    if x is None:
        return None
    tag = x[0]
    if tag == "A":
        return _aval(tuple(x[1]), np.dtype(jax.numpy.dtype(x[2])), x[3])
    if tag == "S":
        return _static(x[1])
    if tag == "T":
        return tuple(decode(e) for e in x[1])
    if tag == "L":
        return [decode(e) for e in x[1]]
    raise ValueError(tag)


def lookup(text: str):
    """The abstract outputs kept for a key (what ``eval_shape`` gave), or None."""
    if not ENABLED:
        return None
    if not _known:
        _known.append(_read())
    got = _known[0].get(text)
    if got is None:
        return None
    try:
        out = decode(got)
    except Exception:  # noqa: BLE001 - an entry this code cannot read: traced again
        return None
    count("fused_op_shapes_loaded")
    return out


def keep(text: str, out_avals) -> None:
    """Keep what a trace gave for ``text`` (written at exit)."""
    if not ENABLED or len(_new) >= MAX_ENTRIES:
        return
    try:
        _new[text] = encode(out_avals)
    except TypeError:
        pass  # an output kind with no spelling: traced every process


def save() -> None:
    """Merge this process's traces into the file (atomically; the newest win)."""
    if not _new:
        return
    path = _file()
    if path is None:
        return
    entries = _read()
    entries.update(_new)
    if len(entries) > MAX_ENTRIES:  # keep the newest (dicts keep insertion order)
        entries = dict(list(entries.items())[-MAX_ENTRIES:])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump((_MAGIC, entries), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        _new.clear()
    except OSError:
        pass  # an unwritable cache folder: the next process traces again


def _after_fork() -> None:
    _new.clear()  # a forked child writes only what it traced itself


atexit.register(save)
os.register_at_fork(after_in_child=_after_fork)
