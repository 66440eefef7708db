"""Attention on DTensors and context parallelism on "tpu" (backend "tpu_dist").

PyTorch's own test Transformer, parallelized by its own plan with the attention inputs left as
DTensors (``local_output_for_attn=False``), trains on ranks of 127.0.0.1 equal to one CPU
process: SDPA on "tpu" reaches ``_scaled_dot_product_fused_attention_overrideable``, which had
no DTensor sharding strategy ("does not have a sharding strategy registered"); its strategies
and the context-parallel ring are in torchtpu/distributed/attention.py
(tests/dist_scripts/attention_dtensor_check.py holds the checks). The default test runs tensor
parallel, sequence parallel, splash_sdpa under TP and context parallelism in one launch; the
4-rank FSDP x TP run and Fused mode are slow.
"""
from __future__ import annotations

import pytest

from dist_launch import ok as _ok
from dist_launch import torchrun as _torchrun


def test_attention_on_dtensors_tp_sp_splash_and_context_parallel():
    _ok(*_torchrun("attention_dtensor_check.py", "tp", "sp", "splash", "cp", timeout=700))


@pytest.mark.slow
def test_attention_on_dtensors_fused():
    _ok(*_torchrun("attention_dtensor_check.py", "--mode", "fused", "tp", "sp", "cp",
                   timeout=900))


@pytest.mark.slow
def test_attention_on_dtensors_fsdp_x_tp_4_ranks():
    """2-D: the sequence-parallel plan on mesh["tp"], fully_shard on mesh["dp"] of a (2, 2)
    mesh, 4 processes, each dp rank on its slice of the batch."""
    _ok(*_torchrun("attention_dtensor_check.py", "fsdp_tp", nproc=4, timeout=1200))


@pytest.mark.slow
def test_torchtitan_context_parallel_two_ranks_matches_one(tmp_path):
    """TorchTitan's ``--parallelism.context_parallel_degree 2`` on 2 ranks of "tpu": the
    llama3 debug model (FlexAttention with TorchTitan's block-causal mask; CP all-gathers K/V
    and shards the BlockMask with its load balancer, so the lowered flex_attention HOP sees
    Q_LEN != KV_LEN and a mask_mod remapping query positions) trains 3 steps with the same
    losses and gradient norms as one rank. Flex CP needs the sequence to divide into
    2 * world * 128-token blocks: seq_len 256."""
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed (pip install -e .[test])")
    from test_torchtitan import _compare, _train

    seq = ("--training.seq_len", "256")
    one = _train(tmp_path, "tpu", 1, 1500, *seq)
    cp = _train(tmp_path, "tpu", 2, 1800, *seq, "--parallelism.context_parallel_degree", "2",
                "--parallelism.data_parallel_shard_degree", "1",
                "--parallelism.spmd_backend", "partial_dtensor")
    _compare(cp, one)
