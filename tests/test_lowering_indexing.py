"""Shape, view and indexing lowerings (torchtpu/lowering/shape.py, indexing.py) against PyTorch
on CPU, through the tpu device, checking that each op ran on the device (no CPU fallback).
View-op lowerings (graph-only: eager binds PyTorch's metadata kernels) are checked directly."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchtpu.lowering import registry
from torchtpu.runtime.metrics import COUNTERS

aten = torch.ops.aten
DEV = "tpu"


def _to(x, dev):
    if isinstance(x, torch.Tensor):
        return x.clone() if dev == "cpu_clone" else x.to(dev)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(e, dev) for e in x)
    return x


from helpers import flat as _flat  # noqa: E402


def check(fn, *args, syncs=None, **kwargs):
    """fn on CPU vs on tpu: same dtype, shape and values; no CPU fallback."""
    expected = fn(*_to(args, "cpu_clone"), **_to(kwargs, "cpu_clone"))  # fn may write its inputs
    before_fb = COUNTERS.get("cpu_fallbacks", 0)
    before_sync = COUNTERS.get("host_syncs", 0)
    got = fn(*_to(args, DEV), **_to(kwargs, DEV))
    assert COUNTERS.get("cpu_fallbacks", 0) == before_fb, "op fell back to CPU"
    if syncs is not None:
        assert COUNTERS.get("host_syncs", 0) - before_sync == syncs
    for e, g in zip(_flat(expected), _flat(got), strict=True):
        if not isinstance(e, torch.Tensor):
            assert e == g
            continue
        assert g.device.type == DEV
        g = g.cpu()
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, e.dtype, g.shape, e.shape)
        torch.testing.assert_close(g, e, equal_nan=True, rtol=1e-6, atol=1e-6)


torch.manual_seed(0)
X = torch.randn(3, 4, 5)
I = torch.arange(12).reshape(3, 4)


# ---- shape / copy ops ----

SHAPE_CASES = {
    "cat": (torch.cat, ([X, X], 1)),
    "cat_promote_and_legacy_empty": (torch.cat, ([torch.empty(0), I.float(), I], 0)),
    "cat_bool_int": (torch.cat, ([I > 3, I], 1)),
    "stack": (torch.stack, ([X, X * 2], -1)),
    "clone": (torch.clone, (X,)),
    "flip": (torch.flip, (X, (0, 2))),
    "roll_flat": (torch.roll, (X, 7)),
    "roll_dims": (torch.roll, (X, (1, -2), (0, 2))),
    "repeat": (lambda a: a.repeat(2, 1, 1, 3), (X,)),
    "constant_pad_neg": (lambda a: F.pad(a, (1, 2, -1, 3), value=2.5), (X,)),
    "constant_pad_int": (lambda a: F.pad(a, (2, 0), value=7), (I,)),
    "reflect1d": (lambda a: F.pad(a, (2, 3), mode="reflect"), (X,)),
    "reflect2d": (lambda a: F.pad(a, (2, 1, 1, 2), mode="reflect"), (X,)),
    "reflect3d": (lambda a: F.pad(a, (2, 1, 1, 2, 1, 1), mode="reflect"), (X[None],)),
    "replicate1d": (lambda a: F.pad(a, (2, 3), mode="replicate"), (X,)),
    "replicate2d": (lambda a: F.pad(a, (2, 1, 1, 2), mode="replicate"), (X,)),
    "replicate3d": (lambda a: F.pad(a, (2, 1, 1, 2, 1, 1), mode="replicate"), (X[None],)),
    "reflection_pad2d_backward": (aten.reflection_pad2d_backward, (torch.randn(3, 7, 8), X, [2, 1, 1, 2])),
    "replication_pad1d_backward": (aten.replication_pad1d_backward, (torch.randn(3, 4, 8), X, [2, 1])),
    "tril": (torch.tril, (X, 1)),
    "triu": (torch.triu, (X, -1)),
    "diag_embed": (torch.diag_embed, (X, 1, 0, 2)),
    "diag_embed_neg": (torch.diag_embed, (X, -2)),
    "diagonal_scatter": (torch.diagonal_scatter, (X, torch.randn(3, 4), 1, 1, 2)),
    "slice_scatter": (torch.slice_scatter, (X, torch.randn(3, 2, 5), 1, 1, 4, 2)),
    "select_scatter": (torch.select_scatter, (X, torch.randn(3, 5), 1, -1)),
    "as_strided_scatter": (torch.as_strided_scatter, (X, torch.randn(2, 2), (2, 2), (5, 1), 3)),
    "narrow_copy": (torch.narrow_copy, (X, 2, 1, 3)),
    "permute_copy": (torch.permute_copy, (X, (2, 0, 1))),
    "expand_copy": (torch.expand_copy, (X[:, :1], (2, 3, 4, 5))),
    "view_copy": (torch.view_copy, (X, (-1, 5))),
    "transpose_copy": (torch.transpose_copy, (X, 0, 2)),
    "unsqueeze_copy": (torch.unsqueeze_copy, (X, -1)),
    "squeeze_copy": (torch.squeeze_copy, (X[:, :1],)),
    "unfold_copy": (torch.unfold_copy, (X, 2, 2, 2)),
    "diagonal_copy": (torch.diagonal_copy, (X, 0, 1, 2)),
    "as_strided_copy": (torch.as_strided_copy, (X, (2, 3), (1, 4), 2)),
    "im2col": (lambda a: F.unfold(a, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)),
               (torch.randn(2, 3, 6, 7),)),
    "col2im": (lambda a: F.fold(a, (6, 7), (2, 2), padding=1, stride=2), (torch.randn(2, 12, 16),)),
    "unfold_backward": (aten.unfold_backward, (torch.randn(3, 4, 2, 2), [3, 4, 5], 2, 2, 2)),
    "repeat_interleave_int": (torch.repeat_interleave, (X, 2, 1)),
    "pixel_shuffle": (torch.pixel_shuffle, (torch.randn(2, 8, 3, 3), 2)),
    "pixel_unshuffle": (torch.pixel_unshuffle, (torch.randn(2, 2, 4, 6), 2)),
}


@pytest.mark.parametrize("name", list(SHAPE_CASES))
def test_shape_ops(name):
    fn, args = SHAPE_CASES[name]
    check(fn, *args)


def test_repeat_interleave_tensor_is_dynamic():
    r = torch.tensor([1, 0, 3])
    check(torch.repeat_interleave, r, syncs=1)
    check(torch.repeat_interleave, X, r, 0)
    # output_size given: no data-dependent shape, no sync
    check(lambda a, b: torch.repeat_interleave(a, b, 0, output_size=4), X, r, syncs=0)


def test_cat_out_and_errors():
    out = torch.empty(0, device=DEV)
    torch.cat([X.to(DEV), X.to(DEV)], 0, out=out)
    torch.testing.assert_close(out.cpu(), torch.cat([X, X]))
    with pytest.raises(IndexError):
        torch.cat([X.to(DEV), X.to(DEV)], 3)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match except in dimension 0"):
        torch.cat([X.to(DEV), X[:, :2].to(DEV)])
    with pytest.raises(RuntimeError, match="zero-dimensional tensor"):
        torch.cat([X.to(DEV), torch.tensor(1.0, device=DEV)])


# ---- view-op lowerings (graph executors) called directly ----

VIEW_CASES = [
    (aten.view.default, (X, [4, -1])),
    (aten._unsafe_view.default, (X, [12, 5])),
    (aten._reshape_alias.default, (X, [5, 12], [12, 1])),
    (aten.permute.default, (X, [1, 2, 0])),
    (aten.transpose.int, (X, -1, 0)),
    (aten.t.default, (I,)),
    (aten.expand.default, (X[:, :1], [2, -1, 4, 5])),
    (aten.slice.Tensor, (X, 1, -3, 100, 2)),
    (aten.slice.Tensor, (X, 2, 4, 1)),
    (aten.select.int, (X, 1, -1)),
    (aten.squeeze.default, (X[:1, :, :1],)),
    (aten.squeeze.dim, (X[:1], 0)),
    (aten.squeeze.dims, (X[:1, :, :1], [0, 1, 2])),
    (aten.unsqueeze.default, (X, 3)),
    (aten.diagonal.default, (X, -1, 2, 1)),
    (aten.narrow.default, (X, 1, -3, 2)),
    (aten.split.Tensor, (X, 2, 1)),
    (aten.split_with_sizes.default, (X, [1, 4], 2)),
    (aten.unbind.int, (X, 1)),
    (aten.unfold.default, (X, 1, 2, 1)),
    (aten.as_strided.default, (X, [3, 3], [1, 5], 1)),
    (aten.alias.default, (X,)),
    (aten.detach.default, (X,)),
    (aten.view_as_real.default, (torch.randn(3, 2, dtype=torch.complex64),)),
    (aten.view_as_complex.default, (torch.randn(3, 2),)),
    (aten.view.dtype, (X, torch.int32)),
    (aten.view.dtype, (X, torch.int16)),
    (aten.view.dtype, (torch.arange(8, dtype=torch.int16).reshape(2, 4), torch.float32)),
    (aten.view.dtype, (torch.tensor([0, 1, 2], dtype=torch.uint8), torch.bool)),
]


@pytest.mark.parametrize("op,args", VIEW_CASES, ids=[f"{o}-{i}" for i, (o, _) in enumerate(VIEW_CASES)])
def test_view_lowerings(op, args):
    expected = op(*args)
    low = registry.get(op)
    assert low is not None, op
    jargs = [jnp.asarray(a.contiguous().numpy()) if isinstance(a, torch.Tensor) else a for a in args]
    got = low.fn(*jargs)
    exp_l = expected if isinstance(expected, (list, tuple)) else [expected]
    got_l = got if isinstance(got, (list, tuple)) else [got]
    assert len(exp_l) == len(got_l)
    for e, g in zip(exp_l, got_l):
        g = torch.from_numpy(np.array(g))
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e.contiguous())


# ---- indexing ----

IDX = torch.tensor([2, 0, 2, 1])
SRC = torch.randn(3, 4, 5)
G_IDX = torch.randint(0, 4, (2, 3, 5))

INDEX_CASES = {
    "index_select": (torch.index_select, (X, 1, IDX)),
    "index_select_scalar": (torch.index_select, (X, 0, torch.tensor(1))),
    "gather": (torch.gather, (X, 1, G_IDX)),
    "gather_neg_dim": (torch.gather, (X, -2, G_IDX)),
    "take": (torch.take, (X, torch.tensor([[0, 59], [-1, 7]]))),
    "put": (lambda a, i, s: a.put(i, s), (X, torch.tensor([0, 59, 7]), torch.randn(3))),
    "put_acc": (lambda a, i, s: a.put(i, s, accumulate=True), (X, torch.tensor([1, 1, 7]), torch.randn(3))),
    "scatter_src": (torch.scatter, (X, 1, torch.tensor([[[0, 1, 2, 3, 0]]]), SRC)),
    "scatter_value": (torch.scatter, (X, 2, torch.tensor([[[4], [0]]]), 1.5)),
    "scatter_add": (torch.scatter_add, (X, 1, G_IDX, SRC)),
    "scatter_reduce_legacy_mul": (lambda a, i, s: torch.scatter(a, 1, i, s, reduce="multiply"), (X, G_IDX, SRC)),
    "index_add": (lambda a, i, s: a.index_add(1, i, s, alpha=2), (X, IDX, torch.randn(3, 4, 5))),
    "index_add_int": (lambda a, i, s: a.index_add(0, i, s), (I, torch.tensor([0, 0]), torch.ones(2, 4, dtype=torch.long))),
    "index_copy": (lambda a, i, s: a.index_copy(2, i, s), (X, torch.tensor([4, 0]), torch.randn(3, 4, 2))),
    "index_fill": (lambda a, i: a.index_fill(1, i, -3.0), (X, IDX)),
    "index_fill_tensor": (lambda a, i, v: a.index_fill(2, i, v), (X, torch.tensor([1, 3]), torch.tensor(9.0))),
    "masked_fill": (lambda a, m: a.masked_fill(m, 2.0), (X, X > 0)),
    "masked_fill_bcast": (lambda a, m, v: a.masked_fill(m, v), (X, torch.tensor([True, False, True, False, True]), torch.tensor(-1.0))),
    "masked_fill_int": (lambda a, m: a.masked_fill(m, 7), (I, I % 2 == 0)),
    "masked_scatter": (lambda a, m, s: a.masked_scatter(m, s), (X, X > 0.3, torch.randn(60))),
    "where": (torch.where, (X > 0, X, I[..., None].double())),
    "where_scalar": (lambda c, a: torch.where(c, a, 0), (X > 0, X)),
    "embedding": (F.embedding, (torch.tensor([[1, 3], [0, 3]]), torch.randn(5, 3))),
    "embedding_max_norm": (lambda i, w: (F.embedding(i, w, max_norm=1.0, norm_type=1.5), w),
                           (torch.tensor([[1, 3], [0, 3]]), torch.randn(5, 3) * 2)),
    "scatter_add_bool": (torch.scatter_add, (I % 3 == 0, 1, torch.tensor([[0, 0], [1, 1], [2, 3]]),
                                            I % 2 == 0)),
    "index_put_acc_bool": (lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True),
                           (I[0] > 5, torch.tensor([0, 0, 2]), torch.tensor([True, False, True]))),
    "nonzero": (torch.nonzero, (X > 0.5,)),
    "nonzero_0d": (torch.nonzero, (torch.tensor(3.0),)),
    "argwhere": (torch.argwhere, (I % 3,)),
    "masked_select": (torch.masked_select, (X, X > 0.2)),
    "masked_select_bcast": (torch.masked_select, (X, torch.tensor([True, False, True, False, True]))),
    "unique": (lambda a: torch.unique(a, return_inverse=True, return_counts=True), (torch.tensor([[3, 1, 3], [2, 1, 1]]),)),
    "unique_plain": (torch.unique, (torch.tensor([3.0, 1.0, 3.0, -2.0]),)),
    "unique_nan_distinct": (lambda a: torch.unique(a, return_inverse=True, return_counts=True),
                            (torch.tensor([float("nan"), 1.0, float("nan"), 1.0]),)),
    "unique_dim": (lambda a: torch.unique(a, dim=1, return_inverse=True, return_counts=True), (torch.tensor([[3, 1, 3], [2, 1, 2]]),)),
    "unique_consecutive": (lambda a: torch.unique_consecutive(a, return_inverse=True, return_counts=True), (torch.tensor([1, 1, 2, 2, 3, 1, 1, 2]),)),
    "unique_consecutive_dim": (lambda a: torch.unique_consecutive(a, return_counts=True, dim=0), (torch.tensor([[1, 2], [1, 2], [3, 4]]),)),
}


@pytest.mark.parametrize("name", list(INDEX_CASES))
def test_indexing_ops(name):
    fn, args = INDEX_CASES[name]
    check(fn, *args)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_scatter_reduce(reduce, include_self, dtype):
    x = (X * 10).to(dtype)
    src = (SRC * 10).to(dtype)
    check(lambda a, i, s: a.scatter_reduce(1, i, s, reduce, include_self=include_self), x, G_IDX, src)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce(reduce):
    check(lambda a, i, s: a.index_reduce(1, i, s, reduce, include_self=False),
          X, IDX, torch.randn(3, 4, 5))


def test_index_put_accumulate_sums_duplicates():
    i = torch.tensor([0, 2, 0, 0])
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    check(lambda a, i, v: torch.index_put(a, (i,), v, accumulate=True), torch.zeros(3), i, v)
    check(lambda a, i, j, v: a.index_put_((i, j), v, accumulate=True), X[0].clone(), i,
          torch.tensor([1, 1, 1, 3]), v)
    check(lambda a, i, j, v: aten.index_put(a, [None, i, j], v, True), X.clone(), i[:2],
          torch.tensor([4, 4]), torch.randn(3, 2))


@pytest.mark.parametrize("scale", [False, True])
def test_embedding_dense_backward(scale):
    idx = torch.tensor([[1, 3, 1], [0, 3, 2]])
    g = torch.randn(2, 3, 4)
    check(aten.embedding_dense_backward, g, idx, 5, 3, scale)
    check(aten.embedding_dense_backward, g, idx, 5, -1, scale)


def test_mask_index_syncs_only_when_shape_depends_on_data():
    x = torch.randn(4, 5)
    m = x > 0
    check(lambda a, b: a[b], x, m, syncs=1)  # result length = mask count: one sync
    check(lambda a, b, v: torch.index_put(a, (b,), v), x, m, torch.tensor(2.0), syncs=0)
    check(lambda a, b, v: torch.index_put(a, (b,), v, accumulate=True), x, m, torch.tensor(2.0), syncs=0)
    vals = torch.arange(int(m.sum()), dtype=torch.float32)
    check(lambda a, b, v: torch.index_put(a, (b,), v), x, m, vals, syncs=1)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("variant", ["plain", "padding", "psw", "last_offset", "freq"])
def test_embedding_bag_forward_backward(mode, variant):
    if variant == "psw" and mode != "sum":
        pytest.skip("per_sample_weights exists only for mode='sum'")
    if variant == "freq" and mode == "max":
        pytest.skip("scale_grad_by_freq is not supported with mode='max' (PyTorch raises)")
    torch.manual_seed(1)
    w = torch.randn(7, 3)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 0, 1])
    offsets = torch.tensor([0, 2, 2, 5])  # bag 1 is empty
    if variant == "last_offset":  # the last offset is len(indices) (PyTorch's contract)
        offsets = torch.tensor([0, 2, 2, 5, 9])
    psw = torch.rand(9) if variant == "psw" else None
    kw = dict(mode=mode, padding_idx=2 if variant == "padding" else None,
              include_last_offset=variant == "last_offset",
              scale_grad_by_freq=variant == "freq")

    def f(w, idx, offsets, psw):
        w = w.clone().requires_grad_()
        p = psw.clone().requires_grad_() if psw is not None else None
        out = F.embedding_bag(idx, w, offsets, per_sample_weights=p, **kw)
        (out * torch.arange(1.0, 4.0, device=out.device)).sum().backward()
        return (out, w.grad) + ((p.grad,) if p is not None else ())

    if variant != "freq":
        check(f, w, idx, offsets, psw)
        return
    # PyTorch's CPU embedding_bag backward mis-scales some rows with scale_grad_by_freq (a row
    # seen once in [3, 1, 1] gets 1/2); compare with the documented rule instead: each bag's
    # gradient divided by the frequency of the word in the batch (F.embedding's CPU kernel).
    out, gw = f(*_to((w, idx, offsets, psw), DEV))
    wr = w.clone().requires_grad_()
    rows = F.embedding(idx, wr, scale_grad_by_freq=True)
    bag = torch.tensor([0, 0, 2, 2, 2, 3, 3, 3, 3])
    ref = torch.zeros(4, 3).index_add(0, bag, rows)
    if mode == "mean":
        ref = ref / torch.tensor([2.0, 1.0, 3.0, 4.0])[:, None]
    (ref * torch.arange(1.0, 4.0)).sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach())
    torch.testing.assert_close(gw.cpu(), wr.grad)


# ---------------------------------------------------------------- out-of-range indices

_OOB_CASES = [
    # (name, op on a (5, 3) tensor x, CPU's exception type)
    ("index_select", lambda x, t: torch.index_select(x, 0, t([1, 7])), IndexError),
    ("getitem", lambda x, t: x[t([0, 5])], IndexError),
    ("gather", lambda x, t: torch.gather(x, 1, t([[0, 3]] * 5)), RuntimeError),
    ("embedding", lambda x, t: F.embedding(t([2, 5]), x), IndexError),
    ("take", lambda x, t: x.take(t([15])), IndexError),
    ("scatter_add", lambda x, t: x.scatter_add(0, t([[6, 0, 0]]), torch.ones_like(x[:1])),
     RuntimeError),
    ("setitem", lambda x, t: x.clone().index_put_((t([9]),), torch.ones_like(x[0])), IndexError),
    ("index_add", lambda x, t: x[:, 0].clone().index_add_(0, t([5]), x[:1, 0]), IndexError),
    ("index_copy", lambda x, t: x.clone().index_copy_(0, t([7]), torch.ones_like(x[:1])), IndexError),
    ("index_fill", lambda x, t: x.clone().index_fill_(1, t([3]), 1.0), IndexError),
    ("index_reduce", lambda x, t: x[:, 0].clone().index_reduce_(0, t([5]), x[:1, 0], "prod"),
     IndexError),
]


@pytest.mark.parametrize("name,op,exc", _OOB_CASES, ids=[c[0] for c in _OOB_CASES])
def test_out_of_range_index_raises_like_cpu_at_the_next_sync(name, op, exc):
    x = torch.randn(5, 3)
    with pytest.raises(exc):  # PyTorch's own error on CPU
        op(x, lambda v: torch.tensor(v))
    xt = x.to(DEV)
    out = op(xt, lambda v: torch.tensor(v, device=DEV))  # asynchronous: no error yet
    with pytest.raises(exc, match="on device tpu.*TORCH_TPU_LAUNCH_BLOCKING"):
        out.sum().item()
    out.sum().item()  # reported once; later syncs are clean


@pytest.mark.parametrize("name,op,exc", _OOB_CASES, ids=[c[0] for c in _OOB_CASES])
def test_out_of_range_index_raises_at_the_op_in_debug_mode(name, op, exc):
    xt = torch.randn(5, 3, device=DEV)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        with pytest.raises(exc, match="on device tpu"):
            op(xt, lambda v: torch.tensor(v, device=DEV))


def test_in_range_indices_pass_the_checks_without_syncing():
    x = torch.randn(5, 3)
    xt = x.to(DEV)
    idx = torch.tensor([-5, 4, 0])
    syncs = COUNTERS["host_syncs"]
    got = [xt[idx.to(DEV)] for _ in range(150)]  # more than the pending list holds unfolded
    assert COUNTERS["host_syncs"] == syncs
    torch.tpu.synchronize()  # reads the pending checks: all valid
    torch.testing.assert_close(got[-1].cpu(), x[idx])
    bad = torch.index_select(xt, 0, torch.tensor([5], device=DEV))
    with pytest.raises(IndexError, match="index_select"):
        torch.tpu.synchronize()
    del bad


@pytest.mark.parametrize("name,op,exc", _OOB_CASES, ids=[c[0] for c in _OOB_CASES])
def test_out_of_range_index_raises_at_the_next_sync_in_fused_mode(name, op, exc):
    xt = torch.randn(5, 3, device=DEV)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        out = op(xt, lambda v: torch.tensor(v, device=DEV)) * 2  # recorded, not run
        with pytest.raises(exc, match="on device tpu"):
            out.sum().item()
        ok = torch.index_select(xt, 0, torch.tensor([4, -0], device=DEV)).sum()
        ok.item()  # valid indices: no error, and the graph ran once


def test_pending_checks_stay_bounded_and_keep_the_failing_op():
    from torchtpu.eager import checks, fused

    xt = torch.randn(5, 3, device=DEV)
    good = torch.tensor([0, 4], device=DEV)
    for mode in (torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE):
        with torch.tpu.set_eager_mode(mode):
            outs = []
            for i in range(300):
                outs.append(xt[good])
                if i % 50 == 49:
                    torch.tpu.synchronize() if mode == torch.tpu.EagerMode.DEFER_NEVER else None
            bad = torch.index_select(xt, 0, torch.tensor([7], device=DEV))
            outs += [F.embedding(good, xt) for _ in range(100)]
            # computed flags fold; a Fused graph not run yet keeps one flag per checked op
            unrun = fused.MAX_NODES if mode == torch.tpu.EagerMode.DEFER_AND_FUSE else 0
            assert len(checks._pending) <= 2 * checks._FOLD_AT + 2 + unrun
            with pytest.raises(IndexError, match="index_select"):
                torch.tpu.synchronize()
            del bad, outs


def test_folded_checks_of_different_kinds_name_every_kind():
    """A fold of flags from different checks (an index check and a probability check) must not
    report one kind's message for the other's failure."""
    from torchtpu.eager import checks

    torch.tpu.synchronize()
    xt = torch.randn(5, 3, device=DEV)
    p = torch.tensor([[0.5, 0.5]], device=DEV)
    outs = [torch.index_select(xt, 0, torch.tensor([1], device=DEV)) for _ in range(40)]
    outs.append(torch.multinomial(torch.tensor([[0.5, -0.5]], device=DEV), 1))  # bad
    outs += [torch.multinomial(p, 1) for _ in range(checks._FOLD_AT)]
    with pytest.raises(RuntimeError) as err:
        torch.tpu.synchronize()
    assert "multinomial" in str(err.value) and "probability" in str(err.value)
    del outs


def test_folding_folded_checks_names_each_kind_once():
    """A long asynchronous run folds already-folded flags again: the folded entry's op names
    and messages are merged, not nested (they grew without bound, several KB per entry)."""
    from torchtpu.eager import checks

    torch.tpu.synchronize()
    xt = torch.randn(5, 3, device=DEV)
    p = torch.tensor([[0.5, 0.5]], device=DEV)
    i = torch.tensor([1], device=DEV)
    outs = []
    for _ in range(6):
        outs += [torch.index_select(xt, 0, i) for _ in range(checks._FOLD_AT // 2)]
        outs += [torch.multinomial(p, 1) for _ in range(checks._FOLD_AT // 2)]
    folded = [it for it in checks._pending if it[1].startswith("one of ")]
    assert folded, "no fold happened: the test does not exercise folding"
    for _, name, exc, msg in checks._pending:
        assert name.count("index_select") <= 1 and name.count("multinomial") <= 1, name
        assert len(msg) < 400, msg
    torch.tpu.synchronize()  # every check passed
    del outs


@pytest.mark.parametrize("name,op,exc", _OOB_CASES, ids=[c[0] for c in _OOB_CASES])
def test_out_of_range_index_raises_at_the_next_sync_when_compiled(name, op, exc):
    torch._dynamo.reset()
    xt = torch.randn(5, 3, device=DEV)

    def f(x, i):
        return op(x, lambda v: i) * 2

    cf = torch.compile(f, backend="tpu")
    idx = {"index_select": [1, 4], "getitem": [0, 4], "gather": [[0, 2]] * 5,
           "embedding": [2, 4], "take": [14], "scatter_add": [[4, 0, 0]], "setitem": [4],
           "index_add": [4], "index_copy": [4], "index_fill": [2], "index_reduce": [4]}[name]
    good = cf(xt, torch.tensor(idx, device=DEV))
    torch.testing.assert_close(good.cpu(), f(xt.cpu(), torch.tensor(idx)))
    bad_idx = {"index_select": [1, 7], "getitem": [0, 5], "gather": [[0, 3]] * 5,
               "embedding": [2, 5], "take": [15], "scatter_add": [[6, 0, 0]], "setitem": [9],
               "index_add": [5], "index_copy": [7], "index_fill": [3], "index_reduce": [5]}[name]
    out = cf(xt, torch.tensor(bad_idx, device=DEV))  # same shapes: the same program
    with pytest.raises(exc, match="on device tpu"):
        out.sum().item()


@pytest.mark.parametrize("shape,target", [((3, 4), [0, 4, 1]), ((2, 4, 3), [[0, 1, -1]] * 2)])
def test_out_of_range_loss_target_raises_like_cpu(shape, target):
    x = torch.randn(*shape)
    with pytest.raises(IndexError, match="Target .*out of bounds"):
        F.cross_entropy(x, torch.tensor(target))
    loss = F.cross_entropy(x.to(DEV), torch.tensor(target, device=DEV))
    with pytest.raises(IndexError, match="Target is out of bounds.*nll_loss"):
        loss.item()
    ok = torch.tensor(target).clamp(0, shape[1] - 1)
    ok[..., 0] = -100  # ignore_index is a valid target
    torch.testing.assert_close(F.cross_entropy(x.to(DEV), ok.to(DEV)).cpu(),
                               F.cross_entropy(x, ok))


@pytest.mark.parametrize("which", ["input", "target"])
def test_binary_cross_entropy_checks_its_probabilities(which):
    """Values CPU checks on the host: here in the op's program, raised at the next sync."""
    p = torch.full((4,), 0.5)
    t = torch.zeros(4)
    if which == "input":
        p[1] = 1.5
    else:
        t[2] = 2.0
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(p, t)
    loss = F.binary_cross_entropy(p.to(DEV), t.to(DEV))
    with pytest.raises(RuntimeError, match="between 0 and 1.*on device tpu"):
        loss.item()


def test_repeat_interleave_negative_repeats_raise():
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        torch.repeat_interleave(torch.tensor([1, -1], device=DEV))


@pytest.mark.parametrize("bad", ["none", "first", "second", "both"])
def test_compiled_graph_with_several_checks_reads_one_flag_and_names_the_failed_op(bad):
    """A compiled program's checks join the pending list as one flag (their AND, computed in
    the program): a sync reads one value; a failure still raises for the first failed check,
    with that op's own exception type and message, as the flags read one by one did."""
    from torchtpu.eager import checks

    torch._dynamo.reset()
    torch.tpu.synchronize()
    xt = torch.randn(5, 3, device=DEV)

    def f(x, i, j):
        return torch.index_select(x, 0, i).sum() + F.embedding(j, x).sum()

    cf = torch.compile(f, backend="tpu")
    i = torch.tensor([1, 7] if bad in ("first", "both") else [1, 4], device=DEV)
    j = torch.tensor([2, 5] if bad in ("second", "both") else [2, 4], device=DEV)
    before = torch.tpu.metrics()["counters"].get("device_checks", 0)
    out = cf(xt, i, j)
    assert torch.tpu.metrics()["counters"]["device_checks"] - before == 2
    assert len(checks._pending) == 1
    if bad == "none":
        torch.testing.assert_close(out.cpu(), f(xt.cpu(), i.cpu(), j.cpu()))
        return
    name = "index_select" if bad in ("first", "both") else "embedding"
    with pytest.raises(IndexError, match=f"index out of range in self \\(in aten::{name}"):
        out.item()
    assert not checks._pending
