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
inputs of its own (allocated with ``device_put``: nothing is traced or compiled) and sets its
C++ call. Results cannot change: the run's outputs are dropped, its inputs are its own (donated
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
        # ``in_avals`` are the arguments XLA takes (after jit dropped unused ones), in order
        args = [jax.device_put(np.zeros(a.shape, a.dtype), device) for a in in_avals]
        results = ex.xla_executable.execute_sharded(args)
        for shards in results.disassemble_into_single_device_arrays():
            for out in shards:
                out.block_until_ready()
        call = ex.create_cpp_call(compiled._params)
    except Exception:  # noqa: BLE001 - its first call runs it as it would have
        return False
    if call is not None and compiled._call is None:
        compiled._call = call
    count("working_set_first_runs")
    count("working_set_first_run_ms", int((time.perf_counter() - t0) * 1000))
    return True
