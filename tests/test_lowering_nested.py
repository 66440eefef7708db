"""Jagged <-> padded dense lowerings (torchtpu/lowering/nested.py) against PyTorch on CPU:
``_jagged_to_padded_dense_forward`` and ``_padded_dense_to_jagged_forward`` (VeRL's no-padding
path, ``torch.nested`` jagged tensors' ``to_padded_tensor`` and its backward) run on the device
with no CPU fallback, in every executor, and raise CPU's exception type for offsets that do not
fit."""
from __future__ import annotations

import pytest
import torch

from torchtpu.runtime.metrics import COUNTERS

aten = torch.ops.aten
DEV = "tpu"


def _run(fn, *args, tol=0.0):
    """fn on CPU and on tpu (args moved); no CPU fallback; results equal (exactly: the ops only
    move data; ``tol`` where arithmetic surrounds them)."""
    expected = fn(*args)
    moved = [[a.to(DEV) for a in x] if isinstance(x, list) and x and isinstance(x[0], torch.Tensor)
             else (x.to(DEV) if isinstance(x, torch.Tensor) else x) for x in args]
    before = COUNTERS.get("cpu_fallbacks", 0)
    got = fn(*moved)
    assert COUNTERS.get("cpu_fallbacks", 0) == before, "fell back to CPU"
    assert got.device.type == DEV
    got = got.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.shape, expected.shape)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol, equal_nan=True)
    return got


V = torch.randn(9, 3)
OFFSETS = {
    "plain": torch.tensor([0, 2, 2, 6]),          # an empty row
    "truncated": torch.tensor([0, 5, 6, 9]),       # a row longer than max_length
    "not_from_0": torch.tensor([1, 3, 4]),         # rows start past values[0]
    "int32": torch.tensor([0, 3, 7, 9], dtype=torch.int32),
    "end_past_values": torch.tensor([0, 2, 2, 12]),  # only min(len, S) rows are read
}


@pytest.mark.parametrize("name", list(OFFSETS))
@pytest.mark.parametrize("max_len", [0, 1, 3, 7])
def test_jagged_to_padded(name, max_len):
    off = OFFSETS[name]
    _run(lambda v, o: aten._jagged_to_padded_dense_forward(v, o, [max_len], -1.5), V, [off])


@pytest.mark.parametrize("values", [
    torch.randn(9), torch.randn(9, 2, 3), torch.arange(18).reshape(9, 2),
    (torch.arange(9) % 2).bool(), torch.randn(9, 4).to(torch.bfloat16)],
    ids=["1d", "3d", "int64", "bool", "bf16"])
def test_jagged_to_padded_dtypes_and_ranks(values):
    pad = 2.5  # cast to the values' dtype as CPU's fill does (2 for ints, True for bool)
    _run(lambda v, o: aten._jagged_to_padded_dense_forward(v, o, [4], pad), values,
         [OFFSETS["plain"]])


def test_jagged_to_padded_special_padding():
    _run(lambda v, o: aten._jagged_to_padded_dense_forward(v, o, [4], float("-inf")), V.half(),
         [OFFSETS["plain"]])


@pytest.mark.parametrize("offsets,total", [
    (torch.tensor([0, 2, 2, 5]), 5), (torch.tensor([1, 3, 4]), 4),
    (torch.tensor([0, 3, 3, 6], dtype=torch.int32), 6), (torch.tensor([0, 0, 0, 0]), 0)])
@pytest.mark.parametrize("tail", [(), (2,), (2, 3)])
def test_padded_to_jagged(offsets, total, tail):
    dense = torch.randn(offsets.numel() - 1 + 1, 3, *tail)  # one more padded row than offsets use
    first = int(offsets[0])  # CPU leaves the rows before offsets[0] uninitialised (tpu: zeros)
    _run(lambda d, o: aten._padded_dense_to_jagged_forward(d, o, total)[first:], dense, [offsets])


def test_padded_to_jagged_without_total_reads_it_from_the_offsets():
    dense = torch.randn(3, 4, 2)
    off = torch.tensor([0, 3, 3, 7])
    syncs = COUNTERS.get("host_syncs", 0)
    _run(lambda d, o: aten._padded_dense_to_jagged_forward(d, o), dense, [off])
    assert COUNTERS.get("host_syncs", 0) > syncs  # a data-dependent length: one host sync


def test_round_trip_and_autograd_match_cpu():
    off = torch.tensor([0, 4, 5, 9])
    w = torch.randn(9, 3)

    def fn(values, o):
        values = values.detach().requires_grad_(True)
        # the ops have no derivatives of their own: jagged tensors' autograd uses one for the other
        dense = torch.nested.nested_tensor_from_jagged(values, o, max_seqlen=4).to_padded_tensor(0.0)
        (dense.sin() * w[:4].to(values.device)).sum().backward()  # backward: dense -> jagged
        back = aten._padded_dense_to_jagged_forward(dense.detach() * 2, [o], values.shape[0])
        return torch.stack([back, values.grad])

    _run(fn, V, off, tol=1e-6)  # cos in the gradient: float32 rounding


def test_nested_jagged_tensor_to_padded_and_back():
    values = torch.randn(9, 4)
    off = torch.tensor([0, 2, 7, 9])

    def fn(v, o):
        nt = torch.nested.nested_tensor_from_jagged(v, o)
        padded = nt.to_padded_tensor(0.0)
        again = torch.nested.narrow(padded, 1, torch.zeros_like(o[:-1]), o.diff(), layout=torch.jagged)
        return torch.cat([padded.reshape(-1), again.values().reshape(-1) if again.is_nested
                          else again.reshape(-1)])

    _run(fn, values, off)


@pytest.mark.parametrize("mode", ["DEFER_AND_FUSE", "DEFER_NEVER_AND_LAUNCH_BLOCKING"])
def test_other_eager_modes(mode):
    off = torch.tensor([0, 2, 2, 6])
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        _run(lambda v, o: aten._padded_dense_to_jagged_forward(
            aten._jagged_to_padded_dense_forward(v, o, [4], 0.0) + 1, o, 6), V[:6], [off])


def test_compiled_graph():
    off = torch.tensor([0, 2, 2, 6])

    def f(v, o):
        return aten._jagged_to_padded_dense_forward(v * 2, [o], [4], 0.0).sum(1)

    expected = f(V, off)
    before = COUNTERS.get("compile_cpu_fallbacks", 0)
    got = torch.compile(f, backend="tpu", fullgraph=True)(V.to(DEV), off.to(DEV))
    assert COUNTERS.get("compile_cpu_fallbacks", 0) == before
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


BAD = [
    ("to_padded_decreasing", lambda v, o: aten._jagged_to_padded_dense_forward(v, [o], [3], 0.0),
     [0, 2, 1, 6]),
    ("to_padded_negative_start",
     lambda v, o: aten._jagged_to_padded_dense_forward(v, [o], [3], 0.0), [-1, 2, 2, 6]),
    ("to_jagged_row_too_long",
     lambda v, o: aten._padded_dense_to_jagged_forward(v.reshape(3, 3, 1), [o], 5), [0, 4, 4, 5]),
    ("to_jagged_total_mismatch",
     lambda v, o: aten._padded_dense_to_jagged_forward(v.reshape(3, 3, 1), [o], 8), [0, 2, 2, 5]),
    ("to_jagged_decreasing",
     lambda v, o: aten._padded_dense_to_jagged_forward(v.reshape(3, 3, 1), [o], 4), [0, 2, 1, 4]),
]


@pytest.mark.parametrize("name,op,off", BAD, ids=[b[0] for b in BAD])
def test_offsets_that_do_not_fit_raise_like_cpu(name, op, off):
    v = torch.randn(9, 1)
    with pytest.raises(RuntimeError):
        op(v, torch.tensor(off))
    out = op(v.to(DEV), torch.tensor(off, device=DEV))  # asynchronous: raised at the next sync
    with pytest.raises(RuntimeError, match=f"{name.split('_')[0]}.*on device tpu"):
        out.sum().item()
