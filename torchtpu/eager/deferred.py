"""Novel small exact ops served on the host while their program builds in the background.

A serving loop's own bookkeeping (SGLang's scheduler: its KV allocator's free list, the
sampler's ``argmax``, batch merges and filters, the overlap scheduler's future map) runs eager
ops on "tpu" tensors whose shapes follow the batch size, the request count and the prompt
lengths, so each new batch composition meets programs never compiled: each one an XLA
compile (150-1200 ms on a loaded 2-core host) inside a request's time to first token.

With this on (``enable(True)``; the SGLang platform turns it on in its worker processes), an
eager call whose program has no executable yet is, when the op is *exact on the host*, run by
PyTorch's own CPU kernel on host copies of its inputs and its results copied to the device,
while the program is loaded from the disk cache or compiled on a prefetch worker
(``Program.call_or_defer``, runtime/prefetch.py); a later call with the same key and shapes
runs the program once it is built. Exact on the host means the result cannot differ from the
program's: integer and boolean ops (integer arithmetic is exact), and data movement of any
dtype (``cat``, ``clone``, indexing, ``argmax``: no rounding anywhere). Floating-point
arithmetic, random ops, dtypes NumPy has no twin of (bfloat16), multi-device programs, and
tensors larger than ``MAX_BYTES`` (their host copy would cost more than it saves) take the
usual path: the call compiles its program itself. On XLA:CPU, where the host view of a device
array is free, a larger storage is read (only the elements a view spans are copied) and an
in-place call may write a large table (SGLang's ``req_to_token``: a copy of it in and out, a
few milliseconds, against a compile).

A host copy waits for the input's program (as reading it would); on XLA:CPU it is a view of
the device buffer, so only the elements the tensor spans are copied (a row of a large table).
Counted: ``eager_deferred_calls`` (per op: calls served on the host), ``eager_deferred_builds``
(programs queued on a worker). ``TORCHTPU_DEFERRED_MAX_BYTES`` (default 4 MiB) bounds each
tensor's bytes.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..runtime import devices as _devices
from ..runtime import prefetch as _prefetch
from ..runtime import sync_debug as _sync_debug
from ..runtime.metrics import count
from . import checks as _checks
from . import copy as _copy

ON = [False]
MAX_BYTES = int(os.environ.get("TORCHTPU_DEFERRED_MAX_BYTES", str(4 << 20)))

_HOST_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.float32, torch.float64}
_EXACT_INT = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
# ops whose results are copies, selections or comparisons of their inputs' values, whatever
# the dtype (no arithmetic, so nothing to round)
DATA_MOVEMENT = frozenset({
    "aten.cat.default", "aten.clone.default", "aten.index.Tensor", "aten.index_put.default",
    "aten.index_select.default", "aten.gather.default", "aten.argmax.default",
    "aten.argmin.default", "aten.stack.default", "aten.where.self", "aten.masked_fill.Scalar",
    "aten.masked_fill.Tensor", "aten.flip.default", "aten.roll.default",
    "aten.constant_pad_nd.default", "aten.repeat.default", "aten.eq.Tensor", "aten.eq.Scalar",
    "aten.ne.Tensor", "aten.ne.Scalar", "aten.lt.Tensor", "aten.lt.Scalar", "aten.le.Tensor",
    "aten.le.Scalar", "aten.gt.Tensor", "aten.gt.Scalar", "aten.ge.Tensor", "aten.ge.Scalar",
    "aten.maximum.default", "aten.minimum.default", "aten.clamp.default", "aten.copy.default",
    "aten.fill.Scalar", "aten.zeros_like.default", "aten.ones_like.default",
})


# integer inputs, a floating result that rounds (true division, transcendental functions):
# left to the program
_ROUNDING = ("aten.div.", "aten.true_divide", "aten.mean", "aten.pow", "aten.sqrt", "aten.rsqrt",
             "aten.exp", "aten.log", "aten.sin", "aten.cos", "aten.tan", "aten.sigmoid",
             "aten.reciprocal", "aten.std", "aten.var", "aten.softmax", "aten._softmax",
             "aten._log_softmax", "aten.log_softmax", "aten.erf", "aten.atan", "aten.norm",
             "aten.linalg", "aten.asin", "aten.acos", "aten.cumprod", "aten.prod")


HOLD = [False]


def enable(flag: bool = True, hold: bool = False) -> None:
    """Serve novel exact ops on the host while their programs build (this process); ``hold``:
    the builds wait for ``build_held`` (a server calls it while idle) instead of a worker."""
    ON[0] = bool(flag)
    HOLD[0] = bool(hold)


def held() -> int:
    """Builds waiting for ``build_held``."""
    return _prefetch.held()


def build_held(n: int = 1) -> int:
    """Build up to ``n`` held programs on this thread; how many were built."""
    return _prefetch.run_held(n)


def enabled() -> bool:
    return ON[0]


def _zero_copy() -> bool:
    return _devices.platform() == "cpu"


def eligible(lowering, args, kwargs, tensors, writes, functional: bool) -> bool:
    """Whether this call may be served on the host (see the module doc). ``writes``: slots of
    the tensors an in-place call writes (one, a whole storage, or the call is not served)."""
    if lowering.random or lowering.mutates or not tensors:
        return False
    name = lowering.name
    if name.startswith(_ROUNDING):
        return False
    if not functional and (len(writes) != 1 or name != "aten.index_put.default"
                           and not _all_int(tensors)):
        return False
    ints = True
    zero_copy = None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return False  # a traced scalar: the call's values are in the program's inputs
        if t.dtype not in _HOST_DTYPES:
            return False
        if t.dtype not in _EXACT_INT:
            ints = False
        if t.device.type != "tpu":
            continue  # a CPU scalar
        if t.numel() * t.element_size() > MAX_BYTES and not (
                not functional and t is tensors[writes[0]] and _zero_copy()):
            return False  # (the table an in-place call writes: where its host view is free)
        arr = getattr(getattr(t.untyped_storage(), "_tpu_buffer", None), "array", None)
        if arr is None or arr.dtype != np.dtype(_np_dtype(t.dtype)):
            return False
        if arr.nbytes > MAX_BYTES:
            if zero_copy is None:
                zero_copy = _zero_copy()
            if not zero_copy:
                return False
    if not ints and (name not in DATA_MOVEMENT or name == "aten.index_put.default" and (
            kwargs.get("accumulate") or len(args) > 3 and args[3])):
        return False  # floating arithmetic (an accumulating index_put adds)
    if not functional:
        w = tensors[writes[0]]
        arr = w.untyped_storage()._tpu_buffer.array
        if w.storage_offset() != 0 or not w.is_contiguous() or tuple(arr.shape) != tuple(w.shape):
            return False
    return True


def _all_int(tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype in _EXACT_INT for t in tensors)


_NPD: dict = {}


def _np_dtype(dt):
    d = _NPD.get(dt)
    if d is None:
        d = _NPD[dt] = torch.empty((), dtype=dt).numpy().dtype
    return d


def _host(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``t``'s values: the elements its view spans, copied from the storage
    array's host view."""
    arr = t.untyped_storage()._tpu_buffer.array
    flat = np.asarray(arr).reshape(-1)
    item = flat.itemsize
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    view = np.lib.stride_tricks.as_strided(flat[t.storage_offset():], shape=tuple(t.shape),
                                           strides=tuple(s * item for s in t.stride()),
                                           writeable=False)
    return torch.from_numpy(np.array(view))


def _to_host(x, box):
    if isinstance(x, torch.Tensor) and x.device.type == "tpu":
        if box[0] is None:
            box[0] = x.device
        return _host(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(e, box) for e in x)
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("cpu")
    return x


def _index(device) -> int:
    if device is None or device.index is None:
        return _devices.current_index()
    return _devices.canonical_index(device.index)


def _to_device(x, index):
    """``x``'s tensors on the device, one transfer each (``.to`` would allocate an empty
    tensor first: a program per new shape)."""
    if isinstance(x, torch.Tensor):
        return _copy.tensor_from_numpy(x.contiguous().numpy(), index)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(e, index) for e in x)
    return x


def serve(lowering, args, kwargs, written=None):
    """The call's results computed by PyTorch's CPU kernel of the op, on the device; for an
    in-place call (``written``: the tensor it writes, a whole storage), its new value is set
    as that storage's array and the tensor returned."""
    count("eager_deferred_calls", op=lowering.name)
    _checks.raise_pending()  # the inputs may depend on an op whose check failed
    _sync_debug.note(f"{lowering.name} (run by PyTorch's CPU kernel)")
    count("host_syncs")  # reading the inputs waits for their programs
    box = [None]
    cargs = _to_host(args, box)
    ckwargs = {k: _to_host(v, box) for k, v in kwargs.items()}
    out = lowering.op(*cargs, **ckwargs)
    index = _index(box[0])
    if written is None:
        return _to_device(out, index)
    new = out.to(written.dtype).reshape(written.shape)
    written.untyped_storage()._tpu_buffer.array = _copy.host_to_device(new, index)
    return written
