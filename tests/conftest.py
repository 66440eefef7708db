"""Shared pytest configuration.

Options (also settable by environment variable):
  --opinfo=fast|full   (TORCHTPU_OPINFO)   tests/test_opinfo.py: the fast CI subset (default;
                       the first samples of float32 + one other dtype per op) or the full run.
  --opinfo-timeout=S   (TORCHTPU_OPINFO_TIMEOUT) per-test time limit of tests/test_opinfo.py.
  --runslow            (TORCHTPU_SLOW_TESTS=1) also run tests marked ``slow`` (minutes each:
                       e.g. the two real servers of tests/test_serve.py); skipped otherwise.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

import pytest


def pytest_addoption(parser):
    parser.addoption("--opinfo", default=os.environ.get("TORCHTPU_OPINFO", "fast"),
                     choices=("fast", "full"), help="OpInfo test subset (tests/test_opinfo.py)")
    parser.addoption("--opinfo-timeout", type=int,
                     default=int(os.environ.get("TORCHTPU_OPINFO_TIMEOUT", "300")),
                     help="seconds per OpInfo test before it fails as timed out")
    parser.addoption("--runslow", action="store_true",
                     default=os.environ.get("TORCHTPU_SLOW_TESTS", "") not in ("", "0"),
                     help="also run tests marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes minutes; run with --runslow")
    # test_opinfo.py reads the mode while it collects (parametrisation depends on it)
    os.environ["TORCHTPU_OPINFO"] = config.getoption("--opinfo")
    # The suite's compiles go to a fresh persistent cache, not the user's: a run neither depends
    # on nor pollutes what earlier runs left (tests of the cache itself use their own folders).
    if "TORCHTPU_CACHE_DIR" not in os.environ:
        _session_cache.append(tempfile.mkdtemp(prefix="torchtpu-test-cache-"))
        os.environ["TORCHTPU_CACHE_DIR"] = _session_cache[0]


_session_cache: list = []


def pytest_runtest_setup(item):
    # programs an earlier test's growing shapes guessed may still be building on background
    # threads (runtime/prefetch.py); they must not move this test's counters
    prefetch = sys.modules.get("torchtpu.runtime.prefetch")
    if prefetch is not None:
        prefetch.drain()


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or TORCHTPU_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    for d in _session_cache:
        shutil.rmtree(d, ignore_errors=True)


class OpTimeout(Exception):
    pass


@pytest.fixture
def op_timeout(request):
    """Fail (not hang) a test that runs longer than --opinfo-timeout (main thread, POSIX)."""
    seconds = request.config.getoption("--opinfo-timeout")
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise OpTimeout(f"timed out after {seconds} s (--opinfo-timeout)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
