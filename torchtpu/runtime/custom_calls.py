"""What a deserialized executable needs from this process before it may run.

An XLA executable read back from the compile cache skips tracing and lowering. Some of its
custom calls rely on process state that JAX sets up only while it *lowers* an op: XLA:CPU's
linear-algebra kernels are FFI handlers (registered when jax is imported) that call LAPACK
through a function table which jaxlib fills in at the first lowering of a linalg op
(``jaxlib.lapack.prepare_lapack_call``). A cached ``linalg.inv`` run in a fresh process called
into the empty table and the process died with SIGSEGV. Host callbacks (``pure_callback``,
``io_callback``) name a Python function by its index in this process's callback table, and
``custom_partitioning`` by a key into a process-local registry: an executable holding one can
never be run by another process.

So every cached entry records the custom-call targets of its module (``targets``, read off the
lowered StableHLO text at store time), and before an entry is deserialized ``ready`` makes each
target usable: targets known to be registered whenever jax is imported pass; targets whose
handlers need a table filled at lowering get it filled (the same call JAX's lowering makes,
idempotent and cheap); any other target, or a host callback, makes ``ready`` answer the reason
and the entry is a counted miss, rebuilt by lowering (which sets up whatever it needs), never
run. Entries with a target that can never be made ready are not written at all (``storable``).
torchtpu's own CPU kernels (``cpu_kernels.py``) are made ready by building (once) and
registering them.
"""
from __future__ import annotations

import functools
import re

# Built into XLA (or into the PJRT plugin) on some platform: nothing to set up.
_BUILTIN = frozenset((
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement",
    "MoveToHost", "MoveToDevice", "LayoutConstraint", "AllocateBuffer", "Pin", "Unpin",
    "X64Combine", "X64SplitLow", "X64SplitHigh", "tpu_custom_call", "__gpu$xla.gpu.triton",
    "TopK", "mhlo.topk", "InspectSharding", "xla.sdy.FuncResultSharding",
))
_BUILTIN_PREFIXES = ("__cudnn$", "__cublas$", "__cublasLt$", "__nvshmem$", "xla.sdy.",
                     "xla.gpu.", "__xla_")
# Hold a pointer into this process (a Python callable, a partitioner): never loadable.
_PROCESS_BOUND = re.compile(r"python.*callback|callback.*python|CustomSPMDPartitioning|"
                            r"custom_partitioning")
_TARGET = re.compile(r'custom_call\s*@"?([^\s("]+)"?|call_target_name\s*=\s*"([^"]+)"')

_preparers: list = []  # (set of targets, function that makes them ready), built lazily
_ready: dict = {}  # targets tuple -> None (ready) or the reason it cannot be


def targets(text: str) -> tuple:
    """The sorted custom-call targets named in a lowered module's text (StableHLO, pretty or
    generic form)."""
    if "custom_call" not in text:
        return ()
    found = set()
    for m in _TARGET.finditer(text):
        found.add(m.group(1) or m.group(2))
    return tuple(sorted(found))


def storable(names) -> str | None:
    """None when an executable with these targets may be written to the cache, else why not."""
    for t in names:
        if _PROCESS_BOUND.search(t):
            return f"host callback {t}"
    return None


def _known():
    """[(targets, prepare)] for the targets jaxlib registers at import, with the function that
    fills in what their handlers read (None: nothing to fill)."""
    if _preparers:
        return _preparers
    from jax._src.lib import gpu_linalg, gpu_prng, gpu_solver, gpu_sparse, lapack

    def names(mod):
        if mod is None or not hasattr(mod, "registrations"):
            return set()
        return {n for ts in mod.registrations().values() for n, *_ in ts}

    def init_lapack():
        from jax._src.lax import linalg

        linalg.initialize_lapack()

    def init_hybrid():
        gpu_solver.initialize_hybrid_kernels()

    from . import cpu_kernels

    for target, kernel in cpu_kernels.TARGETS.items():
        _preparers.append(({target}, functools.partial(cpu_kernels.prepare, kernel)))
    _preparers.append((names(lapack), init_lapack))
    _preparers.append((names(gpu_solver), init_hybrid))
    for mod in (gpu_linalg, gpu_sparse, gpu_prng):
        _preparers.append((names(mod), None))
    return _preparers


def ready(names) -> str | None:
    """Make every target in ``names`` usable by a deserialized executable in this process.
    None when they all are; else the reason (the entry must be rebuilt, not run)."""
    key = tuple(names)
    if not key:
        return None
    hit = _ready.get(key, False)
    if hit is not False:
        return hit
    reason = storable(key)
    if reason is None:
        todo = []
        for t in key:
            if t in _BUILTIN or t.startswith(_BUILTIN_PREFIXES):
                continue
            for group, prepare in _known():
                if t in group:
                    if prepare is not None and prepare not in todo:
                        todo.append(prepare)
                    break
            else:
                reason = f"custom call {t} is not known to be set up in a new process"
                break
        if reason is None:
            try:
                for prepare in todo:
                    prepare()
            except Exception as e:  # noqa: BLE001 - then lowering must set it up
                reason = f"setting up custom calls failed: {type(e).__name__}: {e}"
    _ready[key] = reason
    return reason
