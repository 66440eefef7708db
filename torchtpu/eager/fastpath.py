"""The Strict executor's hot path for cached programs, in C++ (``fastpath.cpp``).

Every functional op's PrivateUse1 kernel is a ``torchtpu_fastpath.Kernel``: a C++ object in
front of the Python kernel it wraps, registered as a boxed C++ kernel (``bind_boxed``; the
dispatcher hands it the IValue stack: no PythonKernelHolder, no Python argument tuple). It keys
the stack with the key it would make from the Python arguments the holder passes (so entries
installed from the Python path match; ``check_keys`` compares both in tests), serves a Strict
hit or a Fused replay from the stack, and for anything else converts the stack to Python once
and runs what ran before (``Kernel_call``). ``TORCHTPU_FASTPATH_BOXED=0`` registers the Kernels
through torch.library instead (the holder calls them as Python callables). While the eager
mode is Strict, it keys the call's arguments (each tensor's dtype, sizes, strides, storage offset and
conj/neg bits; Python scalars by their bits; lists, dtypes, devices, layouts, memory formats;
the default dtype; for an op that reads the matmul precision, torch's and JAX's settings) and looks the key up in the
op's table. A hit gathers the input storages' arrays and picks the key's entry made for arrays
of their dtypes, shapes and weak types (with the key, they decide each input's view spec, so
views are served: a key holds up to 8 such entries), calls the executable's C++ call (the one
``program_cache.Program`` calls) with the views' storage offsets as the entry's constants,
notes the outputs in flight and makes the output tensors and storages itself, as
``buffer.wrap_noted`` does: no Python frame of torchtpu runs. Anything else runs the Python
kernel (eager/executor.py): a miss sets this thread's pending key first, and the executor
installs an entry for it (``offer``) only for a call it proved eligible: a functional op in
Strict mode, every tensor on a storage array (no CPU scalar), no random state drawn, no
mutated argument, one device, array results (None and Python scalar results are constants of
the entry; a checked op's flag goes to ``checks.add`` from C++; a factory is served where tpu:0
is the only device; SDPA's fused op and its backward are restrided like their inputs, registry
meta ``eager_layout_like``). Everything else (in-place writes and donation, Debug
mode, dynamic shapes, calls that draw random state, fallbacks) takes the Python path every
time. The metadata-only ops' kernels (``cpu_redispatch``) are bound in C++
too: PyTorch's CPU kernel through a boxed redispatch, as eager/kernels.py does in Python.

In Fused mode (DEFER_AND_FUSE) a Kernel records instead: a key ``fused.record`` recorded
before (and offered, ``offer_fused``) is replayed in C++ (the node appended to the pending
graph, PendingBuffer outputs made), as docs/ARCHITECTURE.md "Fused" describes; anything else
runs ``record``.

``eager_fastpath_boxed_hits`` and ``fused_fastpath_boxed_records`` count what the boxed
kernel served itself. ``TORCHTPU_FASTPATH=0`` binds the Python kernels themselves (the reference path);
``set_enabled(False)`` makes every Kernel run its Python kernel (the same path, in-process,
for tests and benchmarks). Without a C++ compiler the Python kernels are bound and
``eager_fastpath_unavailable`` is counted. ``torch.tpu.metrics()`` counts
``eager_fastpath_hits`` (also counted as ``eager_cache_hits``), ``eager_fastpath_misses`` (no
entry: the Python path ran), ``eager_fastpath_installs``, ``eager_fastpath_uncacheable``
(arguments it cannot key), ``eager_fastpath_bypassed`` (Debug mode) and
``eager_fastpath_fallbacks`` (a key with no entry for these storage arrays, or an executable
that refused them: the Python path ran).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import threading

from ..lowering import registry as _registry
from ..lowering.attention import layout_order as _layout_order
from ..runtime import buffer as _buffer
from ..runtime import devices as _devices
from ..runtime import inflight as _inflight
from ..runtime import metrics as _metrics
from ..runtime import native_build as _nb
from ..runtime import program_cache as _program_cache
from . import modes

_log = logging.getLogger("torchtpu")
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "fastpath.cpp")
_WHAT = "its C++ eager fast path"
_AVOID = "or set TORCHTPU_FASTPATH=0 (the Python path; same results, slower per op)"
_lock = threading.Lock()
_state: dict = {"ext": None, "tried": False, "error": None, "module": None}
_kernels: list = []  # every Kernel made (they live as long as the op bindings)


def _after_fork_in_child() -> None:
    # a child forked after the backend existed runs nothing on it (runtime/devices.py,
    # check_fork): every call takes the Python kernel, which raises CUDA's error
    if _devices.in_bad_fork() and _state["ext"] is not None:
        _state["ext"].set_enabled(False)


os.register_at_fork(after_in_child=_after_fork_in_child)


def wanted() -> bool:
    return os.environ.get("TORCHTPU_FASTPATH", "1") not in ("0", "")


def _module():
    """The built extension module, set up for nothing yet (the device guard alone needs no
    more); raises where it cannot be built."""
    if _state.get("module") is None:
        path = _nb.library_path(_SOURCE, python=True, shared=True)
        _nb.build_locked(path, _SOURCE, _WHAT, _AVOID, python=True)
        loader = importlib.machinery.ExtensionFileLoader("torchtpu_fastpath", path)
        spec = importlib.util.spec_from_file_location("torchtpu_fastpath", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        _state["module"] = mod
    return _state["module"]


def _load():
    """The extension module, built on first need (shared by every process of this torch,
    whatever TORCHTPU_CACHE_DIR: the library does not depend on it); None if it cannot be."""
    if _state["tried"]:
        return _state["ext"]
    with _lock:
        if _state["tried"]:
            return _state["ext"]
        try:
            ext = _module()
            from jax._src.array import ArrayImpl

            ext.setup(modes._state, modes.EagerMode.DEFER_NEVER, _buffer.Buffer,
                      _buffer._next_free, _inflight.note, ArrayImpl,
                      _registry.matmul_precision, _metrics.COUNTERS)
            ext.set_precision_state(_jax_precision_state())
            _program_cache.EVICTED_HOOKS.append(_forget)
            _state["ext"] = ext
        except Exception as e:  # noqa: BLE001 - no compiler, no headers: the Python path
            _state["error"] = e
            _metrics.count("eager_fastpath_unavailable")
            _log.debug("torchtpu: the C++ eager fast path is unavailable: %s", e)
        _state["tried"] = True
        global pending
        if _state["ext"] is not None:
            pending = _state["ext"].pending
    return _state["ext"]


def _jax_precision_state():
    """JAX's ``default_matmul_precision`` config state, whose ``value`` is what
    ``jax.config.jax_default_matmul_precision`` reads (and ``registry.matmul_precision`` maps);
    None where this jax has no such object (the C++ side then calls matmul_precision)."""
    import jax

    try:
        from jax._src import config as _jc

        st = _jc.default_matmul_precision
        if st.value == jax.config.jax_default_matmul_precision:
            return st
    except Exception:  # noqa: BLE001 - another jax: the Python function decides
        pass
    return None


def pending():
    """The lowering whose call may install an entry now (None: none)."""
    return None


def kernel(fn, lowering):
    """The PrivateUse1 kernel to bind for functional Python kernel ``fn``: a C++ Kernel in
    front of it, or ``fn`` itself (TORCHTPU_FASTPATH=0, or no compiler)."""
    if not wanted():
        return fn
    ext = _load()
    if ext is None:
        return fn
    k = ext.Kernel(fn, lowering, lowering.name, bool(lowering.reads_precision))
    _kernels.append(k)
    return k


def boxed_wanted() -> bool:
    return os.environ.get("TORCHTPU_FASTPATH_BOXED", "1") not in ("0", "")


def bind_boxed(ns: str, name: str, fn) -> bool:
    """Register ``fn`` as ``ns::name``'s PrivateUse1 kernel as a boxed C++ kernel when it is a
    fast-path Kernel (the dispatcher hands it the IValue stack: no PythonKernelHolder); False
    where it is not one, or ``TORCHTPU_FASTPATH_BOXED=0`` (the caller binds it through
    torch.library, as a Python callable)."""
    ext = _state["ext"]
    if ext is None or type(fn) is not ext.Kernel or not boxed_wanted():
        return False
    ext.bind_boxed(ns, name, fn)
    _boxed.append(f"{ns}::{name}")
    _metrics.count("eager_fastpath_boxed_bound")
    return True


_boxed: list = []  # the ops whose Kernel is bound boxed


def boxed_bound() -> list:
    """The ops (``ns::name.overload``) whose PrivateUse1 kernel is the boxed Kernel."""
    return list(_boxed)


def check_keys(flag: bool) -> None:
    """Tests: make every boxed call also build the key ``Kernel_serve`` makes from the Python
    arguments PythonKernelHolder would pass, counting ``eager_fastpath_key_mismatches`` where
    the two differ."""
    ext = _state["ext"]
    if ext is not None:
        ext.set_check_keys(bool(flag))


def cpu_redispatch(op) -> bool:
    """Bind metadata-only op ``op``'s PrivateUse1 kernel to PyTorch's CPU kernel in C++ (the
    boxed redispatch eager/kernels.py does from Python, without the Python frame); False
    where the fast path is not bound (the caller binds the Python kernel)."""
    if not wanted():
        return False
    ext = _load()
    if ext is None:
        return False
    ns, name = op._schema.name.split("::", 1)
    if op._overloadname != "default":
        name = f"{name}.{op._overloadname}"
    ext.cpu_redispatch(ns, name)
    return True


def native_guard() -> bool:
    """Answer the PrivateUse1 device guard's type and device in C++ (the guard PyTorch's Python
    backend registration makes calls the Python ``type_`` for each, once per guarded op); the
    registered guard still answers everything else. With TORCHTPU_FASTPATH=0 (the reference)
    the Python guard answers everything, through the same C++ guard in front: in both, a guard
    destructor running while a Python error unwinds (PyTorch raises a saved-tensor unpack hook's
    error with it still set) sets that error aside around its call into the Python guard,
    which would otherwise fail and abort the process from the destructor. False where the
    extension cannot be built or the registered guard answers otherwise."""
    answer = wanted()
    if answer:
        ext = _load()
    else:  # the module only: the fast path itself stays unbound
        try:
            with _lock:
                ext = _module()
        except Exception as e:  # noqa: BLE001 - no compiler: the Python guard alone
            _log.debug("torchtpu: no C++ guard in front of the device guard: %s", e)
            ext = None
    if ext is None:
        return False
    ok = bool(ext.native_guard(answer))
    if ok:
        _guard_ext[:] = [ext]
    _metrics.count(("device_guard_native" if answer else "device_guard_python_behind_native")
                   if ok else "device_guard_python")
    return ok


_guard_ext: list = []  # the extension whose guard is in front (set_current_device writes it)


def set_current_device(index: int) -> None:
    """Tell the C++ guard torch.tpu's current device (what C++ fills a device without an
    index from); nothing where the guard is not in front."""
    if _guard_ext:
        _guard_ext[0].set_current(index)


def set_device_count(n: int) -> None:
    """Tell the C++ guard how many devices torch.tpu sees (once the backend exists)."""
    if _guard_ext:
        _guard_ext[0].set_device_count(n)


def timing(start=None):
    """Where Kernel calls' time goes (benchmarks): ``timing(True)`` starts timing (zeroed),
    ``timing(False)`` stops; returns what was timed so far, in the calling thread's CPU time
(a loaded host's wall clock is mostly the wait for a core), per outermost Kernel call: ``hits``
    served in C++ and their ``hit_ns``, of which ``call_ns`` in the executable's call (JAX's
    C++ call; with synchronous XLA:CPU dispatch the program's run too), and ``python`` calls
    that ran the Python kernel and their ``python_ns``. Empty where the fast path is not bound."""
    ext = _state["ext"]
    if ext is None:
        return {}
    res = ext.timing()
    if start is not None:
        ext.set_timing(bool(start))
    return res


def available() -> bool:
    return _state["ext"] is not None


def set_enabled(flag: bool) -> bool:
    """Serve hits (True) or run every call through the Python kernel (False); the previous
    setting. A no-op (False) where the fast path is not bound."""
    ext = _state["ext"]
    if ext is None:
        return False
    old = ext.enabled()
    ext.set_enabled(bool(flag))
    return old


def enabled() -> bool:
    ext = _state["ext"]
    return ext is not None and ext.enabled() and bool(_kernels)


def clear() -> None:
    """Forget every installed entry (the Python path installs them again)."""
    ext = _state["ext"]
    if ext is not None:
        ext.clear()


def entries() -> int:
    ext = _state["ext"]
    return 0 if ext is None else ext.entries()


def _forget(calls) -> None:
    """program_cache dropped these executables (its bound on loaded XLA code): an entry
    must not keep one alive."""
    ext = _state["ext"]
    if ext is not None and calls:
        ext.forget(set(calls))


_Array = None


def offer(lowering, prog, flat, tensors, out, traced_type, check=None, static_type=None,
          layout_like=None) -> bool:
    """Install the entry for this thread's pending key: the call of ``prog`` just made with
    ``flat`` (one argument per item of ``tensors``: a tensor's storage array, or a Traced
    scalar's value; then the traced storage offsets of its views) returned ``out``. The
    executor calls it only for an eligible call; True if installed.

    A tensor's view spec (eager/views.py) is a function of what the key holds (its dtype,
    sizes, strides, offset, conj/neg bits) and of its storage array's shape and dtype, which
    the entry records and a hit checks; so the program (and its offsets, constants of the
    entry: the key holds the storage offset) is the one the Python path would run.
    ``check``: a checked op's (registry ``check``) callable for the flag its program returns
    next to ``out`` (what the Python path passes the flag to in Strict mode).
    ``static_type``: the executor's wrapper of a Python scalar result (a SymInt return such as
    SDPA's ``max_q``); such a result and a None one are constants of the entry (the key fixes
    them: shapes decide them). ``layout_like``: per result, the argument tensor it is laid out
    like (registry meta ``eager_layout_like``; lowering/attention.py ``layout_order`` gives the
    order, a function of that tensor's metadata, which the key holds), or None."""
    global _Array
    if _Array is None:
        from jax._src.array import ArrayImpl as _Array
    n = len(tensors)
    if len(flat) < n:
        return False
    if type(out) is _Array:
        outs = (out,)
        tuple_out = False
    elif type(out) is tuple and out and type(out[0]) is _Array and all(
            type(o) is _Array or o is None or (static_type is not None and type(o) is static_type)
            for o in out):
        outs = out
        tuple_out = True
    else:
        return False
    call = prog.by_sig.get(_program_cache.signature(flat)) \
        if type(prog) is _program_cache.Program else None
    if call is None:
        return False
    plan = []
    arrays = []
    for t, a in zip(tensors, flat):
        if type(t) is traced_type:
            plan.append((a,))
        else:
            if type(a) is not _Array:
                return False
            plan.append(len(arrays))
            arrays.append((a.dtype, tuple(a.shape), bool(a.weak_type)))
    for off in flat[n:]:  # the views' traced offsets (fixed by the key's storage offsets)
        if type(off) is not _Array:
            return False
        plan.append((off,))
    metas = []
    for i, o in enumerate(outs):
        if type(o) is not _Array:  # a constant result: None, or a Python scalar
            metas.append((None if o is None else o.value,))
            continue
        shape, dt, _strides, _nbytes = _buffer._meta(o.shape, o.dtype)
        like = layout_like[i] if layout_like is not None and i < len(layout_like) else None
        order = None if like is None else _layout_order(len(shape), like)
        metas.append((tuple(shape), dt) if order is None else (tuple(shape), dt, order))
    return _state["ext"].install(lowering, call, plan, arrays, tuple_out, metas, check)


def setup_fused(fused_mode, fused_globals, pending_type, task_fn) -> bool:
    """Let Kernels record Fused-mode ops whose key ``record`` recorded before (eager/fused.py
    calls it once, at install): they read ``fused_globals`` (fused.py's module dict: its
    ``_graph``, ``MAX_NODES``, ``CUT_AT_BACKWARD``, ``flush``) at each recording. False where
    the fast path is not bound."""
    if not wanted():
        return False
    ext = _load()
    if ext is None:
        return False
    ext.setup_fused(fused_mode, fused_globals, pending_type, task_fn)
    return True


def fused_lock():
    """(enter, exit) of the pending Fused graph's owner lock the Kernels' recording takes
    (re-entrant, per thread), or None where the fast path is not bound."""
    if not wanted():
        return None
    ext = _load()
    if ext is None:
        return None
    return ext.fused_enter, ext.fused_exit


def offer_fused(lowering, akey, traced, text, plan, ins, tuple_out, outs, check=None) -> bool:
    """Install the recording entry for this thread's pending Fused key: the node ``record``
    just appended (its recording key ``akey``, traced function and persistent spelling
    ``text``), how its references are made (``plan``: per reference a tensor ordinal,
    ``("c", value)`` a graph input deduplicated by identity, ``("o", value)`` a view offset's
    input), per tensor ordinal ``(canonical aval, shape, numpy dtype)`` and per result None,
    ``("s", value)`` or ``(canonical aval, shape, torch dtype[, dimension order])``; ``check``:
    None, or a checked op's (flag aval, what the flag goes to). The caller (fused.record)
    offers only calls whose recording is a function of the key and the inputs' abstract
    values; True if installed."""
    ext = _state["ext"]
    if ext is None:
        return False
    return ext.install_fused(lowering, akey, traced, text, plan, ins, tuple_out, outs, check)


def fused_entries() -> int:
    ext = _state["ext"]
    return 0 if ext is None else ext.fused_entries()
