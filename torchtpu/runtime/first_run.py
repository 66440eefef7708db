"""A loaded executable's first run, done ahead on the working-set thread (``working_set.py``).

A deserialized XLA:CPU executable's first execution costs far more than its later ones: XLA
builds the executable's kernels' run-time state then (the YNNPACK/slinky pipelines of its dots
and fusions, its thread-pool work), and JAX builds the C++ call path of ``Compiled``
(``create_cpp_call``). Measured with 100 small deserialized programs (a dot or a tanh-sum of
16x16 float32), CPU time per program: first call 0.9-1.2 ms, later calls 0.08 ms; perf put
~30% of the first call in slinky's pipeline builder and simplifier and ~25% in Python. After
one run here on zeros, the program's first call with real arguments cost 0.26-0.28 ms
(the C++ call's own cache entry, filled by the call).

So the working-set thread, after loading an executable ahead, runs it once on zero-filled
inputs of its own (allocated with ``device_put``: nothing is traced or compiled) through its
C++ call, and sets that call. The run goes through the C++ call itself, with arguments of the
kinds the executor passes (committed arrays on the device; a weakly typed 0-d input as an
uncommitted device scalar, as ``executor._device_scalar`` makes; the arguments jit dropped
too): that call's first run on a signature is JAX's Python ``aot_cache_miss`` (~0.4 ms),
which builds the C++ entry the program's first real call then takes (a warm generate's first
call made 354 of them on its path, 24 after this). Where the dropped arguments' abstract values
are not known, the executable is run directly (``execute_sharded``) and the entry is left to
the first call. Results cannot change: the run's outputs are dropped, its inputs are its own (donated
ones included), and an executable's later runs do not depend on its earlier ones. Only plain
programs are run ahead: no effects, host callbacks or mutable state (``create_cpp_call`` would
refuse them too), no custom calls at all (a kernel reading an index table or a LAPACK routine
on zeros is not worth the risk), no loops (a ``while`` whose trip count depends on the inputs
may never end on zeros), no extended dtypes, and at most ``MAX_BYTES`` of inputs and
outputs (``TORCHTPU_FIRST_RUN_MAX_BYTES``, default 32 MiB: a big graph's run costs compute and
memory; 0 turns this off). Any failure leaves the program as it was (its first call runs it).
Counted: ``working_set_first_runs``, ``working_set_first_run_ms``.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np

from .metrics import count

MAX_BYTES = int(os.environ.get("TORCHTPU_FIRST_RUN_MAX_BYTES", str(32 << 20)))


def _plain(executable) -> bool:
    call = getattr(executable, "unsafe_call", None)
    return (call is not None and not getattr(call, "ordered_effects", True)
            and not getattr(call, "has_unordered_effects", True)
            and not getattr(call, "has_host_callbacks", True)
            and getattr(call, "mut", None) is None
            and getattr(executable, "_mut", None) is None)


def _loops(executable) -> bool:
    """Whether the optimized program holds a ``while`` (or cannot be read)."""
    try:
        return any(" while(" in m.to_string() for m in executable.xla_executable.hlo_modules())
    except Exception:  # noqa: BLE001
        return True


def _nbytes(avals) -> int | None:
    n = 0
    for a in avals:
        dt = getattr(a, "dtype", None)
        shape = getattr(a, "shape", None)
        if dt is None or shape is None or not isinstance(dt, np.dtype):
            return None  # a token, an extended dtype (PRNG keys): not run ahead
        n += math.prod(shape) * dt.itemsize
    return n


def _call_avals(ex, params, kept_avals):
    """The abstract values of every argument the program is called with (jit dropped the
    unused ones from ``in_avals``), or None when they are not known."""
    n = params.in_tree.num_leaves
    if len(kept_avals) == n:
        return list(kept_avals)
    info = getattr(ex, "_all_args_info", None)
    every = getattr(info, "in_avals", None)
    if every is not None and len(every) == n:
        return list(every)
    return None


def _zeros(aval, device):
    import jax

    if aval.weak_type and aval.shape == () and aval.dtype.kind in "ifc":
        # a weakly typed scalar: the executor passes an uncommitted device scalar of a Python
        # number (executor._device_scalar), and the C++ call keys its entry on that
        x = jax.device_put(np.zeros((), aval.dtype).item())
        if x.dtype == aval.dtype and x.weak_type:
            return x
    return jax.device_put(np.zeros(aval.shape, aval.dtype), device)


def run_ahead(compiled, device, targets) -> bool:
    """Run the deserialized ``compiled`` (a ``jax.stages.Compiled`` on ``device``) once on
    zero-filled inputs and set its C++ call; False when it is not a program run ahead."""
    if MAX_BYTES <= 0 or targets:
        return False
    import jax

    ex = getattr(compiled, "_executable", None)
    if ex is None or not _plain(ex) or getattr(compiled, "_call", None) is not None:
        return False
    in_avals, out_avals = getattr(ex, "in_avals", None), getattr(ex, "out_avals", None)
    if in_avals is None or out_avals is None:
        return False
    n_in, n_out = _nbytes(in_avals), _nbytes(out_avals)
    if n_in is None or n_out is None or n_in + n_out > MAX_BYTES or _loops(ex):
        return False
    t0 = time.perf_counter()
    try:
        call = ex.create_cpp_call(compiled._params)
        if call is None:
            return False
        every = _call_avals(ex, compiled._params, in_avals)
        if every is not None:
            # through the C++ call: its first call fills its entry for arguments like these
            # (Python's aot_cache_miss, ~0.4 ms), which the program's first real call then hits
            jax.block_until_ready(call(*[_zeros(a, device) for a in every]))
        else:  # ``in_avals`` are the arguments XLA takes (after jit dropped unused ones)
            args = [jax.device_put(np.zeros(a.shape, a.dtype), device) for a in in_avals]
            results = ex.xla_executable.execute_sharded(args)
            for shards in results.disassemble_into_single_device_arrays():
                for out in shards:
                    out.block_until_ready()
    except Exception:  # noqa: BLE001 - its first call runs it as it would have
        return False
    if call is not None and compiled._call is None:
        compiled._call = call
    count("working_set_first_runs")
    count("working_set_first_run_ms", int((time.perf_counter() - t0) * 1000))
    return True
