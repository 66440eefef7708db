"""``ProcessGroupTPU``: the "tpu_dist" c10d process group.

A Python subclass of ``torch._C._distributed_c10d.ProcessGroup`` (the only c10d class Python can
subclass): PyTorch's C++ callers (DDP's Reducer, ``_broadcast_coalesced``, functional
collectives) reach these methods through its trampolines, ``torch.distributed.*`` directly.
Each collective reads the operands' values (``eager/copy.py``), runs one cached SPMD program
(``collectives.py``) and writes the results into the output tensors. CPU tensors (object
collectives, ``barrier``) are accepted: they travel through this process's device.

Work: results are asynchronous ``jax.Array`` s already written into the outputs (later work is
ordered by data dependencies), so ``get_future()`` is complete at once; ``wait()`` blocks until
the program finished on this process and turns a transport failure into a RuntimeError naming
the group, the collective and its sequence number. A watchdog (``watchdog.py``) enforces the
group's timeout. With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` or ``TORCHTPU_DIST_CHECK=1`` every
collective first all-gathers (sequence number, collective, shapes, dtypes) and raises on every
rank when they disagree (a mismatch otherwise hangs or aborts inside the transport).
"""
from __future__ import annotations

import datetime
import hashlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist

from ..eager import copy as _copy
from ..runtime.dtypes import to_jax
from ..runtime import launches as _launches
from ..runtime import sync as _sync
from ..runtime.metrics import count
from . import bootstrap, mpmd, p2p_transport, watchdog
from .collectives import GroupMesh, concat_rows, pack, split_rows, unpack

_R = dist.ReduceOp.RedOpType
_OPS = {_R.SUM: "sum", _R.AVG: "avg", _R.PREMUL_SUM: "premul_sum", _R.MIN: "min",
        _R.MAX: "max", _R.PRODUCT: "product", _R.BAND: "band", _R.BOR: "bor", _R.BXOR: "bxor"}
_KINDS = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
          "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
          "all_to_all_single", "barrier", "send/recv", "all_reduce_coalesced",
          "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"]
_KIND_CODE = {k: i + 1 for i, k in enumerate(_KINDS)}


def _check_enabled() -> bool:
    return (os.environ.get("TORCHTPU_DIST_CHECK", "0") not in ("", "0")
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")


def _reduce_op(op) -> tuple[str, float | None]:
    kind = op.op if hasattr(op, "op") else op
    name = _OPS.get(kind)
    if name is None:
        raise ValueError(f"tpu_dist: unsupported reduce op {op}")
    factor = None
    if name == "premul_sum":
        f = op.factor
        if isinstance(f, torch.Tensor):
            f = f.item()
        factor = float(f)
    return name, factor


def _check_op_dtype(op: str, dtype: torch.dtype, coll: str) -> None:
    if op in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"tpu_dist {coll}: bitwise reduce op {op.upper()} needs an integer "
                           f"or bool tensor, got {dtype}")
    if op in ("avg", "premul_sum") and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"tpu_dist {coll}: reduce op {op.upper()} needs a floating point "
                           f"tensor, got {dtype}")
    if dtype.is_complex and op in ("min", "max", "band", "bor", "bxor"):
        raise RuntimeError(f"tpu_dist {coll}: reduce op {op.upper()} is not defined for {dtype}")


def _block(t: torch.Tensor, device):
    """A tensor's value as a block with at least one dimension, on this process's device."""
    if t.device.type == "tpu":
        v = _copy.value_of(t)
    else:
        v = _copy.host_to_device(t.detach(), 0)
    if v.sharding.device_set != {device}:
        v = jax.device_put(v, device)
    return v.reshape((1,)) if v.ndim == 0 else v


def _write(t: torch.Tensor, value) -> None:
    """Write a result block into tensor ``t`` (tpu: stays asynchronous; CPU: copies)."""
    if tuple(value.shape) != tuple(t.shape):
        value = value.reshape(tuple(t.shape))
    if t.device.type == "tpu":
        _copy.assign(t, value)
    else:
        t.copy_(_copy.device_to_host(value))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


_CODE_LEN = 10  # a transfer's code: dtype index, ndim, up to 8 dims
_IN_STORE, _VIA_SOCKET = b"\x00", b"\x01"  # after the code: where the payload is
# payloads from this size go over a direct connection (p2p_transport.py), not the store
_SOCKET_BYTES = int(os.environ.get("TORCHTPU_P2P_SOCKET_BYTES", 256 << 10))
_P2P_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
               torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


def _p2p_code(t) -> tuple:
    """(dtype index + 1, ndim, dims...) of a transfer's tensor (dims past 8: their product)."""
    shape = list(t.shape)
    if len(shape) > _CODE_LEN - 2:
        shape = shape[:_CODE_LEN - 3] + [int(np.prod(shape[_CODE_LEN - 3:]))]
    dt = _P2P_DTYPES.index(t.dtype) + 1 if t.dtype in _P2P_DTYPES else 99
    return (dt, t.dim(), *[int(d) for d in shape])


def _trim(row) -> tuple:
    ndim = min(int(row[1]), _CODE_LEN - 2)
    return tuple(int(v) for v in row[:2 + ndim])


def _describe(code) -> str:
    dt = _P2P_DTYPES[code[0] - 1] if 0 < code[0] <= len(_P2P_DTYPES) else "?"
    return f"{str(dt).replace('torch.', '')}{list(code[2:])}"


class Work(dist.Work):
    """A collective's handle: outputs are written; ``wait`` blocks until they are computed."""

    def __init__(self, pg, name: str, seq: int, outputs, arrays, flush=None):
        super().__init__()
        self._pg, self._name, self._seq = pg, name, seq
        self._outputs = list(outputs)
        self._arrays = list(arrays)
        self._flush = flush  # deferred point-to-point work runs at the first wait
        self._error: BaseException | None = None
        self._fut = None

    def _run_deferred(self) -> None:
        if self._flush is not None:
            f, self._flush = self._flush, None
            f(self)

    def wait(self, timeout=None) -> bool:
        self._run_deferred()
        if self._error is not None:
            raise self._error
        try:
            for a in self._arrays:
                a.block_until_ready()
        except Exception as e:  # noqa: BLE001  (the transport's error, named)
            self._error = self._pg._failure(self._name, self._seq, e)
            raise self._error from e
        return True

    def is_completed(self) -> bool:
        if self._flush is not None:
            return False
        return all(a.is_ready() for a in self._arrays)

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def source_rank(self) -> int:
        return -1

    def result(self):
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def get_future(self):
        if self._fut is None:
            self._run_deferred()
            self._fut = torch.futures.Future()
            self._fut.set_result(self._outputs)
        return self._fut


class ProcessGroupTPU(dist.ProcessGroup):
    """The c10d process group of backend "tpu_dist" (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks, group_id: str = ""):
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._global_ranks = list(global_ranks)
        self._gname = group_id
        self._desc = ""
        self._seq = 0
        self._p2p: list = []  # posted receives: (src, index, tensor, work)
        self._p2p_next: dict = {}  # ("send"|"recv", peer) -> index of the next transfer
        self._p2p_err_seen = ""
        self._p2p_tok = 0
        devs = [bootstrap.rank_device(r) for r in self._global_ranks]
        self._gm = GroupMesh(devs, rank)
        self._dev = self._gm.local
        self._zeros: dict = {}
        self._checked = _check_enabled()  # read once, when the group is made
        mpmd.note_group(self)
        self._peer_addr: dict = {}
        if store is not None and size > 1:  # large transfers' payloads come here directly
            store.set(self._key("addr", rank), p2p_transport.transport().address)

    # ---- identity ----
    @property
    def group_name(self) -> str:
        return self._gname

    def _set_group_name(self, name: str) -> None:
        self._gname = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def getBackendName(self) -> str:
        return "tpu_dist"

    def name(self) -> str:
        return "tpu_dist"

    def _get_backend(self, device):
        return self

    @property
    def _device_types(self):
        """The devices c10d may hand this group (its C++ list is empty for a Python group, and
        DCP's ``broadcast_from_rank0`` indexed it). "cpu" too, since CPU tensors are accepted;
        with it listed, object collectives keep choosing CPU tensors as before."""
        return [torch.device("cpu"), torch.device("tpu")]

    supports_splitting = False
    supports_coalescing = False

    def __repr__(self):
        return f"ProcessGroupTPU(group={self._gname!r}, rank={self.rank()}, size={self.size()})"

    def _where(self, coll: str, seq: int) -> str:
        return (f"[tpu_dist] rank {self.rank()} of group {self._gname!r} (global ranks "
                f"{self._global_ranks}): {coll} (sequence number {seq})")

    def _failure(self, coll: str, seq: int, err: BaseException) -> RuntimeError:
        if _launches.aborted is not None:  # the MPMD check aborted the transport under it
            return _launches.Aborted(f"{self._where(coll, seq)} was aborted: "
                                     f"{_launches.aborted}")
        bootstrap.state["failed"] = True
        extra = "; ".join(bootstrap.state["errors"])
        msg = f"{self._where(coll, seq)} failed: {str(err).splitlines()[0] if str(err) else err!r}"
        if extra:
            msg += f" ({extra})"
        return RuntimeError(msg)

    # ---- the one path every collective takes ----
    def _collective(self, coll: str, inputs, outputs, run, sig=()):
        """Check, launch ``run()`` (returns [(tensor, array)] writes), write, make the Work."""
        self._seq += 1
        seq = self._seq
        if self._checked:
            self._check(coll, seq, inputs, outputs, sig)
        count("dist_calls", op=coll)
        count("dist_bytes", _nbytes(inputs), op=coll)
        token = watchdog.start(self, coll, seq, self._timeout)
        try:
            writes = run()
        except (_launches.Mismatch, _launches.Aborted):  # the MPMD check: nothing ran
            watchdog.finish(token, [])
            raise
        except Exception as e:  # noqa: BLE001
            watchdog.finish(token, [])
            raise self._failure(coll, seq, e) from e
        arrays = []
        for t, v in writes:
            _write(t, v)
            arrays.append(v)
        # the watchdog watches the order token the program returned (it completes with the
        # program), not the results: holding those until its next look (0.5 s) kept memory
        # alive that FSDP2 had freed (every block's all-gather buffer during forward)
        last = _sync.order_tokens.get(self._dev)
        watchdog.finish(token, [last[1]] if last is not None else arrays)
        return Work(self, coll, seq, outputs, arrays)

    def _check(self, coll, seq, inputs, outputs, sig) -> None:
        """All-gather (seq, collective, shapes, dtypes) and compare: a clear error on every
        rank instead of a hang or an abort in the transport."""
        desc = repr((coll, sig, [(tuple(t.shape), str(t.dtype)) for t in inputs]))
        h = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:7], "little")
        mine = np.array([seq, _KIND_CODE.get(coll, 0), h], np.int64)
        got = np.asarray(self._gm.run("allgather", (), [jax.device_put(mine, self._dev)])[0])
        got = got.reshape(self.size(), 3)
        if (got == got[0]).all():
            return
        names = {v: k for k, v in _KIND_CODE.items()}
        rows = [f"rank {i}: {names.get(int(r[1]), '?')} (sequence number {int(r[0])}, "
                f"signature {int(r[2]):x})" for i, r in enumerate(got)]
        raise RuntimeError(
            f"{self._where(coll, seq)}: collectives differ across ranks (detected by "
            f"TORCHTPU_DIST_CHECK / TORCH_DISTRIBUTED_DEBUG=DETAIL). This rank: {desc}. "
            + "; ".join(rows))

    def _blocks(self, tensors):
        return [_block(t, self._dev) for t in tensors]

    def _zeros_like(self, shape, dtype):
        key = (tuple(shape), dtype)
        f = self._zeros.get(key)
        if f is None:
            jd = to_jax(dtype)
            f = self._zeros[key] = jax.jit(
                lambda: jnp.zeros(key[0], jd),
                out_shardings=jax.sharding.SingleDeviceSharding(self._dev))
        return f()

    # ---- all_reduce ----
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        op, factor = _reduce_op(opts.reduceOp)
        for t in tensors:
            _check_op_dtype(op, t.dtype, "all_reduce")

        def run():
            outs = self._gm.run("allreduce", (op, factor), self._blocks(tensors))
            return list(zip(tensors, outs))

        return self._collective("all_reduce", tensors, tensors, run, (op, factor))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        op, factor = _reduce_op(opts.reduceOp)
        for t in tensors:
            _check_op_dtype(op, t.dtype, "all_reduce_coalesced")

        def run():
            outs = self._gm.run("allreduce", (op, factor), self._blocks(tensors))
            return list(zip(tensors, outs))

        return self._collective("all_reduce_coalesced", tensors, tensors, run, (op, factor))

    # ---- all_gather ----
    def _check_same(self, coll, t, others):
        for o in others:
            if tuple(o.shape) != tuple(t.shape) or o.dtype != t.dtype:
                raise RuntimeError(
                    f"tpu_dist {coll}: every output must have the input's shape and dtype "
                    f"({tuple(t.shape)}, {t.dtype}), got ({tuple(o.shape)}, {o.dtype})")

    def allgather(self, output_tensors, input_tensors, opts=None):
        n = self.size()
        for outs, t in zip(output_tensors, input_tensors):
            if len(outs) != n:
                raise RuntimeError(f"tpu_dist all_gather: expected {n} output tensors, "
                                   f"got {len(outs)}")
            self._check_same("all_gather", t, outs)

        def run():
            gathered = self._gm.run("allgather", (), self._blocks(input_tensors))
            writes = []
            for outs, t, g in zip(output_tensors, input_tensors, gathered):
                rows = max(t.shape[0], 1) if t.dim() else 1
                writes += list(zip(outs, split_rows((rows,) * n)(g)))
            return writes

        flat = [o for outs in output_tensors for o in outs]
        return self._collective("all_gather", input_tensors, flat, run)

    def _allgather_base(self, output, input, opts=None):
        return self._gather_into(output_tensors=[output], input_tensors=[input],
                                 coll="all_gather_into_tensor")

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._gather_into(outputs, inputs, "all_gather_into_tensor_coalesced")

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _gather_into(self, output_tensors, input_tensors, coll):
        n = self.size()
        for o, t in zip(output_tensors, input_tensors):
            if o.numel() != n * t.numel() or o.dtype != t.dtype:
                raise RuntimeError(
                    f"tpu_dist {coll}: output tensor must have {n} x the input's elements and "
                    f"its dtype, got {tuple(o.shape)} {o.dtype} for input "
                    f"{tuple(t.shape)} {t.dtype}")

        def run():
            gathered = self._gm.run("allgather", (), self._blocks(input_tensors))
            return list(zip(output_tensors, gathered))

        return self._collective(coll, input_tensors, output_tensors, run)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    # ---- reduce_scatter ----
    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op, factor = _reduce_op(opts.reduceOp)
        n = self.size()
        for o, ins in zip(output_tensors, input_lists):
            _check_op_dtype(op, o.dtype, "reduce_scatter")
            if len(ins) != n:
                raise RuntimeError(f"tpu_dist reduce_scatter: expected {n} input tensors, "
                                   f"got {len(ins)}")
            self._check_same("reduce_scatter", o, ins)

        def run():
            cat = [concat_rows(n)(*self._blocks(ins)) for ins in input_lists]
            outs = self._gm.run("reduce_scatter", (op, factor), cat)
            return list(zip(output_tensors, outs))

        flat_in = [t for ins in input_lists for t in ins]
        return self._collective("reduce_scatter", flat_in, output_tensors, run, (op, factor))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._scatter_from([output], [input], opts, "reduce_scatter_tensor")

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._scatter_from(outputs, inputs, opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _scatter_from(self, outputs, inputs, opts, coll):
        opts = opts or dist.ReduceScatterOptions()
        op, factor = _reduce_op(opts.reduceOp)
        n = self.size()
        for o, t in zip(outputs, inputs):
            _check_op_dtype(op, o.dtype, coll)
            if t.numel() != n * o.numel() or o.dtype != t.dtype:
                raise RuntimeError(
                    f"tpu_dist {coll}: input tensor must have {n} x the output's elements and "
                    f"its dtype, got {tuple(t.shape)} {t.dtype} for output "
                    f"{tuple(o.shape)} {o.dtype}")

        def run():
            blocks = []
            for o, b in zip(outputs, self._blocks(inputs)):
                want = (n * o.shape[0],) + tuple(o.shape[1:]) if o.dim() else (n,)
                blocks.append(b if tuple(b.shape) == want else b.reshape(want))
            outs = self._gm.run("reduce_scatter", (op, factor), blocks)
            return list(zip(outputs, outs))

        return self._collective(coll, inputs, outputs, run, (op, factor))

    # ---- rooted collectives ----
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        src = opts.rootRank

        def run():
            outs = self._gm.run("broadcast", (src,), self._blocks(tensors))
            if self.rank() == src:
                return []
            return list(zip(tensors, outs))

        return self._collective("broadcast", tensors, tensors, run, (src,))

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        op, factor = _reduce_op(opts.reduceOp)
        for t in tensors:
            _check_op_dtype(op, t.dtype, "reduce")
        dst = opts.rootRank

        def run():
            outs = self._gm.run("allreduce", (op, factor), self._blocks(tensors))
            return list(zip(tensors, outs)) if self.rank() == dst else []

        return self._collective("reduce", tensors, tensors, run, (op, factor, dst))

    def gather(self, output_lists, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        dst, n = opts.rootRank, self.size()
        if self.rank() == dst:
            for outs, t in zip(output_lists, input_tensors):
                if len(outs) != n:
                    raise RuntimeError(f"tpu_dist gather: expected {n} output tensors on the "
                                       f"destination rank, got {len(outs)}")
                self._check_same("gather", t, outs)

        def run():
            gathered = self._gm.run("allgather", (), self._blocks(input_tensors))
            if self.rank() != dst:
                return []
            writes = []
            for outs, t, g in zip(output_lists, input_tensors, gathered):
                rows = t.shape[0] if t.dim() else 1
                writes += list(zip(outs, split_rows((rows,) * n)(g)))
            return writes

        flat = [o for outs in output_lists for o in outs]
        return self._collective("gather", input_tensors, flat, run, (dst,))

    def scatter(self, output_tensors, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        src, n = opts.rootRank, self.size()
        if self.rank() == src:
            for o, ins in zip(output_tensors, input_lists):
                if len(ins) != n:
                    raise RuntimeError(f"tpu_dist scatter: expected {n} input tensors on the "
                                       f"source rank, got {len(ins)}")
                self._check_same("scatter", o, ins)

        def run():
            blocks = []
            for i, o in enumerate(output_tensors):
                rows = o.shape[0] if o.dim() else 1
                if self.rank() == src:
                    blocks.append(concat_rows(n)(*self._blocks(input_lists[i])))
                else:
                    blocks.append(self._zeros_like((n * rows,) + tuple(o.shape[1:]), o.dtype))
            outs = self._gm.run("alltoall", (), blocks)
            writes = []
            for o, g in zip(output_tensors, outs):
                rows = o.shape[0] if o.dim() else 1
                writes.append((o, split_rows((rows,) * n)(g)[src]))
            return writes

        return self._collective("scatter", output_tensors, output_tensors, run, (src,))

    # ---- all_to_all ----
    def alltoall(self, output_tensors, input_tensors, opts=None):
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise RuntimeError(f"tpu_dist all_to_all: expected {n} input and output tensors")
        t0 = input_tensors[0]
        same = all(tuple(t.shape) == tuple(t0.shape) and t.dtype == t0.dtype
                   for t in list(input_tensors) + list(output_tensors))
        if not same or t0.dim() == 0:
            return self._alltoall_uneven_lists(output_tensors, input_tensors)

        def run():
            cat = concat_rows(n)(*self._blocks(input_tensors))
            (got,) = self._gm.run("alltoall", (), [cat])
            return list(zip(output_tensors, split_rows((t0.shape[0],) * n)(got)))

        return self._collective("all_to_all", input_tensors, output_tensors, run)

    def _alltoall_uneven_lists(self, output_tensors, input_tensors):
        dt = input_tensors[0].dtype
        if any(t.dtype != dt for t in list(input_tensors) + list(output_tensors)):
            raise RuntimeError("tpu_dist all_to_all: every tensor must have one dtype")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dt,
                               device=flat_in.device)
        work = self.alltoall_base(flat_out, flat_in, [t.numel() for t in output_tensors],
                                  [t.numel() for t in input_tensors])
        for o, piece in zip(output_tensors, flat_out.split([t.numel() for t in output_tensors])):
            o.copy_(piece.reshape(o.shape))
        return work

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        out_splits = list(output_split_sizes or [])
        in_splits = list(input_split_sizes or [])
        rows_in = input.shape[0] if input.dim() else 1
        rows_out = output.shape[0] if output.dim() else 1
        if not in_splits:
            if rows_in % n:
                raise RuntimeError(f"tpu_dist all_to_all_single: input's first dimension "
                                   f"{rows_in} is not divisible by the group size {n}")
            in_splits = [rows_in // n] * n
        if not out_splits:
            if rows_out % n:
                raise RuntimeError(f"tpu_dist all_to_all_single: output's first dimension "
                                   f"{rows_out} is not divisible by the group size {n}")
            out_splits = [rows_out // n] * n
        if (len(in_splits), len(out_splits)) != (n, n) or sum(in_splits) != rows_in \
                or sum(out_splits) != rows_out or output.dtype != input.dtype:
            raise RuntimeError(
                f"tpu_dist all_to_all_single: split sizes {in_splits} / {out_splits} do not "
                f"match input {tuple(input.shape)} / output {tuple(output.shape)} "
                f"for group size {n}")
        even = len(set(in_splits)) == 1 and len(set(out_splits)) == 1 and \
            in_splits[0] == out_splits[0]

        def run():
            (b,) = self._blocks([input])
            if even:
                (got,) = self._gm.run("alltoall", (), [b])
                return [(output, got)]
            # uneven: every rank pads its chunks to the largest chunk anywhere (one exchange)
            sizes = np.asarray(self._gm.run(
                "allgather", (), [jax.device_put(np.array(in_splits, np.int64), self._dev)])[0])
            m = max(int(sizes.max()), 1)
            (got,) = self._gm.run("alltoall", (), [pack(tuple(in_splits), m)(b)])
            return [(output, unpack(tuple(out_splits), m)(got))]

        return self._collective("all_to_all_single", [input], [output], run,
                                (tuple(in_splits), tuple(out_splits)))

    # ---- barrier ----
    def barrier(self, opts=None):
        def run():
            (out,) = self._gm.run("allreduce", ("sum", None),
                                  [self._zeros_like((1,), torch.int32)])
            out.block_until_ready()
            return []

        return self._collective("barrier", [], [], run)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self.barrier().wait()

    # ---- point to point: sends buffered at once, receives matched at their wait ----
    def send(self, tensors, dst: int, tag: int = 0):
        self._check_peer("send", dst)
        self._p2p_errors()
        for t in tensors:
            self._post_send(t, dst)
        return Work(self, "send/recv", 0, tensors, [], flush=self._p2p_errors)

    def recv(self, tensors, src: int, tag: int = 0):
        self._check_peer("recv", src)
        self._p2p_errors()
        work = Work(self, "send/recv", 0, tensors, [], flush=self._flush_p2p)
        for t in tensors:
            n = self._p2p_next.get(("recv", src), 0)
            self._p2p_next[("recv", src)] = n + 1
            self._p2p.append((src, n, t, work))
        return work

    def recv_anysource(self, tensors, tag: int = 0):
        # as ProcessGroupNCCL (NotImplementedError): an XLA program names both ends of a transfer
        raise NotImplementedError("tpu_dist does not support recvAnysource (recv without src=), "
                                  "as NCCL does not: XLA programs name both ends of a transfer")

    def _check_peer(self, kind, peer) -> None:
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"tpu_dist {kind}: invalid peer rank {peer} for rank "
                             f"{self.rank()} of a group of size {self.size()}")
        if self._store is None:
            raise RuntimeError(f"tpu_dist {kind}: this process group has no c10d store "
                               "(send/recv buffer their transfers in it)")

    def _key(self, *parts) -> str:
        return "tpu_p2p/" + "/".join(str(p) for p in parts)

    def _post_send(self, t, dst: int) -> None:
        """Buffer a send in the group's store at once (as NCCL, a posted send needs no wait
        from its receiver): (dtype, shape) code, then the bytes. The k-th send to a rank is
        that rank's k-th receive from us."""
        n = self._p2p_next.get(("send", dst), 0)
        self._p2p_next[("send", dst)] = n + 1
        block = _block(t, self._dev)
        # a view of the device array (XLA:CPU: no copy); a small payload is copied into the
        # store value, a large one's array stays referenced (so never donated) until written
        data = np.asarray(block).reshape(-1).view(np.uint8)
        code = np.zeros(_CODE_LEN, np.int64)
        c = _p2p_code(t)
        code[:len(c)] = c
        count("dist_calls", op="send/recv")
        count("dist_bytes", data.nbytes, op="send/recv")
        key = self._key(self.rank(), dst, n)
        if data.nbytes >= _SOCKET_BYTES:  # the payload over a direct connection, queued first
            addr = self._peer_addr.get(dst)
            if addr is None:
                addr = self._peer_addr[dst] = self._store.get(self._key("addr", dst)).decode()
            p2p_transport.transport().put(addr, f"{self._gname}/{key}", data, keep=block)
            self._store.set(key, code.tobytes() + _VIA_SOCKET)
        else:
            self._store.set(key, code.tobytes() + _IN_STORE + data.tobytes())

    def _p2p_errors(self, work=None) -> None:
        """Raise what a receiver reported about one of this rank's sends (a shape mismatch is
        found at the receive; the send itself completed when it was buffered)."""
        key = self._key("err", self.rank())
        if not self._store.check([key]):
            return
        v = self._store.get(key).decode()
        if v != self._p2p_err_seen:
            self._p2p_err_seen = v
            raise RuntimeError(f"{self._where('send/recv', self._seq)}: "
                               + v.split("\n", 1)[1])

    def _flush_p2p(self, work=None) -> None:
        """Complete ``work``'s receives (every pending one when ``work`` is None): each waits
        for its send in the store, polling. A receive whose send differs in dtype or shape is a
        RuntimeError here and at the sender's next send/recv wait, naming both sides; two ranks
        each waiting on a receive the other has not sent is a deadlock error on both; anything
        else that stalls is bounded by the group's timeout (the watchdog)."""
        mine = [op for op in self._p2p if work is None or op[3] is work]
        for op in mine:
            src, n, t, w = op
            self._p2p = [o for o in self._p2p if o is not op]
            try:
                self._recv_one(src, n, t)
            except BaseException:
                self._p2p = [o for o in self._p2p if o[3] is not w]
                w._flush = None
                raise
        if work is not None:
            work._flush = None
        self._p2p_errors()  # after the receives: they are done either way

    def _recv_one(self, src: int, n: int, t) -> None:
        me, store = self.rank(), self._store
        key = self._key(src, me, n)
        desc = f"recv {_describe(_p2p_code(t))} from rank {src}"
        if not store.check([key]):
            self._p2p_block(src, n, key, desc)
        raw = store.get(key)
        store.delete_key(key)
        code = _trim(np.frombuffer(raw[:_CODE_LEN * 8], np.int64))
        if code != _p2p_code(t):
            msg = (f"the transfer does not match rank {{peer}}'s: this rank's {{mine}}, rank "
                   f"{{peer}}'s {{theirs}} (transfer {n} from rank {src} to rank {me})")
            store.set(self._key("err", src), f"{me}:{n}:{time.monotonic_ns()}\n" + msg.format(
                peer=me, mine=f"send {_describe(code)} to rank {me}",
                theirs=f"recv {_describe(_p2p_code(t))}"))
            raise RuntimeError(f"{self._where('send/recv', self._seq)}: " + msg.format(
                peer=src, mine=desc, theirs=f"send {_describe(code)}"))
        if raw[_CODE_LEN * 8:_CODE_LEN * 8 + 1] == _VIA_SOCKET:
            payload = p2p_transport.transport().take(
                f"{self._gname}/{key}", time.monotonic() + self._timeout.total_seconds(),
                f"{self._where('send/recv', self._seq)}: {desc}")
        else:
            payload = raw[_CODE_LEN * 8 + 1:]
        arr = np.frombuffer(payload, np.dtype(to_jax(t.dtype)))
        _write(t, jax.device_put(arr.reshape(tuple(t.shape)), self._dev))

    def _p2p_block(self, src: int, n: int, key: str, desc: str) -> None:
        """Wait for ``key`` (the n-th send from ``src``). This rank's wait is published
        (``wait/<rank>``: src, n, a token); a peer that waits on this rank for a send this rank
        has not posted while this rank waits on it is a deadlock: both raise (the one that sees
        it first marks the other's token)."""
        me, store = self.rank(), self._store
        self._p2p_tok += 1
        tok = f"{self._p2p_tok}"
        store.set(self._key("wait", me), f"{src} {n} {tok}")
        count("dist_p2p_waits")
        token = watchdog.start(self, "send/recv", self._seq, self._timeout)
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 0.0005
        try:
            while not store.check([key]):
                dead = None
                dl = self._key("deadlock", me)
                if store.check([dl]) and store.get(dl).decode() == tok:
                    dead = "marked"
                pk = self._key("wait", src)
                if dead is None and store.check([pk]):
                    parts = store.get(pk).decode().split()
                    if len(parts) == 3 and int(parts[0]) == me and \
                            self._p2p_next.get(("send", src), 0) <= int(parts[1]):
                        # the peer waits for a send this rank has not posted; it is a
                        # deadlock only if what this rank waits for is still missing now
                        # (the peer cannot send it while it waits)
                        if store.check([key]):
                            return
                        store.set(self._key("deadlock", src), parts[2])
                        dead = (f"its transfer {parts[1]}; this rank sent "
                                f"{self._p2p_next.get(('send', src), 0)}")
                if dead:
                    if store.check([key]):
                        return  # it came after all
                    raise RuntimeError(
                        f"{self._where('send/recv', self._seq)}: deadlock with rank {src}: "
                        f"this rank waits on {desc} (transfer {n}); rank {src} waits on a "
                        f"recv from this rank that this rank has not sent ({dead}): no send "
                        f"meets a recv")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self._where('send/recv', self._seq)}: timed out after "
                        f"{self._timeout} waiting on {desc} (transfer {n})")
                p2p_transport.transport().wait_arrival(pause)
                pause = min(pause * 2, 0.01)
        finally:
            store.set(self._key("wait", me), "idle")
            watchdog.finish(token, [])

    # ---- lifecycle ----
    def shutdown(self) -> None:
        self._p2p = []  # receives never waited on (their tensors were never read)

    def abort(self) -> None:
        self._p2p = []

    def set_timeout(self, timeout) -> None:
        self._timeout = timeout


_C10D_PRIVATE = {"_allgather_base", "_reduce_scatter_base", "_set_group_name",
                 "_set_group_desc", "_get_backend"}


def _no_dynamo(cls):
    """Dynamo must call the c10d entry points, not trace them (DISTRIBUTED.md: compiled DDP);
    our own helpers are only reached through them."""
    for name, fn in list(vars(cls).items()):
        if callable(fn) and not isinstance(fn, type) and (
                not name.startswith("_") or name in _C10D_PRIVATE):
            setattr(cls, name, torch.compiler.disable(fn))
    return cls


_no_dynamo(ProcessGroupTPU)
_no_dynamo(Work)
