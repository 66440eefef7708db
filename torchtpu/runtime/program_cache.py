"""Eager programs (Strict per-op programs, Fused graphs) compiled once per machine, not per process.

A ``Program`` stands where a ``jax.jit`` function stood: called with flat arguments, it finds the
XLA executable for their signature (shapes, dtypes, weak types, Python scalar kinds) in this
process, else in the compile cache folder (``disk_cache.py``: atomic writes, a corrupt or
foreign entry is a counted miss and is rebuilt), else traces, lowers and compiles it and writes
it there. An entry records its module's custom-call targets; one whose targets cannot be made
ready in this process (``custom_calls.py``: a LAPACK table JAX fills only while lowering, a host
callback) is a counted miss (``<kind>_disk_cache_unsafe``, by reason), rebuilt, never run. The disk key is the executor's own cache key made
stable across processes (``stable``), the signature, the device ids the program runs on, the
compiler options, and a fingerprint of everything that shapes a trace: jax/jaxlib/torch
versions, platform, the source of the whole torchtpu package, the jax configuration values a
lowering reads, ``XLA_FLAGS``. A warm process therefore neither traces, lowers nor compiles. A
key part that has no stable spelling (a user's ``jax_op`` lowering, an unknown object) keeps the
program in memory only.

Small programs, those whose inputs and outputs hold at most
``TORCHTPU_FAST_COMPILE_MAX_ELEMENTS`` elements in all (default 65536; 0 turns it off), get
cheaper XLA options (``FAST_OPTIONS``: LLVM -O0, no expensive passes; their run time is per-call
overhead either way). They change no operation's numbers but one: at -O2 LLVM fuses a float
multiply feeding an add into one fused multiply-add (one rounding) where -O0 rounds twice, as
PyTorch's two separate ops do (gelu, layer norm, ``a - b * b`` differ in the last bit between
the two; nothing else measured did). On
XLA:CPU, a small program made only of operations whose result is defined bit for bit (data
movement, dynamic slices, comparisons, IEEE add/sub/mul/div, conversions: ``_EXACT_OPS``; select
and min/max on integers and booleans) is also
compiled with XLA's classic emitters, ~3x faster for elementwise programs; programs with a
transcendental function, a reduction, a dot, or a float multiply together with a float
add/subtract (a fused multiply-add on some hosts' emitters) never are (the two emitters differ
there in the last bits). tests/test_persistent_cache.py checks each allowed operation bit for bit;
``TORCHTPU_CLASSIC_EMITTERS=0`` turns this off.

Counted per kind (``eager``, ``fused``): ``<kind>_xla_compiles``, ``<kind>_xla_compile_ms``,
``<kind>_disk_cache_hits/misses/writes/errors``, ``<kind>_fast_compiles``.
"""
from __future__ import annotations

import collections
import hashlib
import math
import os
import pickle
import re
import struct
import threading
import time
import weakref

import jax
import numpy as np
from jax._src.array import ArrayImpl as _ArrayImpl
from jax.core import ShapedArray

from . import cpu_kernels as _cpu_kernels
from . import custom_calls as _custom_calls
from . import devices as _devices
from .devices import _bad_fork
from . import disk_cache as _disk
from . import first_run as _first_run
from .inflight import note as _inflight_note
from . import prefetch as _prefetch
from . import working_set as _working_set
from .ir_context import install as _install_ir_context
from .metrics import count

_install_ir_context()

_MAGIC = b"TORCHTPU-XLA-PROGRAM-2\n"  # 2: entries record their custom-call targets
FAST_MAX_ELEMENTS = int(os.environ.get("TORCHTPU_FAST_COMPILE_MAX_ELEMENTS", "65536"))
# Options that leave every operation's numbers as a default compile has them, save that -O0
# does not contract a multiply and an add into a fused multiply-add. XLA:CPU's classic
# emitters (xla_cpu_use_fusion_emitters=False) compiled small programs another ~3.5x faster but
# use other tanh/erf/rsqrt approximations (tanh 3.2e-7 relative error vs 2.3e-7): results of an
# op then depended on its size and executor, and a 3-step GPT AdamW test drifted past float32
# tolerance from CPU.
FAST_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_PY = {bool: bool, int: int, float: float, complex: complex, type(None): type(None)}


class Deferred(Exception):
    """``Program.call_or_defer``: the executable is being built on a worker."""


class NotStable(Exception):
    """A key part without a process-independent spelling: the program is not persisted."""


def _other_sig(a):
    t = _PY.get(type(a))
    if t is not None:
        return t  # a Python scalar: jax traces it as a weakly typed 0-d value of its kind
    dt = np.result_type(a)
    return ("np", np.shape(a), dt.name + dt.str)


def signature(flat) -> tuple:
    """What selects an executable: abstract values, and with several local devices the
    committed arrays' shardings too (an executable runs on the device it was compiled for)."""
    if _MULTI[0]:
        return tuple([(a.aval, a.sharding if a.committed else None) if type(a) is _ArrayImpl
                      else _other_sig(a) for a in flat])
    return tuple([a.aval if type(a) is _ArrayImpl else _other_sig(a) for a in flat])


_MULTI = [False]  # several local devices (set at the first miss, when JAX is up)


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0  # not Linux: no such limit to watch


# Each XLA:CPU executable maps its JIT-compiled code into the process for as long as it lives
# (3 mappings for a one-kernel program, dozens for a program of many fusions), and Linux allows a
# process ``vm.max_map_count`` mappings (65530 by default) for everything (malloc arenas, numpy
# buffers, shared libraries): past that, LLVM's JIT gets no memory for the next program and the
# process dies with SIGSEGV inside XLA. A long session (the test suite in one process; a server
# seeing many shapes) got there. So the executables loaded in this process are bounded: at most
# MAX_LIVE of them (``TORCHTPU_MAX_LIVE_PROGRAMS``), and every _CHECK_EVERY loads the process's
# mapping count is read (~1 us per mapping); above half the limit the oldest half of the loaded
# programs is dropped. A dropped program's next call loads it again from the compile cache folder
# (or recompiles without one): the same numbers, a load's time.
MAP_LIMIT = _map_limit()
MAX_LIVE = int(os.environ.get("TORCHTPU_MAX_LIVE_PROGRAMS", "0")) or max(256, (MAP_LIMIT or 65530) // 16)
_CHECK_EVERY = 64
# Executables loaded in this process, oldest first: (id of Program, signature) -> weak Program
_live: collections.OrderedDict = collections.OrderedDict()
_live_lock = threading.Lock()
_loads_since_check = [0]


def live_programs() -> int:
    return len(_live)


def mappings() -> int:
    """The number of memory mappings this process holds (0 where /proc has none)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


# Called with the executables ``_evict_oldest`` just dropped: a cache above this one that holds
# them (eager/fastpath.py) lets go of them too.
EVICTED_HOOKS: list = []


def _evict_oldest(n: int) -> None:
    """Drop the ``n`` oldest loaded executables from their Programs (caller holds the lock)."""
    dropped = []
    for _ in range(min(n, len(_live))):
        (_, old_sig), ref = _live.popitem(last=False)
        prog = ref()
        if prog is None:
            continue
        c = prog.by_sig.pop(old_sig, None)
        if c is not None:
            dropped.append(c)
            if prog._last is c:
                prog._last = None
            count(f"{prog.kind}_programs_evicted")
    for fn in EVICTED_HOOKS:
        fn(dropped)


def _track(program, sig, mapped_ahead: bool = False) -> None:
    """``mapped_ahead``: an executable the working-set thread loaded, whose mappings that
    thread counted already (``_check_ahead``): not a load towards the next count here."""
    key = (id(program), sig)
    with _live_lock:
        _live[key] = weakref.ref(program)
        _live.move_to_end(key)
        if len(_live) > MAX_LIVE:
            _evict_oldest(len(_live) - MAX_LIVE)
        if not mapped_ahead:
            _loads_since_check[0] += 1
        if _loads_since_check[0] < _CHECK_EVERY or not MAP_LIMIT:
            return
        _loads_since_check[0] = 0
        if mappings() > MAP_LIMIT // 2:
            _evict_oldest(len(_live) // 2)
            count("programs_evicted_for_mappings")
            n = mappings()
            if n > MAP_LIMIT * 3 // 4:
                _warn_mappings(n)


def _warn_mappings(n: int) -> None:
    import warnings

    warnings.warn(f"torchtpu: this process holds {n} memory mappings of the {MAP_LIMIT} Linux "
                  "allows (vm.max_map_count) although its least recently loaded eager programs "
                  "were dropped; compiled graphs (torch.compile) hold the rest of their XLA "
                  "code until they are freed (torch._dynamo.reset()). Past the limit XLA "
                  "cannot map new code and the process crashes.", RuntimeWarning, stacklevel=3)


_loaded_ahead = [0]


def _check_ahead() -> None:
    """The working-set thread counts the mappings of what it loads, as ``_track`` does for the
    loads it sees, every ``_CHECK_EVERY`` loads: reading the count costs ~4 ms with a warm
    generate's executables mapped, and ~5 such reads on the first call's path were 37 ms of
    it. Above half the limit, the next ``_track`` counts again and evicts there (the calling
    thread owns the Programs)."""
    _loaded_ahead[0] += 1
    if _loaded_ahead[0] == 1:
        fingerprint()  # hashes every source file (~8 ms): here, not in the first disk key
    if _loaded_ahead[0] % _CHECK_EVERY or not MAP_LIMIT:
        return
    if mappings() > MAP_LIMIT // 2:
        with _live_lock:
            _loads_since_check[0] = _CHECK_EVERY


def _forget(program_id: int, sigs) -> None:
    with _live_lock:
        for sig in sigs:
            _live.pop((program_id, sig), None)


_dtype_text: dict = {}
_np_dtype_text: dict = {}


def dtype_text(dt) -> str:
    """``str(dt)``, remembered per dtype: numpy spells a dtype in Python (~15 us), and a warm
    process's first call spells every program's and recorded op's input dtypes (disk keys,
    Fused shape keys)."""
    try:
        t = _dtype_text.get(dt)
    except TypeError:  # an unhashable (extended) dtype
        return str(dt)
    if t is None:
        t = _dtype_text[dt] = str(dt)
    return t


def stable(x) -> str:
    """A process-independent spelling of a cache-key part, or NotStable."""
    tx = type(x)
    if x is None or tx is bool or tx is int or tx is str:
        return f"{tx.__name__}:{x!r}"
    if tx is float or tx is complex:
        return f"{tx.__name__}:{x!r}"  # repr round-trips, and spells nan/-0.0 apart
    if tx is tuple or tx is list:
        return tx.__name__[0] + "(" + ",".join([stable(e) for e in x]) + ")"
    if isinstance(x, type):
        return f"T:{x.__module__}.{x.__qualname__}"
    if isinstance(x, np.dtype):
        t = _np_dtype_text.get(x)
        if t is None:  # the name: ml_dtypes' types share a .str ('<V1')
            t = _np_dtype_text[x] = f"np:{x.name}{x.str}"
        return t
    mod = getattr(tx, "__module__", "") or ""
    if mod.startswith("torch") and tx.__name__ in ("dtype", "device", "layout", "memory_format"):
        return f"torch.{tx.__name__}:{x}"
    if isinstance(x, jax.Device):
        return f"dev:{x.platform}:{x.id}"
    if hasattr(x, "op") and hasattr(x, "fn") and hasattr(x, "scalar_args"):  # a Lowering
        fn = x.fn
        fmod = getattr(fn, "__module__", "") or ""
        if not fmod.startswith("torchtpu.") or fmod.startswith("torchtpu.pallas"):
            raise NotStable(x.name)  # a user's function: its code is not in the fingerprint
        return f"L:{x.name}:{fmod}.{getattr(fn, '__qualname__', '?')}"
    if tx.__name__ == "ShapeDtypeStruct" or tx.__name__ == "ShapedArray":
        w = "w" if getattr(x, "weak_type", False) else ""
        return f"A:{dtype_text(x.dtype)}{list(x.shape)}{w}"
    import enum

    if isinstance(x, enum.Enum):
        return f"E:{tx.__module__}.{tx.__qualname__}.{x.name}"
    raise NotStable(tx.__name__)


def _sig_text(sig) -> str:
    parts = []
    for s in sig:
        if type(s) is tuple and s[0] != "np":
            s = s[0]  # (aval, sharding): the device ids are keyed separately
        if isinstance(s, type):
            parts.append(s.__name__)
        elif type(s) is tuple:
            parts.append(repr(s))
        else:
            parts.append(f"{dtype_text(s.dtype)}{list(s.shape)}{'w' if s.weak_type else ''}")
    return ";".join(parts)


_fp: list = []
_source_fp: list = []


def source_fingerprint() -> str:
    """A hash of every torchtpu source file (path and contents): persisted programs and
    AOTAutogradCache entries written by other code are never loaded."""
    if not _source_fp:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        h = hashlib.sha256()
        for d, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(d, f), "rb") as fh:
                        h.update(os.path.relpath(os.path.join(d, f), root).encode() + b"\0")
                        h.update(fh.read())
        _source_fp.append(h.hexdigest())
    return _source_fp[0]


def fingerprint() -> str:
    """Everything outside the key that decides what a trace produces."""
    if not _fp:
        import jaxlib
        import torch

        from .._version import __version__

        h = hashlib.sha256(source_fingerprint().encode())
        dev = jax.devices()[0]
        cfg = jax.config
        parts = [jax.__version__, getattr(jaxlib, "__version__", "?"), torch.__version__,
                 __version__, dev.platform, getattr(dev, "device_kind", "?"),
                 os.environ.get("XLA_FLAGS", ""), _cpu_kernels.switches()]
        for name in ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                     "jax_numpy_dtype_promotion", "jax_default_prng_impl",
                     "jax_threefry_partitionable", "jax_enable_custom_prng"):
            parts.append(f"{name}={getattr(cfg, name, None)!r}")
        h.update("|".join(parts).encode())
        _fp.append(h.hexdigest())
    return _fp[0]


def _device_ids(flat, jit_kwargs):
    """The devices a program runs on: its committed inputs' and outputs' (uncommitted inputs,
    such as cached scalars, follow them), else the uncommitted inputs', else the default."""
    ids = set()
    loose = set()
    for a in flat:
        if type(a) is _ArrayImpl:
            (ids if a.committed else loose).update(d.id for d in a.sharding.device_set)
    sh = jit_kwargs.get("out_shardings")
    if sh is not None:
        ids.update(d.id for d in sh.device_set)
    if not ids:
        ids = loose
    if not ids:
        dflt = jax.config.jax_default_device
        ids.add(dflt.id if isinstance(dflt, jax.Device) else jax.local_devices()[0].id)
    return tuple(sorted(ids))


def _elements(avals) -> int:
    n = 0
    for a in avals:
        shape = getattr(a, "shape", None)
        if shape is not None:
            n += math.prod(shape)
    return n


# StableHLO operations whose results XLA:CPU's classic and fusion emitters compute bit for bit
# alike (IEEE-exact arithmetic, comparisons, data movement); anything else (exp, tanh, rsqrt,
# reductions, dots, scatters, custom calls...) keeps the default emitters.
_EXACT_OPS = frozenset("""
    add subtract multiply divide negate abs compare and or xor not sign floor ceil remainder
    round_nearest_even round_nearest_afz shift_left shift_right_arithmetic shift_right_logical
    popcnt is_finite convert iota constant broadcast_in_dim reshape transpose concatenate slice
    pad reverse dynamic_slice dynamic_update_slice
    """.split())
# exact on integers and booleans only: the default emitters flush a subnormal float there
_INTEGER_ONLY_OPS = frozenset(("select", "maximum", "minimum", "clamp"))
# a float multiply and a float add/subtract in one program may become a fused multiply-add
_CONTRACTIBLE = frozenset(("multiply", "add", "subtract"))
_FLOAT_TYPE = re.compile(r"[<x](?:b?f\d|complex)")
_STATEMENT = re.compile(r'^(?:%[^=]*=\s*)?"?([a-z_]+)\.([a-z_]+)')
_CALL = re.compile(r'^(?:%[^=]*=\s*)?(?:func\.)?call @')
CLASSIC_OPTIONS = dict(FAST_OPTIONS, xla_cpu_use_fusion_emitters=False)
CLASSIC = os.environ.get("TORCHTPU_CLASSIC_EMITTERS", "1") != "0"


def exact_ops_only(text: str) -> bool:
    """Whether every operation of a lowered module (its text) is one of ``_EXACT_OPS`` or a
    plain function call; any line not understood answers False. A float multiply together with
    a float add or subtract answers False too: LLVM may contract the pair into one fused
    multiply-add (one rounding instead of two), and whether it does depends on the emitter, the
    optimisation level and the host's vector ISA (a CI host's fusion emitters contracted
    ``a - b * b`` in float64 where the classic ones did not)."""
    float_ops = set()
    for line in text.splitlines():
        line = line.strip()
        if not line or line == "}" or line.startswith(("module ", "func.func ", "return ",
                                                       "sdy.mesh ")):
            continue
        if _CALL.match(line):
            continue
        m = _STATEMENT.match(line)
        if m is None:
            return False
        dialect, op = m.groups()
        if dialect not in ("stablehlo", "chlo", "mhlo"):
            return False
        if op not in _EXACT_OPS and (op not in _INTEGER_ONLY_OPS or _FLOAT_TYPE.search(line)):
            return False
        if op == "compare" and "bf16>" in line:
            return False  # the classic emitters see a subnormal bfloat16 as zero here
        if op in _CONTRACTIBLE and _FLOAT_TYPE.search(line):
            float_ops.add("multiply" if op == "multiply" else "add")
    return len(float_ops) < 2


def _options(lowered, text) -> dict:
    """``text``: a function returning the lowered module's text (computed once)."""
    if FAST_MAX_ELEMENTS <= 0:
        return {}
    ins = jax.tree_util.tree_leaves(lowered.in_avals)
    outs = jax.tree_util.tree_leaves(lowered.out_info)
    if _elements(ins) + _elements(outs) > FAST_MAX_ELEMENTS:
        return {}
    if CLASSIC and _cpu() and exact_ops_only(text()):
        return CLASSIC_OPTIONS
    return FAST_OPTIONS


def _cpu() -> bool:
    if not _platform:
        _platform.append(jax.devices()[0].platform)
    return _platform[0] == "cpu"


_platform: list = []


BY_TEXT = "<keyed by the lowered program's text>"


class Program:
    """A jitted function of flat arguments whose executables persist (see the module doc).

    ``key``: the executor's cache key (made stable lazily; None: memory only; ``BY_TEXT``:
    keyed on disk by the lowered program's text, for programs whose inputs to the trace (a
    traced graph, an optimizer's rules) have no stable spelling: each miss lowers first, then
    loads what an earlier process compiled from the same text)."""

    __slots__ = ("kind", "fn", "key", "jit_kwargs", "by_sig", "_disk", "_last", "_prev",
                 "_pending", "_wasted", "_hits", "_quiet", "_then", "__weakref__")

    def __init__(self, kind: str, fn, key=None, **jit_kwargs):
        self.kind = kind
        self.fn = fn
        self.key = key
        self.jit_kwargs = jit_kwargs
        self.by_sig: dict = {}
        self._disk = None  # the stable key text, computed at the first miss ("" if none)
        self._last = None  # the only executable, while there is one (one local device only)
        self._prev = None  # the signatures of the latest misses (prefetch.py)
        self._pending = None  # {signature: [prefetch.Job, misses since]}: built ahead
        self._wasted = self._hits = 0  # predictions that went unused / were used
        self._quiet = 0  # misses since it stopped guessing
        self._then = None  # run at the first call (a Program made for a guessed key)

    def __del__(self):
        try:
            if self.by_sig:
                _forget(id(self), list(self.by_sig))
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __call__(self, *flat):
        # A Program with one executable calls it directly: its C++ call checks the arguments'
        # shapes and dtypes itself and raises TypeError before running on a mismatch, so no
        # Python-side signature is built. A mismatch is expensive (JAX's Python call path
        # formats an error message: ~60 us), so from a Program's second signature on (an op on
        # a growing KV cache, prefill and decode shapes) every call is a keyed lookup: the
        # signature (~0.2 us per argument) into ``by_sig``, a dict, whatever the number of
        # signatures. Several local devices: the signature names the device, so keyed always.
        if _bad_fork[0]:  # a forked child: CUDA's error, not a wait forever
            _devices.check_fork()
        c = self._last
        if c is not None:
            try:
                out = c(*flat)
            except TypeError:
                if any(isinstance(a, jax.core.Tracer) for a in flat):  # inside a trace
                    return jax.jit(self.fn, **self.jit_kwargs)(*flat)
                self._last = None
            else:
                _inflight_note(out)  # synchronize waits for it even once it is freed
                return out
        c = self.by_sig.get(signature(flat))
        out = self._miss(flat) if c is None else c(*flat)
        _inflight_note(out)
        return out

    def _stable_key(self) -> str:
        if self._disk is None:
            self._disk = ""
            if self.key is not None and self.key is not BY_TEXT and _disk.cache_dir() is not None:
                try:
                    self._disk = stable(self.key)
                except NotStable:
                    count(f"{self.kind}_disk_cache_unkeyable")
        return self._disk

    def _disk_key(self, sig, flat, options):
        """(disk key, the id of the device the program runs on), or None (memory only)."""
        sk = self._stable_key()
        if not sk:
            return None
        try:
            text = _sig_text(sig)
        except Exception:  # noqa: BLE001
            return None
        ids = _device_ids(flat, self.jit_kwargs)
        if len(ids) != 1:
            return None  # a program over several devices: kept in memory only
        h = hashlib.sha256()
        for part in (fingerprint(), self.kind, sk, text, repr(ids), repr(self.jit_kwargs.get(
                "donate_argnums", ())), repr(sorted((k, str(v)) for k, v in options.items())),
                str(FAST_MAX_ELEMENTS)):
            h.update(part.encode())
            h.update(b"\0")
        return "p" + h.hexdigest(), ids[0]

    def _text_key(self, args, text, options):
        """(disk key, device id) of a ``BY_TEXT`` program from its lowered text, or None. The
        arguments' signature too: jit drops unused arguments from the module, so its text alone
        does not fix every argument's shape."""
        try:
            sig = _sig_text(signature(args))
        except Exception:  # noqa: BLE001 - abstract values (a prefetch): memory only
            return None
        ids = _device_ids(args, self.jit_kwargs)
        if len(ids) != 1:
            return None
        h = hashlib.sha256()
        for part in (fingerprint(), self.kind, "text", text, sig, repr(ids),
                     repr(self.jit_kwargs.get("donate_argnums", ())),
                     repr(sorted((k, str(v)) for k, v in options.items()))):
            h.update(part.encode())
            h.update(b"\0")
        return "p" + h.hexdigest(), ids[0]

    def call_or_defer(self, flat, may_defer, hold=False):
        """Call the program if its executable for these arguments is at hand (compiled, or
        built ahead and finished); else, if ``may_defer()`` says so, queue its build on a prefetch worker (loaded from the
        disk cache or compiled there) and raise ``Deferred``: the caller computes this call
        another exact way (eager/deferred.py); ``hold``: the build is kept for
        ``prefetch.run_held`` instead, and queued for a worker when the same arguments' shapes
        come again before it ran (a recurring shape, e.g. a steady decode batch). Without workers, or where the build would only be taken
        from the working set loaded ahead, it is built here as ``__call__`` would."""
        if _bad_fork[0]:  # a forked child: CUDA's error, not a wait forever
            _devices.check_fork()
        c = self._last
        if c is not None:
            try:
                out = c(*flat)
            except TypeError:
                self._last = None
            else:
                _inflight_note(out)
                return out
        sig = signature(flat)
        c = self.by_sig.get(sig)
        if c is not None:
            out = c(*flat)
            _inflight_note(out)
            return out
        pending = self._pending.get(sig) if self._pending else None
        first = pending is None
        if pending is None and not _MULTI[0] and (hold or _prefetch.THREADS > 0) and may_defer():
            self._submit(sig, flat, hold)
            pending = self._pending.get(sig) if self._pending else None
            if pending is not None:
                count(f"{self.kind}_deferred_builds")
        if pending is not None and not pending[0].done.is_set():
            if hold and not first:
                _prefetch.release(pending[0])  # a recurring shape: built on a worker now
            raise Deferred
        out = self._miss(flat)  # takes the finished build (or builds it: no worker)
        _inflight_note(out)
        return out

    def _miss(self, flat):
        if any(isinstance(a, jax.core.Tracer) for a in flat):  # called inside a trace: inline
            return jax.jit(self.fn, **self.jit_kwargs)(*flat)
        if not _MULTI[0] and jax.local_device_count() > 1:
            _MULTI[0] = True
        sig = signature(flat)
        built = self._take_prefetched(sig)
        if built is None:
            # the options depend on the sizes, which the signature fixes: decided before loading
            fast = _is_fast(sig)
            built = self._build(flat, self._disk_key(sig, flat, {"fast": fast}), fast)
        compiled, info = built
        if info[0] == "disk":
            try:
                out = compiled(*flat)
            except jax.errors.JaxRuntimeError as e:
                if "not found" not in str(e):
                    raise
                # an executable XLA cannot run (an incomplete serialization): rebuild it
                _disk._discard(_disk._path(info[1]), e, self.kind)
                compiled, info = self._build(flat, None, info[2])
                out = compiled(*flat)
        else:
            out = compiled(*flat)
        self._remember(sig, compiled, info[0] == "disk" and info[4])
        # an executable the working set lists (loaded ahead): the last run of this command line
        # used it, and the next signature of its progression too if it grew that far (listed
        # as well). A guess would only build its disk key to find that out (~0.2 ms a miss,
        # ~230 in a warm generate's first call): the history is kept, no guess is made
        self._predict(sig, flat, guess=not (info[0] == "disk" and info[3]))
        then = self._then
        if then is not None:
            self._then = None
            try:
                then()
            except Exception as e:  # noqa: BLE001 - a guess never fails the call that ran
                count(f"{self.kind}_prefetch_errors")
                _prefetch_debug(e)
        return out

    def _build(self, args, dkey, fast, precision=None):
        """(executable, info) for ``args`` (arrays or their abstract values): loaded from the
        disk cache, else traced, lowered and compiled (and stored). ``info``: ("disk", key,
        fast, whether the working set lists it, whether it was loaded ahead) or ("xla", compile ms, XLA options). Runs on
        prefetch workers too, and counts there: a guess that goes unused was compiled all the
        same."""
        if dkey is not None:
            key, device_id = dkey
            compiled, listed, ahead = _load(self.kind, key, device_id)
            if compiled is not None:
                return compiled, ("disk", key, fast, listed, ahead)
        jitted = jax.jit(_uncached(self.fn), **self.jit_kwargs)
        if precision is None:
            lowered = jitted.lower(*args)
        else:
            with jax.default_matmul_precision(precision):
                lowered = jitted.lower(*args)
        texts = []

        def text():
            if not texts:
                texts.append(lowered.as_text())
            return texts[0]

        opts = _options(lowered, text) if fast else {}
        if dkey is None and self.key is BY_TEXT and _disk.cache_dir() is not None:
            dkey = self._text_key(args, text(), opts)
            if dkey is not None:
                compiled, listed, ahead = _load(self.kind, *dkey)
                if compiled is not None:
                    return compiled, ("disk", dkey[0], fast, listed, ahead)
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=opts or None)
        ms = int((time.perf_counter() - t0) * 1000)
        kind = self.kind
        count(f"{kind}_xla_compiles")
        count(f"{kind}_xla_compile_ms", ms)
        if _prefetch.off_path():
            count(f"{kind}_xla_compiles_off_path")  # on a worker, or a held build run idle
        if opts:
            count(f"{kind}_fast_compiles")
        if opts is CLASSIC_OPTIONS:
            count(f"{kind}_classic_emitter_compiles")
        if dkey is not None:
            _store(kind, dkey[0], compiled, lowered, _custom_calls.targets(text()))
            _working_set.note(kind, dkey[0], dkey[1])
        return compiled, ("xla", ms, opts)

    def _take_prefetched(self, sig):
        """The program built ahead for ``sig`` (waiting for its worker), or None. Ages the
        other predictions: one not used within ``prefetch.HISTORY`` misses is dropped."""
        pending = self._pending
        if not pending:
            return None
        entry = pending.pop(sig, None)
        for k, e in list(pending.items()):  # a copy: another thread may call this Program
            if e[1] >= _prefetch.HISTORY:
                if pending.pop(k, None) is not None:
                    e[0].drop()
                    self._wasted += 1
                    count(f"{self.kind}_prefetch_wasted")
            else:
                e[1] += 1
        if entry is None:
            return None
        t0 = time.perf_counter()
        try:
            built = entry[0].result()
        except Exception as e:  # noqa: BLE001 - the call builds it again and raises there
            count(f"{self.kind}_prefetch_errors")
            _prefetch_debug(e)
            return None
        if built is not None:
            self._hits += 1
            count(f"{self.kind}_prefetch_hits")
            count(f"{self.kind}_prefetch_wait_ms", int((time.perf_counter() - t0) * 1000))
        return built

    def _predict(self, sig, flat, guess: bool = True) -> None:
        """Submit the next signature's program if this one's inputs are growing (prefetch.py);
        ``guess`` False: only note ``sig`` in the history."""
        hist = self._prev
        if hist is None:
            hist = self._prev = []
        nxt = None
        if guess and not _MULTI[0] and _prefetch.THREADS > 0:
            if self._wasted <= self._hits + _prefetch.MAX_WASTED:
                nxt = _prefetch.predict(hist, sig)
            else:  # stopped guessing; after PAUSE misses the record is cleared
                self._quiet += 1
                if self._quiet >= _prefetch.PAUSE:
                    self._wasted = self._hits = self._quiet = 0
        hist.append(sig)
        if len(hist) > _prefetch.HISTORY:
            del hist[0]
        if nxt is not None and not (self._pending and nxt in self._pending):
            self._submit(nxt, flat)

    def build_ahead(self, sig, template, then=None) -> None:
        """Build the executable for ``sig`` on a prefetch worker (a Program made for a guessed
        executor key: eager/key_guess.py); ``template``: flat arguments of the same kinds (their
        shardings are used). ``then`` runs after this Program's first call."""
        self._then = then
        if not _MULTI[0] and _prefetch.THREADS > 0:
            self._submit(sig, template)

    def _submit(self, sig, template, hold: bool = False) -> None:
        """Queue the build of ``sig``'s executable on a prefetch worker (abstract arguments with
        the shardings of ``template``'s arrays)."""
        if sig in self.by_sig:
            return
        args = [jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type,
                                     sharding=getattr(a, "sharding", None))
                if type(s) is ShapedArray else a for s, a in zip(sig, template)]
        fast = _is_fast(sig)
        dkey = self._disk_key(sig, template, {"fast": fast})
        if dkey is not None and _working_set.holds(dkey[0]):
            # loaded (or being loaded) ahead: the call takes it at once. A worker would only
            # take it from there, and waking one costs the main thread the GIL (~2 ms a
            # switch on a warm start's ~240 guesses)
            count(f"{self.kind}_prefetch_skipped")
            return
        job = (_prefetch.hold if hold else _prefetch.submit)(
            self._build, args, dkey, fast, jax.config.jax_default_matmul_precision)
        if job is not None:
            if self._pending is None:
                self._pending = {}
            self._pending[sig] = [job, 0]
            count(f"{self.kind}_prefetches")

    def _remember(self, sig, compiled, mapped_ahead: bool = False) -> None:
        c = self.by_sig[sig] = _fast(compiled)
        _track(self, sig, mapped_ahead)
        self._last = c if not _MULTI[0] and len(self.by_sig) == 1 else None


def _prefetch_debug(e) -> None:
    from .metrics import _log

    _log.debug("torchtpu: a program built ahead failed: %r", e)


def _uncached(fn):
    """``fn`` under a new function object, for one lowering. JAX's tracing, lowering and
    compilation caches hold the executable as long as the function they trace lives (weakly
    keyed on it, up to 2048 entries per thread): for a Program's ``fn`` that is the Program's
    life, so an executable dropped from ``by_sig`` (``MAX_LIVE``) stayed loaded. Each build
    traces its signature once anyway; nothing is lost."""
    def once(*args):
        return fn(*args)

    once.__name__ = once.__qualname__ = getattr(fn, "__name__", "program")  # the XLA module's name
    return once


def _fast(compiled):
    """The executable's C++ call path (set by its first call), skipping a Python frame."""
    c = getattr(compiled, "_call", None)
    return c if c is not None else compiled


def _is_fast(sig) -> bool:
    """Whether a signature's program gets the cheap XLA options (see the module doc)."""
    return FAST_MAX_ELEMENTS > 0 and _sig_elements(sig) <= FAST_MAX_ELEMENTS


def _sig_elements(sig) -> int:
    """Elements of the array inputs (the outputs are checked after lowering)."""
    n = 0
    for s in sig:
        if type(s) is tuple and s[0] != "np":
            s = s[0]
        shape = s[1] if type(s) is tuple else getattr(s, "shape", ())
        n += math.prod(shape)  # np.prod cost a warm first call ~5 us a program
    return n


def _load(kind: str, key: str, device_id: int):
    """(the executable stored under ``key`` or None, whether the working set lists it, whether
    it was loaded ahead): loaded ahead (``working_set.py``) or now."""
    compiled = _working_set.take(key)
    ahead = compiled is not None
    if ahead:
        count(f"{kind}_disk_cache_hits")  # counted when used, as a load on demand is
        count(f"{kind}_working_set_hits")
    else:
        compiled = _load_now(kind, key, device_id)
    if compiled is not None:
        _working_set.note(kind, key, device_id)
    return compiled, _working_set.listed(key), ahead


def _load_now(kind: str, key: str, device_id: int, ahead: bool = False):
    """``ahead``: for the working-set thread (its hit is counted when a call takes it)."""
    cache = _disk
    body = cache._read(key, _MAGIC, kind)
    if body is None:
        return None
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        (n,) = struct.unpack("<Q", body[:8])
        digest, payload = body[8 + n:8 + n + 32], body[8 + n + 32:]
        if hashlib.sha256(payload).digest() != digest:  # truncated or damaged: never loaded
            raise ValueError("payload checksum mismatch")
        in_tree, out_tree, targets = pickle.loads(body[8:8 + n])
        reason = _custom_calls.ready(targets)
        if reason is not None:  # never run: rebuilt by lowering, which sets up what it needs
            count(f"{kind}_disk_cache_misses")
            count(f"{kind}_disk_cache_unsafe", op=reason)
            return None
        device = next(d for d in jax.local_devices() if d.id == device_id)
        compiled = deserialize_and_load(payload, in_tree, out_tree, backend=device.client,
                                        execution_devices=[device])
    except Exception as e:  # noqa: BLE001 - any bad entry is a miss, rebuilt
        cache._discard(cache._path(key), e, kind)
        return None
    if not ahead:
        count(f"{kind}_disk_cache_hits")
    else:  # its costly first run on this thread too, off the call that needs it
        _first_run.run_ahead(compiled, device, targets)
        _check_ahead()
    return compiled


def _store(kind: str, key: str, compiled, lowered, targets) -> None:
    cache = _disk
    reason = _custom_calls.storable(targets)
    if reason is not None:  # bound to this process: another one could never run it
        count(f"{kind}_disk_cache_unstorable", op=reason)
        return
    try:
        from jax.experimental.serialize_executable import serialize

        payload = serialize(compiled)[0]
        trees = pickle.dumps((lowered.in_tree, lowered.out_tree, targets))
    except Exception as e:  # noqa: BLE001 - not serializable: kept in memory only
        count(f"{kind}_disk_cache_write_errors")
        cache._warn_once(f"torchtpu: could not serialize a {kind} program for the cache ({e})")
        return
    cache._write(key, _MAGIC, struct.pack("<Q", len(trees)), trees,
                 hashlib.sha256(payload).digest(), payload, kind=kind)


def load_working_set() -> bool:
    """Start loading this command line's recorded programs ahead (``working_set.py``); called
    once ``import torchtpu`` has finished. What a load imports is imported here first: an
    import on the loading thread while this one imports could meet a half-initialised module."""
    if _working_set.may_join_a_job_later() and not _working_set.multi_process_job():
        # a vLLM worker or a spawned rank joins its job after import (init_process_group
        # with no WORLD_SIZE set): creating the backend now would make that join fail. Its
        # first device use starts the loading, unless that use is a job's (a spawned child's
        # set is named once its parent's script is known: checked then)
        _devices.after_backend.append(_load_working_set_after_backend)
        return False
    if _working_set.multi_process_job():
        # loading creates the backend, which a multi-process job must create only after its
        # processes joined one cluster (its first device use or init_process_group): created
        # now, at import, rank r > 0 would find no device of rank r (KeyError at the join)
        _working_set.in_a_job()
        if _working_set.recorded():
            count("working_set_skipped", op="multi-process job")
        return False
    if not _working_set.recorded():
        return False
    _working_set.created_backend[0] = not _devices.backend_created()
    _devices.devices()  # through its hooks, as every other first device use
    return _start_working_set()


def _start_working_set() -> bool:
    from jax.experimental.serialize_executable import deserialize_and_load  # noqa: F401
    import jaxlib  # noqa: F401 - fingerprint's imports (the thread computes it: _check_ahead)
    import torch  # noqa: F401

    from .. import _version  # noqa: F401

    _custom_calls._known()
    return _working_set.start(_load_now, min(_working_set.MAX_ENTRIES, MAX_LIVE // 2))


def _load_working_set_after_backend(devs) -> None:
    """The ``after_backend`` hook of a process that may have joined a job since its import."""
    if jax.process_count() > 1:  # its programs are a job's
        _working_set.in_a_job()
        if _working_set.recorded():
            count("working_set_skipped", op="multi-process job")
        return
    if not _working_set.recorded():
        return
    if _start_working_set():
        count("working_set_deferred_starts")
