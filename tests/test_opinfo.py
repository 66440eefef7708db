"""PyTorch's OpInfo database (op_db) on "tpu", compared with CPU.

One test per (op, dtype, kind): forward in float32, bfloat16, int64 and bool (where the op
supports the dtype on CPU), and gradients of a float32 backward where the op supports autograd.
The checks themselves live in torchtpu/coverage.py (shared with ``python -m torchtpu.coverage``).

A test passes only when every sample matches CPU with no CPU fallback (a fallback is correct but
is not a pass). Known failures are listed, with reasons, in tests/opinfo_expected_failures.txt;
each runs as a strict xfail: when one starts passing the test fails until its line is removed
(except "host:" entries, whose CPU reference rounds differently on different host CPUs).

Subsets (--opinfo / TORCHTPU_OPINFO): "fast" (default, for CI: the first
``MODES['fast']['max_samples']`` samples, float32 + one other dtype per op) or "full" (the same
samples as ``python -m torchtpu.coverage``).
"""
from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

from torchtpu import coverage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MODE = os.environ.get("TORCHTPU_OPINFO", "fast")
MAX_SAMPLES = coverage.MODES[MODE]["max_samples"]
XFAILS = coverage.load_xfails(os.environ.get("TORCHTPU_OPINFO_XFAILS", coverage.XFAIL_PATH))

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    CASES = coverage.cases(MODE)

JOBS = int(os.environ.get("TORCHTPU_OPINFO_JOBS", "2"))
# TORCHTPU_OPINFO_INPROCESS=1: run the checks inside pytest (for debugging with pdb/prints)
# instead of in worker processes (which survive crashes and hangs of single ops).
INPROCESS = os.environ.get("TORCHTPU_OPINFO_INPROCESS", "0") not in ("", "0")
_RESULTS: dict = {}
_CACHE: dict = {}


def _selected_keys(session):
    keys = set()
    for item in session.items:
        cs = getattr(item, "callspec", None)
        if cs is not None and item.module.__name__ == __name__ and "key" in cs.params:
            keys.add(cs.params["key"])
    return [k for k in coverage.op_db() if k in keys]


def _record(request, key: str, dtype: str, kind: str) -> dict:
    """The record of (op, dtype, kind). By default every selected op runs once, up front, in
    TORCHTPU_OPINFO_JOBS worker processes (coverage.run_all: an op that crashes or hangs is
    recorded as failing); in-process, float32 forward and backward share one run."""
    if not INPROCESS:
        if key not in _RESULTS:
            keys = [k for k in _selected_keys(request.session) if k not in _RESULTS] or [key]
            timeout = request.config.getoption("--opinfo-timeout")
            _RESULTS.update(coverage.run_all(keys, MODE, jobs=JOBS, timeout=timeout))
        rec = _RESULTS[key].get((dtype, kind))
        assert rec is not None, f"{key}: no record for {dtype} {kind}"
        return rec
    request.getfixturevalue("op_timeout")  # in-process: a per-test time limit (SIGALRM)
    ck = (key, dtype)
    if ck not in _CACHE:
        _CACHE.clear()  # tests of one op run consecutively: keep only the current op
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CACHE[ck] = coverage.check_op(key, coverage.NAME_DTYPES[dtype], MAX_SAMPLES,
                                           grad=(dtype == "float32"))
    return _CACHE[ck][kind]


def _expected_to_fail(key, dtype, kind):
    xf = XFAILS.get((key, dtype, kind))
    if xf is None:
        return None
    first_bad, reason = xf
    if first_bad is not None and first_bad >= MAX_SAMPLES:
        return None  # fails only in samples this subset does not run
    return reason


@pytest.mark.parametrize("key,dtype,kind", CASES, ids=["-".join(c) for c in CASES])
def test_opinfo(key, dtype, kind, request):
    rec = _record(request, key, dtype, kind)
    expected = _expected_to_fail(key, dtype, kind)
    if rec["status"] == "skip":
        pytest.skip(f"{key} {dtype} {kind}: {rec['reason']}")
    if rec["status"] == "native":
        # "host:" entries differ from PyTorch CPU by a rounding that depends on the host CPU
        # (e.g. oneDNN's bfloat16 convolution): expected to fail on some hosts, may pass on others
        if expected is not None and not expected.startswith("host:"):
            pytest.fail(f"{key} | {dtype} | {kind} now passes natively: remove its line from "
                        "tests/opinfo_expected_failures.txt", pytrace=False)
        return
    msg = f"{rec['status']}: {rec['reason']} ({rec['failed']} failed, {rec['fallback']} fell " \
          f"back, of {rec['samples']} samples)"
    if expected is not None:
        pytest.xfail(msg)
    pytest.fail(msg, pytrace=False)


REQUIRED_CASES = []
for _key in coverage.REQUIRED:
    REQUIRED_CASES.append((_key, "forward"))
    _o = coverage.op_db().get(_key)
    if _o is None or coverage.supports_grad(_o):
        REQUIRED_CASES.append((_key, "backward"))


@pytest.mark.parametrize("key,kind", REQUIRED_CASES, ids=["-".join(c) for c in REQUIRED_CASES])
def test_device_issue_op(key, kind, request):
    """The ops the "tpu" device issue names must pass natively in float32: no expected failures."""
    assert key in coverage.op_db(), f"{key} is not an OpInfo in op_db (stale REQUIRED list)"
    rec = _record(request, key, "float32", kind)
    assert rec["status"] == "native", f"{key} float32 {kind}: {rec['status']}: {rec['reason']}"


def _newer_torch_only(reason: str) -> bool:
    """A reason starting "torch>=X.Y:" marks an entry for an op that torch X.Y added."""
    m = re.match(r"\w+: torch>=(\d+)\.(\d+):", reason)
    return bool(m) and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (
        int(m.group(1)), int(m.group(2)))


def test_expected_failures_file_is_valid():
    """Every entry names a real (op, dtype, kind) case; the file is sorted, without duplicates."""
    db = coverage.op_db()
    full = set(coverage.cases("full"))
    rows = []
    with open(coverage.XFAIL_PATH) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                rows.append(tuple(p.strip() for p in line.split(" | ", 4)))
    keys = [r[:3] for r in rows]
    assert len(keys) == len(set(keys)), "duplicate entries"
    assert keys == sorted(keys), "entries are not sorted (regenerate with --write-xfails)"
    for op, dt, kind, sample, reason in rows:
        if op not in db and _newer_torch_only(reason):
            continue  # an OpInfo that a later torch adds: checked when the suite runs there
        assert op in db, f"{op}: not an OpInfo in op_db"
        assert (op, dt, kind) in full, f"{op} | {dt} | {kind}: not a case the OpInfo run checks"
        assert sample == "-" or sample.isdigit(), f"{op}: bad sample index {sample!r}"
        assert reason, f"{op} | {dt} | {kind}: no reason given"
