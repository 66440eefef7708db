"""OpInfo coverage: run PyTorch's ``op_db`` on "tpu" and compare every result with CPU.

``python -m torchtpu.coverage`` runs every OpInfo (forward in float32, bfloat16, int64 and bool
where the op supports the dtype on CPU; gradients of a float32 backward where it supports
autograd) in worker subprocesses (a crash or hang in one op cannot stop the run), prints a
coverage table and writes ``docs/op_coverage.md``. ``--write-xfails`` also regenerates
``tests/opinfo_expected_failures.txt`` from the run. ``tests/test_opinfo.py`` runs the same checks
under pytest (``check_op`` below is shared), with the expected failures as strict xfails.

What a check does, per (op, dtype, kind):
- sample inputs are made on CPU (seeded, so runs are reproducible), then copied to "tpu": every
  tensor in input/args/kwargs, nested lists included (a ``device`` kwarg becomes "tpu");
- the op runs on both; outputs (after the sample's ``output_process_fn_grad``, as PyTorch's own
  CPU-vs-device test does) are compared with ``torch.testing.assert_close`` at the same dtype,
  with PyTorch's default tolerances for the dtype unless the OpInfo declares wider ones
  (``toleranceOverride`` / ``precisionOverride``, see ``tolerance``);
- backward: ``torch.autograd.grad`` of the (float) outputs with random grad_outputs made on CPU
  and copied, w.r.t. every input tensor that requires grad; gradients compared the same way;
- "native" means no CPU fallback happened while the op (or its backward) ran on "tpu"
  (``torch.tpu.metrics()['counters']['cpu_fallbacks']``); a decomposition into native lowerings
  is native. A CPU fallback gives correct numbers but is NOT a pass: it is reported separately.
- ops whose output is random (dropout, normal, ...) or undefined (empty*) are checked for
  shape, dtype and device only; each one is listed with its reason in ``RANDOM`` / ``UNDEFINED``.
- host syncs (data-dependent shapes: nonzero, unique, masked_select, ...) are allowed and counted.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
import warnings

import torch

# ---------------------------------------------------------------------------------------------
# configuration

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int64: "int64",
               torch.bool: "bool"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
FORWARD, BACKWARD = "forward", "backward"

# Samples per (op, dtype): the fast CI subset and the full run (``python -m torchtpu.coverage``).
MODES = {
    "fast": {"max_samples": 1, "dtypes": "float32+1"},
    "full": {"max_samples": 2, "dtypes": "all"},
}
DEFAULT_TIMEOUT_S = 300  # per op (all its dtypes and kinds), in both pytest and the workers

# Ops whose output is random: values cannot be compared with CPU's (the RNGs differ), so the
# check is shape, dtype and device. The value is the reason shown in the report.
RANDOM = {
    "bernoulli": "random output", "cauchy": "random output", "exponential": "random output",
    "geometric": "random output", "log_normal": "random output", "multinomial": "random output",
    "normal": "random output", "normal.in_place": "random output",
    "normal.number_mean": "random output", "uniform": "random output",
    "rand_like": "random output", "randn": "random output", "randn_like": "random output",
    "randint": "random output", "randint_like": "random output",
    "nn.functional.fractional_max_pool2d": "random pooling regions",
    "nn.functional.fractional_max_pool3d": "random pooling regions",
    "svd_lowrank": "randomised algorithm", "pca_lowrank": "randomised algorithm",
}


def _dropout_random(kw):
    return kw.get("training", True) is not False and kw.get("p", 0.5) not in (0, 0.0)


# Ops random only for some samples (dropout with p > 0 in training): sample -> bool.
RANDOM_IF = {
    "nn.functional.dropout": ("dropout in training mode", _dropout_random),
    "nn.functional.dropout2d": ("dropout in training mode", _dropout_random),
    "nn.functional.dropout3d": ("dropout in training mode", _dropout_random),
    "nn.functional.alpha_dropout": ("dropout in training mode", _dropout_random),
    "nn.functional.feature_alpha_dropout.with_train": ("dropout in training mode", _dropout_random),
    "nn.functional.rrelu": ("random slopes in training mode",
                            lambda kw: kw.get("training", False) is True),
    "nn.functional.scaled_dot_product_attention": (
        "attention dropout", lambda kw: kw.get("dropout_p", 0.0) not in (0, 0.0)),
    "nn.functional.multi_head_attention_forward": (
        "attention dropout", lambda kw: kw.get("training", True) is not False
        and kw.get("dropout_p", 0.0) not in (0, 0.0)),
}

# Ops whose output values are undefined (uninitialised memory): shape, dtype and device only.
UNDEFINED = {n: "uninitialised output" for n in (
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted")}

# Tensor arguments PyTorch requires on CPU whatever the device: kept on CPU (op -> reason).
CPU_ARGS = {
    "tensor_split": "indices_or_sections must be a CPU tensor (PyTorch's rule on every device)",
}

# OpInfos that cannot run on a CPU-referenced backend at all; listed in the report as n/a.
NOT_APPLICABLE_PREFIX = {
    "jiterator_": "CUDA-only (jiterator)",
}

# The ops named by the "tpu" device issue: 100% required (float32 forward natively, and
# gradients where the op supports autograd). tests/test_opinfo.py checks each one.
REQUIRED = (
    "add", "sub", "mul", "div.no_rounding_mode", "neg", "abs", "exp", "log", "sqrt", "rsqrt",
    "pow", "sigmoid", "tanh", "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu",
    "matmul", "mm", "bmm", "addmm", "linalg.vector_norm",
    "nn.functional.linear", "nn.functional.conv1d", "nn.functional.conv2d",
    "nn.functional.layer_norm", "nn.functional.batch_norm", "nn.functional.group_norm",
    "nn.functional.rms_norm",
    "nn.functional.max_pool2d", "nn.functional.avg_pool2d", "nn.functional.adaptive_avg_pool2d",
    "softmax", "log_softmax", "nn.functional.scaled_dot_product_attention",
    "nn.functional.cross_entropy", "nn.functional.mse_loss", "nn.functional.nll_loss",
    "nn.functional.l1_loss", "nn.functional.smooth_l1_loss",
    "nn.functional.binary_cross_entropy_with_logits",
    "nn.functional.embedding",
    "index_select", "gather", "scatter", "scatter_add", "index_put", "index_add",
    "__getitem__", "masked_fill", "nonzero", "masked_select",
    "sum", "mean", "amax", "amin", "max.reduction_with_dim", "min.reduction_with_dim",
    "argmax", "argmin", "prod", "var", "std",
    "cat", "stack", "split", "chunk", "reshape", "view", "permute", "transpose", "expand",
    "sort", "topk", "cumsum", "clamp", "where",
)

# ---------------------------------------------------------------------------------------------
# the op database


def op_key(opinfo) -> str:
    return opinfo.name + ("." + opinfo.variant_test_name if opinfo.variant_test_name else "")


_DB: dict = {}


def op_db() -> dict:
    """{op key: OpInfo} for all of PyTorch's op_db, in op_db order."""
    if not _DB:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.testing._internal.common_methods_invocations import op_db as db
        for o in db:
            _DB[op_key(o)] = o
    return _DB


def not_applicable(key: str, opinfo) -> str | None:
    for prefix, why in NOT_APPLICABLE_PREFIX.items():
        if key.startswith(prefix):
            return why
    if not opinfo.supported_dtypes("cpu"):
        return "no CPU dtypes (no CPU reference)"
    return None


def forward_dtypes(opinfo, mode: str = "full") -> list:
    supported = opinfo.supported_dtypes("cpu")
    dts = [d for d in DTYPES if d in supported]
    if MODES[mode]["dtypes"] == "all":
        return dts
    if torch.float32 in dts:
        others = [d for d in dts if d is not torch.float32]
        return [torch.float32] + others[:1]
    return dts[:2]


def supports_grad(opinfo) -> bool:
    return bool(opinfo.supports_autograd) and torch.float32 in opinfo.supported_backward_dtypes("cpu")


def cases(mode: str = "full"):
    """[(op key, dtype name, kind)] that a run of ``mode`` checks (n/a ops excluded)."""
    out = []
    for key, o in op_db().items():
        if not_applicable(key, o):
            continue
        for d in forward_dtypes(o, mode):
            out.append((key, DTYPE_NAMES[d], FORWARD))
        if supports_grad(o):
            out.append((key, "float32", BACKWARD))
    return out


# ---------------------------------------------------------------------------------------------
# tolerances


def tolerance(opinfo, dtype):
    """(atol, rtol) the OpInfo declares for samples of ``dtype`` (the widest), or None.

    Declared means a ``toleranceOverride``/``precisionOverride`` among the OpInfo's decorators
    (plain, or in a ``DecorateInfo`` for any test, for all devices or for CPU/CUDA). Each output
    is compared with at least PyTorch's default tolerances for the OUTPUT's dtype
    (``torch.testing.assert_close``'s defaults), so an int64 sample with a float output is
    compared as floats.
    """
    from torch.testing._comparison import default_tolerances
    from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride

    rtol, _ = default_tolerances(dtype)
    declared = []

    def visit(dec):
        if isinstance(dec, toleranceOverride) and dtype in dec.d:
            declared.append((dec.d[dtype].atol, dec.d[dtype].rtol))
        elif isinstance(dec, precisionOverride) and dtype in dec.d:
            declared.append((dec.d[dtype], rtol))

    for dec in opinfo.decorators or ():
        if hasattr(dec, "decorators") and hasattr(dec, "device_type"):
            if dec.device_type not in (None, "cpu", "cuda"):
                continue
            if dec.dtypes is not None and dtype not in dec.dtypes:
                continue
            if not dec.active_if:
                continue
            for d in dec.decorators:
                visit(d)
        else:
            visit(dec)
    if not declared:
        return None
    return max(a for a, _ in declared), max(r for _, r in declared)


def _tols(tol, dtype):
    from torch.testing._comparison import default_tolerances

    rtol, atol = default_tolerances(dtype)
    if tol is None:
        return atol, rtol
    return max(atol, tol[0]), max(rtol, tol[1])


# ---------------------------------------------------------------------------------------------
# moving samples


def _same_view(x, device, memo):
    """``x`` on ``device`` with the same storage, sizes, strides and offset (so ops that read
    outside a view, like as_strided, and samples sharing a storage, behave as on CPU)."""
    try:
        st = x.untyped_storage()
        n = st.nbytes() // x.element_size()
        if n == 0 or x.is_conj() or x.is_neg():
            return x.to(device)
        sk = ("storage", st.data_ptr(), x.dtype)
        base = memo.get(sk)
        if base is None:
            flat = torch.empty(0, dtype=x.dtype).set_(st, 0, (n,), (1,))
            base = memo[sk] = flat.to(device)
        return base.as_strided(x.shape, x.stride(), x.storage_offset()).detach()
    except Exception:  # noqa: BLE001  (odd tensors: fall back to a plain copy)
        return x.to(device)


def _move(x, device, memo):
    if isinstance(x, torch.Tensor):
        got = memo.get(id(x))
        if got is None:
            t = _same_view(x.detach(), device, memo) if device != "cpu" else x.detach()
            if x.requires_grad:
                t.requires_grad_(True)
            got = memo[id(x)] = t
        return got
    if isinstance(x, list):
        return [_move(e, device, memo) for e in x]
    if isinstance(x, tuple):
        return tuple(_move(e, device, memo) for e in x)
    if isinstance(x, dict):
        return {k: _move(v, device, memo) for k, v in x.items()}
    if device != "cpu" and ((isinstance(x, torch.device) and x.type == "cpu")
                            or (isinstance(x, str) and x == "cpu")):
        # a device argument (e.g. Tensor.to's target) is the device the sample was made for
        return torch.device(device) if isinstance(x, torch.device) else device
    return x


def _move_sample(sample, device, key=None):
    """(input, args, kwargs) with every tensor a fresh leaf on ``device`` (grad flags kept)."""
    memo: dict = {}
    inp = _move(sample.input, device, memo)
    args = _move(tuple(sample.args), "cpu" if key in CPU_ARGS else device, memo)
    kwargs = _move(dict(sample.kwargs), device, memo)
    if "device" in kwargs and kwargs["device"] is not None:
        kwargs["device"] = torch.device(device)
    return inp, args, kwargs


def _tensors(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for e in x:
            _tensors(e, out)
    elif isinstance(x, dict):
        for e in x.values():
            _tensors(e, out)
    return out


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(e) for e in x) if not hasattr(x, "_fields") else \
            type(x)(*(_to_cpu(e) for e in x))
    return x


# ---------------------------------------------------------------------------------------------
# comparing


class Mismatch(AssertionError):
    pass


def _compare(actual, expected, tol, values=True, path="output"):
    """Compare a tpu result (already on CPU) with CPU's; raises Mismatch naming the place."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"{path}: expected a Tensor, got {type(actual).__name__}")
        if actual.dtype != expected.dtype:
            raise Mismatch(f"{path}: dtype {actual.dtype} != CPU's {expected.dtype}")
        if actual.shape != expected.shape:
            raise Mismatch(f"{path}: shape {tuple(actual.shape)} != CPU's {tuple(expected.shape)}")
        if not values:
            return
        atol, rtol = _tols(tol, expected.dtype)
        try:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True,
                                       check_device=False, check_stride=False, check_layout=False)
        except AssertionError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            detail = "; ".join(ln for ln in lines[1:3])
            raise Mismatch(f"{path}: {lines[0] if lines else 'not close'} {detail}".strip()) from None
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"{path}: expected a sequence of {len(expected)}, got {type(actual).__name__}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, tol, values, f"{path}[{i}]")
        return
    if isinstance(expected, float) and isinstance(actual, float) and values:
        atol, rtol = _tols(tol, torch.float64)
        if not (abs(actual - expected) <= atol + rtol * abs(expected)
                or (actual != actual and expected != expected)):
            raise Mismatch(f"{path}: {actual} != CPU's {expected}")
        return
    if values and actual != expected:
        raise Mismatch(f"{path}: {actual!r} != CPU's {expected!r}")


def _check_on_tpu(x, path="output"):
    for i, t in enumerate(_tensors(x, [])):
        if t.device.type != "tpu":
            raise Mismatch(f"{path}: a result tensor is on {t.device}, not tpu")


# ---------------------------------------------------------------------------------------------
# running one op


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    line = msg[0] if msg else ""
    return f"{type(e).__name__}: {line}"[:300]


def _random_reason(key, sample):
    if key in UNDEFINED:
        return UNDEFINED[key]
    if key in RANDOM:
        return RANDOM[key]
    if key in RANDOM_IF:
        why, pred = RANDOM_IF[key]
        if pred(dict(sample.kwargs)):
            return why
    return None


def _counter(name):
    return torch.tpu.metrics()["counters"].get(name, 0)


def _fallback_ops():
    return sorted(torch.tpu.metrics()["per_op"].get("cpu_fallbacks", {}))


class _Acc:
    """Accumulates the per-sample outcomes of one (op, dtype, kind)."""

    def __init__(self):
        self.n = 0
        self.native = 0
        self.fallback = 0
        self.failed = 0
        self.first_bad = None  # first sample index that failed or fell back
        self.reason = None  # of the first failure (else of the first fallback)
        self.fallback_ops: set = set()
        self.host_syncs = 0
        self.checked = set()  # "values" / "shape+dtype (<why>)"
        self.note = None  # why samples were not checked

    def ok(self, i, fallbacks, syncs):
        self.n += 1
        self.host_syncs += syncs
        if fallbacks:
            self.fallback += 1
            self.fallback_ops.update(fallbacks)
            if self.first_bad is None:
                self.first_bad = i
            if self.reason is None:
                self.reason = "CPU fallback: " + ", ".join(fallbacks)
        else:
            self.native += 1

    def fail(self, i, reason):
        self.n += 1
        self.failed += 1
        if self.first_bad is None or self.reason is None or self.reason.startswith("CPU fallback"):
            if self.reason is None or self.reason.startswith("CPU fallback"):
                self.reason = f"sample {i}: {reason}"
            if self.first_bad is None:
                self.first_bad = i

    def record(self, skip_reason=None) -> dict:
        if skip_reason is not None or self.n == 0:
            status = "skip"
            reason = skip_reason or self.note or "no sample inputs"
        elif self.failed == 0:
            status = "native" if self.fallback == 0 else "fallback"
            reason = self.reason
        else:
            status = "fail" if self.failed == self.n else "partial"
            reason = self.reason
        return {"status": status, "reason": reason, "samples": self.n, "native": self.native,
                "fallback": self.fallback, "failed": self.failed, "first_bad": self.first_bad,
                "fallback_ops": sorted(self.fallback_ops), "host_syncs": self.host_syncs,
                "checked": sorted(self.checked)}


def _grad_targets(out):
    outs = [t for t in _tensors(out, [])
            if t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)]
    return outs


def check_op(key: str, dtype, max_samples: int | None = None, grad: bool = False) -> dict:
    """Run the samples of OpInfo ``key`` in ``dtype`` on CPU and tpu and compare.

    Returns {FORWARD: record} and, when ``grad`` (float32 only), also {BACKWARD: record}.
    A record: status ("native" | "fallback" | "partial" | "fail" | "skip"), reason, counts.
    """
    opinfo = op_db()[key]
    tol = tolerance(opinfo, dtype)
    fwd, bwd = _Acc(), _Acc()
    grad = grad and dtype is torch.float32 and supports_grad(opinfo)
    torch.manual_seed(0)
    try:
        samples = opinfo.sample_inputs("cpu", dtype, requires_grad=grad)
        samples = iter(samples)
    except Exception as e:  # noqa: BLE001
        why = "cannot make sample inputs: " + _first_line(e)
        res = {FORWARD: fwd.record(why)}
        if grad:
            res[BACKWARD] = bwd.record(why)
        return res
    i = -1
    while max_samples is None or i + 1 < max_samples:
        try:
            sample = next(samples)
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001
            fwd.fail(i + 1, "cannot make sample input: " + _first_line(e))
            break
        i += 1
        _one_sample(key, opinfo, sample, i, dtype, tol, fwd, bwd if grad else None)
    res = {FORWARD: fwd.record()}
    if grad:
        res[BACKWARD] = bwd.record()
    return res


def _one_sample(key, opinfo, sample, i, dtype, tol, fwd, bwd):
    why_random = _random_reason(key, sample)
    values = why_random is None
    check = "values" if values else f"shape+dtype ({why_random})"
    # the tpu copy first: the CPU run may mutate its inputs
    t_in, t_args, t_kwargs = _move_sample(sample, "tpu", key)
    c_in, c_args, c_kwargs = _move_sample(sample, "cpu")
    # CPU reference
    try:
        torch.manual_seed(i)
        c_out = opinfo(c_in, *c_args, **c_kwargs)
        c_cmp = sample.output_process_fn_grad(c_out)
    except Exception as e:  # noqa: BLE001
        # a sample CPU itself rejects is not a test of tpu
        fwd.note = "CPU rejects the samples: " + _first_line(e)
        if bwd is not None:
            bwd.note = fwd.note
        return
    want_grad = bwd is not None and bool(_grad_targets(c_cmp))
    if bwd is not None and not want_grad:
        bwd.note = "no differentiable output in the samples"
    c_grads = c_go = c_inputs = None
    if want_grad:
        c_inputs = [t for t in _tensors((c_in, c_args, c_kwargs), []) if t.requires_grad]
        c_outs = _grad_targets(c_cmp)
        gen = torch.Generator().manual_seed(1000 + i)
        c_go = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in c_outs]
        try:
            c_grads = torch.autograd.grad(c_outs, c_inputs, c_go, allow_unused=True)
        except Exception as e:  # noqa: BLE001
            bwd.note = "CPU backward fails: " + _first_line(e)
            want_grad = False
    c_cmp = _to_cpu(c_cmp)
    # tpu
    torch.tpu.reset_metrics()
    try:
        torch.manual_seed(i)
        t_out = opinfo(t_in, *t_args, **t_kwargs)
        t_cmp = sample.output_process_fn_grad(t_out)
        fb = _fallback_ops()
        syncs = _counter("host_syncs")
        _check_on_tpu(t_cmp)
        _compare(_to_cpu(t_cmp), c_cmp, tol, values)
    except Exception as e:  # noqa: BLE001
        fwd.fail(i, _first_line(e) if not isinstance(e, Mismatch) else "wrong result: " + str(e))
        if want_grad:
            bwd.fail(i, "forward failed")
        return
    fwd.checked.add(check)
    fwd.ok(i, fb, syncs)
    if not want_grad:
        return
    try:
        t_inputs = [t for t in _tensors((t_in, t_args, t_kwargs), []) if t.requires_grad]
        t_outs = _grad_targets(t_cmp)
        if len(t_outs) != len(c_go):
            raise Mismatch(f"{len(t_outs)} differentiable outputs, CPU has {len(c_go)}")
        t_go = [g.to("tpu") for g in c_go]
        torch.tpu.reset_metrics()
        t_grads = torch.autograd.grad(t_outs, t_inputs, t_go, allow_unused=True)
        fb = _fallback_ops()
        syncs = _counter("host_syncs")
        for j, (tg, cg) in enumerate(zip(t_grads, c_grads)):
            if (tg is None) != (cg is None):
                raise Mismatch(f"grad[{j}] is {'None' if tg is None else 'a tensor'} on tpu, "
                               f"{'None' if cg is None else 'a tensor'} on CPU")
            if tg is not None:
                _check_on_tpu(tg, f"grad[{j}]")
                _compare(_to_cpu(tg), cg, tol, values, f"grad[{j}]")
    except Exception as e:  # noqa: BLE001
        bwd.fail(i, _first_line(e) if not isinstance(e, Mismatch) else "wrong result: " + str(e))
        return
    bwd.checked.add(check)
    bwd.ok(i, fb, syncs)


def check_cases(key: str, mode: str = "full", max_samples: int | None = None) -> dict:
    """All records of one op in ``mode``: {(dtype name, kind): record}."""
    o = op_db()[key]
    if max_samples is None:
        max_samples = MODES[mode]["max_samples"]
    out = {}
    for d in forward_dtypes(o, mode):
        r = check_op(key, d, max_samples, grad=(d is torch.float32))
        out[(DTYPE_NAMES[d], FORWARD)] = r[FORWARD]
        if BACKWARD in r:
            out[(DTYPE_NAMES[d], BACKWARD)] = r[BACKWARD]
    if supports_grad(o) and ("float32", BACKWARD) not in out:
        r = check_op(key, torch.float32, max_samples, grad=True)
        out[("float32", BACKWARD)] = r[BACKWARD]
    return out


# ---------------------------------------------------------------------------------------------
# expected failures file

XFAIL_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "tests", "opinfo_expected_failures.txt")
DOC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "docs", "op_coverage.md")

_XFAIL_HEADER = """\
# Expected failures of tests/test_opinfo.py: (op, dtype, kind) that do not pass NATIVELY on "tpu".
# One entry a line:  op | dtype | kind | first failing sample | status: reason
# A CPU fallback is not a pass, so ops that only fall back are listed too (status "fallback").
# Every entry runs as a strict xfail: when it passes, the test fails until the line is removed,
# so this list only shrinks. Regenerate it from a full run (then review the diff):
#     python -m torchtpu.coverage --write-xfails
# The fast CI subset runs the first few samples only; an entry whose first failing sample is
# beyond them is expected to pass there.
"""


def load_xfails(path: str = XFAIL_PATH) -> dict:
    """{(op, dtype, kind): (first failing sample or None, reason)}."""
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split(" | ", 4)]
            if len(parts) != 5:
                raise ValueError(f"{path}:{n}: expected 'op | dtype | kind | sample | reason'")
            op, dt, kind, sample, reason = parts
            out[(op, dt, kind)] = (None if sample in ("-", "") else int(sample), reason)
    return out


def _one_line(s: str) -> str:
    return " ".join(str(s).split()).replace(" | ", " / ")


def write_xfails(results: dict, path: str = XFAIL_PATH) -> int:
    rows = []
    for key, recs in results.items():
        for (dt, kind), r in recs.items():
            if r["status"] in ("native", "skip"):
                continue
            sample = "-" if r.get("first_bad") is None else str(r["first_bad"])
            rows.append((key, dt, kind, sample, _one_line(f"{r['status']}: {r['reason']}")[:240]))
    rows.sort()
    w = [max([len(r[c]) for r in rows] + [1]) for c in range(3)]
    with open(path, "w") as f:
        f.write(_XFAIL_HEADER)
        for r in rows:
            f.write(f"{r[0]:<{w[0]}} | {r[1]:<{w[1]}} | {r[2]:<{w[2]}} | {r[3]} | {r[4]}\n")
    return len(rows)


# ---------------------------------------------------------------------------------------------
# the report


def _op_status(recs, kind, dtypes=None):
    rs = [r for (dt, k), r in recs.items() if k == kind and (dtypes is None or dt in dtypes)
          and r["status"] != "skip"]
    if not rs:
        return None
    st = {r["status"] for r in rs}
    if st == {"native"}:
        return "native"
    if st <= {"native", "fallback"}:
        return "fallback"
    if st == {"fail"}:
        return "fail"
    return "partial"


def summarize(results: dict) -> dict:
    s = {}
    for label, kind, dts in (("forward float32", FORWARD, ("float32",)),
                             ("forward all dtypes", FORWARD, None),
                             ("backward float32", BACKWARD, ("float32",))):
        c = collections.Counter()
        for key, recs in results.items():
            st = _op_status(recs, kind, dts)
            if st is not None:
                c[st] += 1
        s[label] = c
    return s


def _pct(a, b):
    return f"{100.0 * a / b:.1f}%" if b else "n/a"


def report(results: dict, meta: dict) -> str:
    db = op_db()
    summ = summarize(results)
    req_missing = []
    for key in REQUIRED:
        recs = results.get(key, {})
        for kind in (FORWARD, BACKWARD):
            r = recs.get(("float32", kind))
            if r is not None and r["status"] != "native":
                req_missing.append(f"{key} ({kind}: {r['status']})")
    na = {k: not_applicable(k, o) for k, o in db.items() if not_applicable(k, o)}
    L = []
    L.append("# Op coverage: PyTorch's OpInfo database on \"tpu\"\n")
    L.append("Generated by `python -m torchtpu.coverage` (do not edit by hand). "
             "Every OpInfo in `torch.testing._internal.common_methods_invocations.op_db` runs its "
             "sample inputs on CPU and on \"tpu\"; outputs (and float32 gradients, with random "
             "grad_outputs) are compared with the OpInfo's tolerances. **native**: every sample "
             "matched with no CPU fallback; **fallback**: every sample matched, some op fell back "
             "to CPU (correct, but not a pass); **partial**: some samples failed; **fail**: no "
             "sample passed. Random ops are checked for shape/dtype/device only.\n")
    L.append(f"- run: {meta.get('date', '?')}, torch {torch.__version__}, mode `{meta.get('mode')}` "
             f"(up to {meta.get('max_samples')} samples per op and dtype), "
             f"{meta.get('seconds', 0):.0f} s with {meta.get('jobs')} worker processes")
    if meta.get("note"):
        L.append(f"- note: {meta['note']}")
    L.append(f"- op_db: {len(db)} OpInfos; {len(na)} not applicable (listed at the end)\n")
    L.append("How to run:\n")
    L.append("- `python -m torchtpu.coverage` — this report (all ops, worker processes `-j N`, "
             "per-op timeout `--timeout S`; `--ops a,b` for a few ops; `--max-samples N` for "
             "more samples); `--write-xfails` also rewrites `tests/opinfo_expected_failures.txt` "
             "(review the diff before committing).")
    L.append("- `pytest tests/test_opinfo.py` — the fast CI subset (first sample, float32 + one "
             "other dtype per op; part of `make test`); `--opinfo=full` (or "
             "`TORCHTPU_OPINFO=full`) the same cases as this report, with the expected failures "
             "as strict xfails; `TORCHTPU_OPINFO_INPROCESS=1` runs the checks inside pytest "
             "for debugging.\n")
    L.append("## Summary (ops)\n")
    L.append("| | ops | native | fallback | partial | fail | native % |")
    L.append("|---|---|---|---|---|---|---|")
    for label, c in summ.items():
        tot = sum(c.values())
        L.append(f"| {label} | {tot} | {c['native']} | {c['fallback']} | {c['partial']} | "
                 f"{c['fail']} | {_pct(c['native'], tot)} |")
    f32 = summ["forward float32"]
    b32 = summ["backward float32"]
    L.append("")
    L.append(f"Targets: forward float32 native >= 90%: **{_pct(f32['native'], sum(f32.values()))}**; "
             f"gradients native >= 85%: **{_pct(b32['native'], sum(b32.values()))}**; "
             f"ops of the device issue ({len(REQUIRED)}): "
             + ("**all native**" if not req_missing else
                f"**{len(req_missing)} not native**: " + ", ".join(req_missing)) + "\n")
    per_dtype = collections.defaultdict(collections.Counter)
    syncs = []
    fb_ops = collections.Counter()
    for key, recs in results.items():
        for (dt, kind), r in recs.items():
            per_dtype[(dt, kind)][r["status"]] += 1
            if r.get("host_syncs") and kind == FORWARD and dt == "float32" \
                    and r["status"] == "native":
                syncs.append((key, r["host_syncs"], r["samples"]))
            for f in r.get("fallback_ops", ()):
                fb_ops[f] += 1
    L.append("## By dtype (op, dtype) cases\n")
    L.append("| dtype | kind | native | fallback | partial | fail | skipped |")
    L.append("|---|---|---|---|---|---|---|")
    for (dt, kind), c in sorted(per_dtype.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        L.append(f"| {dt} | {kind} | {c['native']} | {c['fallback']} | {c['partial']} | "
                 f"{c['fail']} | {c['skip']} |")
    L.append("")
    if fb_ops:
        L.append("## Most frequent CPU fallbacks (aten op: number of (op, dtype, kind) cases)\n")
        L.append(", ".join(f"`{k}` {v}" for k, v in fb_ops.most_common(40)) + "\n")
    L.append("## Host syncs of natively passing ops (data-dependent shapes), float32 forward\n")
    L.append(", ".join(f"`{k}` {n}/{s} samples" for k, n, s in sorted(syncs)) or "none")
    L.append("")
    L.append("## Per op\n")
    L.append("Status per (dtype, kind); reason of the first failure (or the fallback ops).\n")
    L.append("| op | f32 fwd | f32 bwd | bf16 | int64 | bool | first problem |")
    L.append("|---|---|---|---|---|---|---|")
    for key in sorted(db):
        if key in na:
            continue
        recs = results.get(key)
        if recs is None:
            L.append(f"| `{key}` | not run | | | | | |")
            continue

        def st(dt, kind):
            r = recs.get((dt, kind))
            return "" if r is None else r["status"]

        prob = next((r["reason"] for (dt, kind), r in sorted(recs.items())
                     if r["status"] not in ("native",) and r.get("reason")), "")
        prob = _one_line(prob).replace("|", "/")[:160]
        L.append(f"| `{key}` | {st('float32', FORWARD)} | {st('float32', BACKWARD)} | "
                 f"{st('bfloat16', FORWARD)} | {st('int64', FORWARD)} | {st('bool', FORWARD)} | "
                 f"{prob} |")
    L.append("")
    L.append("## Not applicable\n")
    for k, why in na.items():
        L.append(f"- `{k}`: {why}")
    L.append("")
    L.append("## Checked for shape, dtype and device only\n")
    for k, why in sorted({**RANDOM, **UNDEFINED}.items()):
        L.append(f"- `{k}`: {why}")
    for k, (why, _) in sorted(RANDOM_IF.items()):
        L.append(f"- `{k}`: {why} (other samples compare values)")
    L.append("")
    return "\n".join(L)


def print_table(results: dict) -> None:
    summ = summarize(results)
    print(f"{'':22} {'ops':>5} {'native':>7} {'fallbk':>7} {'partial':>7} {'fail':>5} {'native%':>8}")
    for label, c in summ.items():
        tot = sum(c.values())
        print(f"{label:22} {tot:5d} {c['native']:7d} {c['fallback']:7d} {c['partial']:7d} "
              f"{c['fail']:5d} {_pct(c['native'], tot):>8}")


# ---------------------------------------------------------------------------------------------
# worker processes


def _worker(mode: str, max_samples: int | None) -> None:
    """Read op keys on stdin, answer one JSON line per op on the original stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the ops print goes to stderr
    warnings.simplefilter("ignore")
    op_db()
    proto.write("READY\n")
    for line in sys.stdin:
        key = line.strip()
        if not key:
            continue
        t0 = time.time()
        try:
            recs = check_cases(key, mode, max_samples)
            out = {f"{dt}|{kind}": r for (dt, kind), r in recs.items()}
            err = None
        except BaseException as e:  # noqa: BLE001
            out, err = {}, _first_line(e) + "\n" + traceback.format_exc()[-2000:]
        proto.write(json.dumps({"key": key, "recs": out, "error": err,
                                "seconds": time.time() - t0}) + "\n")


def _crash_records(key, mode, why):
    o = op_db()[key]
    recs = {}
    for d in forward_dtypes(o, mode):
        recs[(DTYPE_NAMES[d], FORWARD)] = _Acc().record()
        recs[(DTYPE_NAMES[d], FORWARD)].update(status="fail", reason=why, first_bad=0)
    if supports_grad(o):
        recs[("float32", BACKWARD)] = dict(recs.get(("float32", FORWARD)) or _Acc().record())
        recs[("float32", BACKWARD)].update(status="fail", reason=why, first_bad=0)
    return recs


OP_SECONDS: dict = {}


def run_all(keys, mode="full", jobs=2, timeout=DEFAULT_TIMEOUT_S, max_samples=None,
            verbose=False) -> dict:
    """Run ``keys`` in ``jobs`` worker processes; an op that crashes or hangs its worker is
    recorded as failing and the worker is replaced."""
    import queue as _queue

    todo: _queue.Queue = _queue.Queue()
    for k in keys:
        todo.put(k)
    results: dict = {}
    lock = threading.Lock()
    total = len(keys)
    t_start = time.time()
    cmd = [sys.executable, "-m", "torchtpu.coverage", "--worker", "--mode", mode]
    if max_samples is not None:
        cmd += ["--max-samples", str(max_samples)]

    def spawn():
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=None if verbose else subprocess.DEVNULL, text=True,
                             bufsize=1)
        line = _readline(p, 600)
        if line is None or line.strip() != "READY":
            p.kill()
            raise RuntimeError("coverage worker failed to start")
        return p

    def _readline(p, t):
        r, _, _ = select.select([p.stdout], [], [], t)
        if not r:
            return None
        line = p.stdout.readline()
        return line or None

    def manage():
        p = None
        while True:
            try:
                key = todo.get_nowait()
            except _queue.Empty:
                break
            if p is None or p.poll() is not None:
                p = spawn()
            t0 = time.time()
            try:
                p.stdin.write(key + "\n")
                p.stdin.flush()
                line = _readline(p, timeout)
            except (BrokenPipeError, OSError):
                line = None
            if line is None:
                why = ("timed out after %d s" % timeout) if p.poll() is None else \
                    f"worker crashed (exit code {p.returncode})"
                if p.poll() is None:
                    p.kill()
                p.wait()
                p = None
                recs = _crash_records(key, mode, why)
            else:
                msg = json.loads(line)
                if msg["error"]:
                    recs = _crash_records(key, mode, "harness error: " + msg["error"].splitlines()[0])
                    if verbose:
                        print(msg["error"], file=sys.stderr)
                else:
                    recs = {tuple(k.split("|")): r for k, r in msg["recs"].items()}
            with lock:
                results[key] = recs
                OP_SECONDS[key] = round(time.time() - t0, 2)
                n = len(results)
                if verbose or n % 25 == 0 or n == total:
                    st = ",".join(f"{dt[:4]}/{k[0]}={r['status']}" for (dt, k), r in recs.items())
                    print(f"[{n}/{total} {time.time() - t_start:.0f}s] {key} "
                          f"({time.time() - t0:.1f}s) {st}", file=sys.stderr, flush=True)
        if p is not None:
            p.stdin.close()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    threads = [threading.Thread(target=manage, daemon=True) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    db = op_db()
    return {k: results[k] for k in db if k in results}


def _save_json(results, meta, path):
    data = {"meta": meta, "results": {k: {f"{dt}|{kind}": r for (dt, kind), r in recs.items()}
                                      for k, recs in results.items()}}
    with open(path, "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)


def _load_json(path):
    with open(path) as f:
        data = json.load(f)
    res = {k: {tuple(x.split("|")): r for x, r in recs.items()} for k, recs in data["results"].items()}
    return res, data["meta"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torchtpu.coverage", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="full")
    ap.add_argument("--max-samples", type=int, default=None,
                    help="samples per (op, dtype); default: the mode's")
    ap.add_argument("--jobs", "-j", type=int, default=2, help="worker processes")
    ap.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_S, help="seconds per op")
    ap.add_argument("--ops", default=None, help="comma-separated op keys (default: all of op_db)")
    ap.add_argument("--doc", default=DOC_PATH, help="markdown report to write ('' for none)")
    ap.add_argument("--json", default=os.path.join("/tmp", "torchtpu_op_coverage.json"),
                    help="raw results to write")
    ap.add_argument("--from-json", default=None, help="report on saved results instead of running")
    ap.add_argument("--write-xfails", action="store_true",
                    help="regenerate tests/opinfo_expected_failures.txt from this run")
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a.mode, a.max_samples)
        return 0
    warnings.simplefilter("ignore")
    db = op_db()
    if a.from_json:
        results, meta = _load_json(a.from_json)
    else:
        keys = [k for k, o in db.items() if not not_applicable(k, o)]
        if a.ops:
            want = a.ops.split(",")
            bad = [k for k in want if k not in db]
            if bad:
                ap.error(f"unknown OpInfo(s): {', '.join(bad)}")
            keys = [k for k in keys if k in want]
        t0 = time.time()
        results = run_all(keys, a.mode, a.jobs, a.timeout, a.max_samples, a.verbose)
        meta = {"mode": a.mode, "jobs": a.jobs, "seconds": time.time() - t0,
                "max_samples": a.max_samples or MODES[a.mode]["max_samples"],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "ops": "all" if not a.ops else a.ops, "op_seconds": OP_SECONDS}
        if a.json:
            _save_json(results, meta, a.json)
    print_table(results)
    if a.doc and (a.from_json or not a.ops):
        with open(a.doc, "w") as f:
            f.write(report(results, meta))
        print(f"wrote {a.doc}")
    if a.write_xfails:
        if a.ops or (meta.get("mode") != "full") or (meta.get("max_samples") != MODES["full"]["max_samples"]):
            ap.error("--write-xfails needs a full run over all ops (no --ops, --mode full, "
                     "default --max-samples)")
        n = write_xfails(results)
        print(f"wrote {XFAIL_PATH} ({n} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
