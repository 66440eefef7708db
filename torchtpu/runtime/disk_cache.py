"""The compile cache folder: entries on disk shared by processes (the runtime's half of it).

Entries are written here by the eager Programs (``program_cache.py``) and by the torch.compile
backend (``compile/cache.py``), which each define what an entry holds and how it is keyed. An
entry is one file, ``<dir>/<key[:2]>/<key>.xla``: a magic line, the key, then the body. Writes
are atomic (a temporary file renamed); a missing, truncated, foreign or corrupt entry is a
counted miss, removed so that it is rewritten. Nothing here can fail a compile: every error
degrades to a plain XLA compile.

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

import os
import tempfile
import warnings

from .metrics import count

_warned = [False]


def cache_dir() -> str | None:
    d = os.environ.get("TORCHTPU_CACHE_DIR")
    if d is not None:
        return d or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def _path(key: str) -> str | None:
    d = cache_dir()
    return None if d is None else os.path.join(d, key[:2], key + ".xla")


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


