"""Pipeline parallelism (``torch.distributed.pipelining``) on "tpu" with tpu_dist: every
schedule PyTorch 2.13 ships, losses and gradients equal to one process running the whole model
on CPU (tests/dist_scripts/pipeline_check.py), and ranks whose send/recv disagree (MPMD
programs out of step) getting a clear error on both ranks instead of a hang or an abort."""
from __future__ import annotations

import pytest

from dist_launch import ok, torchrun

ALL = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
       "ZBVZeroBubble", "DualPipeV"]


def test_pipeline_schedules_two_ranks():
    """2 ranks: GPipe and 1F1B (2 stages), Interleaved1F1B (4 stages: more stages than
    ranks), DualPipeV (a V of 4 stages, zero-bubble split backward); then mismatched
    send/recv (a stage of another width; both ranks receiving)."""
    ok(*torchrun("pipeline_check.py", "GPipe", "1F1B", "Interleaved1F1B", "DualPipeV",
                 "mismatch", "--timeout", "120", timeout=400))


@pytest.mark.slow
def test_pipeline_every_schedule_two_ranks():
    """Every schedule, 2 ranks; the looped ones with 3 stages per rank."""
    ok(*torchrun("pipeline_check.py", *ALL, "--stages-per-rank", "3", "--timeout", "200",
                 timeout=600))


@pytest.mark.slow
def test_pipeline_four_ranks():
    """4 ranks, every schedule: GPipe and 1F1B (4 stages), the looped ones (8 stages: a rank
    waits on a peer that waits on a third; sends complete when buffered, as NCCL's do),
    ZBVZeroBubble and DualPipeV (a V of 8 stages)."""
    ok(*torchrun("pipeline_check.py", *ALL, "--timeout", "300", nproc=4, timeout=900))


@pytest.mark.slow
def test_pipeline_compiled_stages_two_ranks():
    """Stages compiled with torch.compile(backend="tpu") (the schedules without a split
    backward: PyTorch refuses torch.compile'd stages for the zero-bubble ones)."""
    ok(*torchrun("pipeline_check.py", "--compile", "GPipe", "1F1B", "Interleaved1F1B",
                 "LoopedBFS", "--timeout", "300", timeout=900))


def test_mpmd_check_two_ranks():
    """Ranks whose programs' collectives differ (eager: another shape, another collective of
    the same bytes; compiled: another shape) get a RuntimeError naming both ranks' programs on
    both ranks within seconds, not a hang, and the group goes on; different programs whose
    collectives agree (compiled on one rank, eager on the other) run; send/recv past the c10d
    store's 8 MiB message limit (which killed the job) go over a direct connection
    (tests/dist_scripts/mpmd_check.py)."""
    ok(*torchrun("mpmd_check.py", timeout=300))


def test_mpmd_abort_two_ranks():
    """A new program on one rank while the other re-runs a checked one (blocked in the
    transport): both ranks raise within seconds naming both programs, not only the new
    program's rank; later collectives raise a clear error (tests/dist_scripts/mpmd_check.py
    abort)."""
    ok(*torchrun("mpmd_check.py", "abort", timeout=300))


@pytest.mark.slow
def test_mpmd_abort_three_ranks():
    """The same with 3 ranks: rank 0 runs a new program while ranks 1 and 2 re-run a checked
    one; every rank raises within seconds and every member's collectives are aborted."""
    ok(*torchrun("mpmd_check.py", "abort", nproc=3, timeout=300))
