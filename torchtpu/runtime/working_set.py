"""Warm starts: the executables a process used, loaded ahead by the next run of it.

A process that finds its programs in the compile cache folder (``disk_cache.py``) still loads
each one on the critical path the first time an op needs it (~2-3 ms each on XLA:CPU; a tiny
Llama's ``generate`` uses ~380). So each process records its *working set*: the disk keys of
the eager and Fused programs it loaded or compiled, in the order it first used them, written at
exit to ``<cache folder>/working-sets/<name>`` where the name hashes the command line
(``sys.orig_argv``, with the working folder) or ``TORCHTPU_WORKING_SET`` when set (``0`` turns
this off). The next process with the same name starts, at the end of ``import torchtpu``, one
background thread that loads those executables in that order (at most half of
``program_cache.MAX_LIVE``) while the process imports the rest of its code and builds its model;
a program's first call then takes the loaded executable (``<kind>_working_set_hits``) instead of
reading it (or waits for the thread when it is loading that very one). The thread also runs
each plain executable it loaded once on zeros and sets its C++ call (``first_run.py``): a
deserialized program's first run is its costly one. Only entries still in
the cache folder are loaded; what the process did not use this time is not recorded again, so
the set follows the workload. The thread stops at interpreter exit (before JAX's teardown) and
is not inherited by a forked child.

Loading creates the JAX backend, which a rank of a multi-process job may create only after its
job joined: a process with ``WORLD_SIZE`` > 1 loads nothing ahead, and one that may call
``init_process_group`` itself later (a child multiprocessing spawned, as vLLM's workers and
``mp.spawn``'s ranks are, or one with ``MASTER_ADDR``/``RANK``/``LOCAL_RANK`` set) starts
loading at its first device use instead of at import, unless that use is a job's. A job's ranks
record no set (their programs are the job's, and they would overwrite each other's).

Results cannot change: the executable loaded ahead is the one the disk lookup would load (the
same key, checksum and custom-call checks: ``program_cache._load_now``). Counted:
``working_set_loads`` (loaded ahead), ``<kind>_working_set_hits`` (used), ``working_set_unused``
(loaded ahead, not used by exit).
"""
from __future__ import annotations

import atexit
import hashlib
import os
import sys
import tempfile
import threading

from . import disk_cache as _disk
from .metrics import count

NAME = os.environ.get("TORCHTPU_WORKING_SET", "")
ENABLED = NAME != "0"
MAX_ENTRIES = 1024  # a long session's first programs (each holds its code's mappings)

_lock = threading.Lock()
_used: dict = {}  # disk key -> (kind, device id): this process's working set, in first-use order
_ahead: dict = {}  # disk key -> executable loaded ahead, or a threading.Event while loading
_planned: set = set()  # keys the thread will load and has not started
_listed: set = set()  # every key of the recorded set this process loads ahead
_stop = threading.Event()
_thread: list = []
_forked: list = []  # a forked child: it neither loads ahead nor writes its parent's set
_loader: list = []  # (kind, key, device id) -> executable or None: program_cache._load_now
_job: list = []  # a rank of a multi-process job: it neither loads ahead nor writes a set
created_backend = [False]  # this process's backend was created at import, to load ahead


def _spawned() -> bool:
    """Whether multiprocessing's spawn or forkserver started this process (its command line is
    ``-c 'from multiprocessing.spawn import spawn_main; ...' --multiprocessing-fork``)."""
    return "--multiprocessing-fork" in (getattr(sys, "orig_argv", None) or sys.argv)


def _name() -> str:
    # the interpreter's own command line names ``-c``'s code too; the folder tells scripts apart
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    if _spawned():  # every spawned child's command line is alike: name its parent's script
        main = sys.modules.get("__mp_main__")
        argv.append(str(getattr(main, "__file__", "") or ""))
    ident = NAME or "\0".join([os.getcwd(), *argv])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _file() -> str | None:
    d = _disk.cache_dir()
    if d is None:
        return None
    return os.path.join(d, "working-sets", _name())


def note(kind: str, key: str, device_id: int) -> None:
    """Record that this process used the program ``key`` (loaded or compiled and stored)."""
    if ENABLED and key not in _used and len(_used) < MAX_ENTRIES:
        _used[key] = (kind, device_id)


def holds(key: str) -> bool:
    """Whether ``key`` was loaded ahead or will be (``take`` finds it)."""
    return key in _ahead or key in _planned


def listed(key: str) -> bool:
    """Whether ``key`` is in the recorded set being loaded ahead (the last run used it), taken
    or not yet."""
    return key in _listed


def take(key: str):
    """The executable loaded ahead for ``key`` (waiting while the thread loads it), or None;
    None too when the thread has not reached it yet (the caller loads it, the thread skips it)."""
    if not _ahead and not _planned:
        return None
    with _lock:
        got = _ahead.pop(key, None)
        if got is None:
            _planned.discard(key)
            return None
    if isinstance(got, threading.Event):
        got.wait()
        with _lock:
            got = _ahead.pop(key, None)
    return got


def _run(entries) -> None:
    loader = _loader[0]
    for kind, key, dev in entries:
        if _stop.is_set():
            return
        with _lock:
            if key not in _planned:
                continue  # the process asked for it first and loads it itself
            _planned.discard(key)
            done = _ahead[key] = threading.Event()
        compiled = None
        try:
            compiled = loader(kind, key, dev, True)
        except Exception:  # noqa: BLE001 - the call that needs it loads it (or rebuilds it)
            compiled = None
        with _lock:
            if compiled is None:
                _ahead.pop(key, None)
            else:
                _ahead[key] = compiled
                count("working_set_loads")
        done.set()


def multi_process_job() -> bool:
    """Whether this process is one of a multi-process job (torchrun's ``WORLD_SIZE`` > 1, or
    an explicit coordinator): its backend may be created only once the job joined."""
    try:
        ws = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        ws = 1
    return ws > 1 or bool(os.environ.get("TORCHTPU_COORDINATOR_ADDRESS"))


def may_join_a_job_later() -> bool:
    """Whether this process may still call ``init_process_group`` itself after ``import``,
    with no ``WORLD_SIZE`` telling so ahead: a child that multiprocessing spawned (vLLM's
    tensor-parallel workers, ``torch.multiprocessing.spawn``'s ranks) or one with
    torch.distributed's rendezvous variables set. Its backend must not be created at import,
    so its working set is loaded from its first device use on, when that is not a job's."""
    return _spawned() or any(os.environ.get(v) for v in ("MASTER_ADDR", "RANK", "LOCAL_RANK"))


def in_a_job() -> None:
    """This process is a rank of a multi-process job: its programs are the job's (compiled for
    its devices), neither loaded ahead nor recorded for the next run of its command line, whose
    processes may well run alone (the ranks would also overwrite each other's sets)."""
    _job.append(True)


def recorded() -> bool:
    """Whether a working set was recorded for this command line (and may be loaded)."""
    if not ENABLED or _thread or _forked:
        return False
    path = _file()
    return path is not None and os.path.exists(path)


def start(loader, limit: int = MAX_ENTRIES) -> bool:
    """Load the working set recorded for this command line on a background thread; False when
    there is none (or the cache folder is off). ``loader(kind, key, device id, ahead)``: the disk
    lookup (program_cache.load_working_set passes it); ``limit``: at most that many (executables
    loaded ahead hold their code's mappings before any Program tracks them)."""
    _loader[:] = [loader]
    if not recorded():
        return False
    path = _file()
    entries = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(entries) >= limit:
                    break
                if len(parts) == 3 and os.path.exists(_disk._path(parts[1]) or ""):
                    entries.append((parts[0], parts[1], int(parts[2])))
    except (OSError, ValueError):
        return False
    if not entries:
        return False
    _planned.update(e[1] for e in entries)
    _listed.update(e[1] for e in entries)
    t = threading.Thread(target=_run, args=(entries,), daemon=True, name="torchtpu-working-set")
    _thread.append(t)
    t.start()
    return True


def _save() -> None:
    _stop.set()
    for t in _thread:
        t.join(timeout=5)
    unused = len([v for v in _ahead.values() if not isinstance(v, threading.Event)])
    if unused:
        count("working_set_unused", unused)
    _ahead.clear()  # before JAX tears its clients down
    if not ENABLED or not _used or _forked or _job:
        return
    path = _file()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            for key, (kind, dev) in _used.items():
                f.write(f"{kind} {key} {dev}\n")
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache folder: the next process loads on demand


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _ahead.clear()
    _planned.clear()
    _listed.clear()
    _thread.clear()
    _used.clear()
    _forked.append(True)


atexit.register(_save)  # registered after JAX's own: runs before its teardown
os.register_at_fork(after_in_child=_after_fork)
