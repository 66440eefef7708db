"""End-to-end view and indexing semantics through the tpu device, against PyTorch on CPU:
getitem/setitem, views and in-place ops that must update their base and sibling views,
out= variants, and index_put with accumulate under autograd (embedding backward)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DEV = "tpu"


def _to(x, dev):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().to(dev).requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(e, dev) for e in x)
    return x


from helpers import flat as _flat  # noqa: E402


def same(fn, *args):
    """Run ``fn`` on CPU copies and on tpu copies of ``args``; compare every returned tensor
    and every argument afterwards (in-place writes through views must reach the base)."""
    cargs = _to(args, "cpu")
    targs = _to(args, DEV)
    expected = fn(*cargs)
    got = fn(*targs)
    for e, g in zip(_flat(expected) + _flat(cargs), _flat(got) + _flat(targs), strict=True):
        if not isinstance(e, torch.Tensor):
            assert e == g
            continue
        assert g.device.type == DEV, g.device
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape, g.dtype, e.dtype)
        torch.testing.assert_close(g.detach().cpu(), e.detach(), equal_nan=True)


torch.manual_seed(0)
A = torch.randn(4, 5, 6)


# ---- getitem ----

GETITEM = {
    "int": lambda x: x[1],
    "neg_int": lambda x: x[-1, -2],
    "slice": lambda x: x[1:3],
    "step": lambda x: x[::2, 1::3],
    "neg_slice": lambda x: x[-3:-1, :, -4:],
    "none_ellipsis": lambda x: x[None, ..., None, 2],
    "ellipsis_int": lambda x: x[..., 0],
    "tensor_index": lambda x: x[torch.tensor([0, 2, 2, -1], device=x.device)],
    "list_index": lambda x: x[[0, 3], :, [1, 5]],
    "nonadjacent_adv": lambda x: x[torch.tensor([0, 1], device=x.device), 1:3, torch.tensor([2, 4], device=x.device)],
    "adv_broadcast": lambda x: x[torch.tensor([[0], [3]], device=x.device), torch.tensor([1, 2, 4], device=x.device)],
    "bool_mask": lambda x: x[x > 0.5],
    "bool_mask_rows": lambda x: x[torch.tensor([True, False, True, True], device=x.device)],
    "bool_mask_mid": lambda x: x[:, torch.tensor([True, False, True, False, False], device=x.device)],
    "scalar_bool": lambda x: x[True],
    "int_and_slice_view_chain": lambda x: x[1:][::2][:, 1].t()[2:],
    "cpu_index": lambda x: x[torch.tensor([3, 0, -2]), :, torch.tensor([1])],
    "cpu_mask": lambda x: x[:, torch.tensor([True, False, True, False, True])],
}


@pytest.mark.parametrize("name", list(GETITEM))
def test_getitem(name):
    same(GETITEM[name], A)


# ---- setitem ----

def _set(index_fn, value_fn):
    def f(x):
        x[index_fn(x)] = value_fn(x)
        return x
    return f


def _d(x, v):
    return torch.tensor(v, device=x.device)


SETITEM = {
    "int": _set(lambda x: 1, lambda x: 3.0),
    "neg_slice_step": _set(lambda x: (slice(-3, None, 2), 1), lambda x: -1.0),
    "tensor_value_bcast": _set(lambda x: (slice(None), 2), lambda x: torch.arange(6.0, device=x.device)),
    "ellipsis": _set(lambda x: (Ellipsis, 0), lambda x: 7.0),
    "none": _set(lambda x: (None, 1), lambda x: 2.0),
    "tensor_index": _set(lambda x: _d(x, [0, 2]), lambda x: 5.0),
    "tensor_index_values": _set(lambda x: (_d(x, [3, 1]), slice(None), _d(x, [0, 5])),
                                lambda x: torch.ones(2, 5, device=x.device)),
    "bool_mask_scalar": _set(lambda x: x > 0, lambda x: 0.0),
    "bool_mask_values": _set(lambda x: x > 0.5, lambda x: torch.arange(int((x > 0.5).sum()), device=x.device, dtype=x.dtype)),
    "bool_mask_rows_values": _set(lambda x: _d(x, [False, True, False, True]),
                                  lambda x: torch.full((2, 5, 6), 4.0, device=x.device)),
    "int_dtype_value": _set(lambda x: 0, lambda x: _d(x, 3)),
    "mask_and_index": _set(lambda x: (_d(x, [True, False, False, True]), _d(x, [0, 4])), lambda x: 5.0),
    "cpu_index": _set(lambda x: (torch.tensor([0, 2]), 1), lambda x: torch.ones(2, 6, device=x.device)),
    "cpu_mask": _set(lambda x: torch.tensor([False, True, True, False]), lambda x: 7.0),
}


@pytest.mark.parametrize("name", list(SETITEM))
def test_setitem(name):
    same(SETITEM[name], A)


# ---- views and in-place ops reaching bases and siblings ----

def _column_mul(x):
    x[:, 1].mul_(2)
    return x


def _t_add(x):
    m = x[0]
    m.t().add_(1)
    return x, m


def _chained(x):
    v = x[1:].transpose(0, 2)[::2]
    sib = x[2]
    v.sub_(3)
    return x, sib, v


def _expand_clone(x):
    e = x[:, :1].expand(4, 3, 6).clone()
    e.add_(1)
    return x, e


def _narrow_select_unbind(x):
    x.narrow(2, 1, 3).fill_(5)
    x.select(0, -1).zero_()
    a, b, c, d = x.unbind(0)
    b.mul_(-1)
    return x, a, c


def _view_reshape(x):
    v = x.view(4, 30)
    v[:, ::7] = 1.5
    r = x.reshape(-1)
    r[3] = -8.0
    return x, v


def _diag_write(x):
    torch.diagonal(x[0], 1).copy_(torch.arange(5.0, device=x.device))
    return x


def _unfold_read(x):
    return x.unfold(2, 3, 2).sum(-1)


def _split_write(x):
    parts = x.split(2, dim=1)
    parts[1].add_(10)
    return x, parts[2]


def _index_add_inplace(x):
    x[1:].index_add_(1, torch.tensor([0, 0, 4], device=x.device), torch.ones(3, 3, 6, device=x.device))
    return x


def _masked_fill_view(x):
    x[:, 2:].masked_fill_(x[:, 2:] > 0, 9.0)
    return x


def _scatter_view(x):
    x[0].scatter_(1, torch.tensor([[1], [2], [3], [0], [5]], device=x.device), -2.0)
    return x


def _dtype_view(x):
    x.view(torch.int32)[0, 0, 0] = 0
    return x


def _squeeze_unsqueeze(x):
    u = x[:1].squeeze(0).unsqueeze(-1)
    u.mul_(0.5)
    return x, u


VIEWS = {f.__name__[1:]: f for f in (
    _column_mul, _t_add, _chained, _expand_clone, _narrow_select_unbind, _view_reshape,
    _diag_write, _unfold_read, _split_write, _index_add_inplace, _masked_fill_view,
    _scatter_view, _dtype_view, _squeeze_unsqueeze)}


@pytest.mark.parametrize("name", list(VIEWS))
def test_view_writes(name):
    same(VIEWS[name], A)


# ---- out= variants ----

def test_out_variants():
    def f(x):
        o1 = torch.empty(0, device=x.device)
        torch.cat([x, x[:1]], 0, out=o1)
        o2 = torch.empty(3, device=x.device)
        torch.index_select(x, 1, torch.tensor([4, 0], device=x.device), out=o2)
        o3 = torch.empty(2, 3, device=x.device)
        torch.gather(x, 2, torch.zeros(4, 5, 2, dtype=torch.long, device=x.device), out=o3)
        o4 = torch.empty(0, dtype=torch.long, device=x.device)
        torch.nonzero(x > 1, out=o4)
        o5 = torch.empty(0, device=x.device)
        torch.masked_select(x, x < -1, out=o5)
        o6 = torch.empty(4, 5, 6, device=x.device)
        torch.where(x > 0, x, torch.zeros((), device=x.device), out=o6)
        return o1, o2, o3, o4, o5, o6
    same(f, A)


def test_out_view_destination():
    def f(x):
        # out= into a (non-contiguous) view of the same base
        torch.index_select(x[0], 0, torch.tensor([4, 0, 1, 1, 2], device=x.device), out=x[1:3, 0])
        return x
    same(f, A)


# ---- autograd through indexing ----

def test_embedding_backward_accumulates_duplicates():
    w = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([[1, 2, 1], [5, 1, 0]])

    def f(w, idx, pad, scale):
        out = F.embedding(idx, w, padding_idx=pad, scale_grad_by_freq=scale)
        (out * torch.arange(1.0, 4.0, device=w.device)).sum().backward()
        return out, w.grad

    for pad, scale in ((None, False), (1, False), (None, True)):
        same(lambda w, i: f(w, i, pad, scale), w, idx)


def test_index_put_accumulate_backward():
    def f(x):
        i = torch.tensor([0, 1, 0, 3], device=x.device)
        y = x[i] * torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)[:, None, None]
        y.sum().backward()
        return y, x.grad
    same(f, A.clone().requires_grad_())


def test_getitem_setitem_backward():
    def f(x):
        y = x * 1.0
        y[:, 1] = 0.0
        z = y[y > 0.2]
        (z * z).sum().backward()
        return z, x.grad
    same(f, A.clone().requires_grad_())


# ---- the graph executors use the view/indexing lowerings ----

def _graph_fn(x, i, w):
    y = torch.cat([x[:, 1:3], x[:, ::2].t().reshape(4, -1)[:, :2]], 0)
    z = y.unsqueeze(0).expand(2, -1, -1).permute(1, 0, 2).flatten(1)
    e = F.embedding(i, w)
    g = torch.gather(x, 1, i[:4, None].expand(4, 2) % 5)
    s = x.index_add(0, i % 4, torch.ones(i.shape[0], 5, device=x.device))
    u = torch.unbind(x, 1)[2] + x.select(1, -1) + torch.diagonal(x).sum()
    v = F.pad(x[None], (1, 2), mode="reflect")
    x2 = x.clone()
    x2[:, 1] = 3.0
    x2[i[:2]] += 1.0
    return (z.sum(1), e, g, s, u, v, x.view(torch.int32)[0], torch.where(x > 0, x, 0.0), x2,
            x.split([2, 3], 1)[1], x.unfold(1, 2, 2), torch.view_as_real(x.to(torch.complex64)))


def test_compiled_views_and_indexing():
    from torchtpu.runtime.metrics import PER_OP

    x, i, w = torch.randn(4, 5), torch.tensor([1, 0, 3, 2, 1]), torch.randn(4, 3)
    before = dict(PER_OP.get("compile_cpu_fallbacks", {}))
    same(torch.compile(_graph_fn, backend="tpu", fullgraph=True), x, i, w)
    new = {k: v for k, v in PER_OP.get("compile_cpu_fallbacks", {}).items() if before.get(k) != v}
    mine = [k for k in new if any(s in k for s in ("index", "gather", "cat", "pad", "select",
                                                   "slice", "view", "embedding", "where",
                                                   "unfold", "split", "unbind", "diagonal"))]
    assert not mine, f"fell back to CPU callbacks in the compiled graph: {mine}"


FUSED_CASES = {**{n: VIEWS[n] for n in ("column_mul", "chained", "narrow_select_unbind",
                                         "view_reshape", "index_add_inplace", "dtype_view")},
               "setitem_bool_mask_values": SETITEM["bool_mask_values"],
               "setitem_tensor_index": SETITEM["tensor_index_values"]}


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_view_writes_fused(name):
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        same(FUSED_CASES[name], A)


# as_strided addresses storage elements: on a transposed or offset input it must use the
# input's real strides and storage offset, in every executor
AS_STRIDED = {
    "as_strided_of_transpose": lambda x: torch.as_strided(x.t(), (2, 2), (1, 2)) + 0,
    "as_strided_offset_within_view": lambda x: torch.as_strided(x[1:, :], (2, 3), (1, 4), 5) + 0,
    "as_strided_default_offset": lambda x: torch.as_strided(x[1:], (3, 2), (4, 2)) + 0,
    "as_strided_copy_of_transpose": lambda x: torch.as_strided_copy(x.t(), (2, 2), (1, 2)),
    "as_strided_scatter_contiguous": lambda x: torch.as_strided_scatter(
        x * 1, torch.ones(2, 2, device=x.device), (2, 2), (1, 5), 2),
}


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("name", sorted(AS_STRIDED))
def test_as_strided_uses_the_input_layout(name, mode):
    fn = AS_STRIDED[name]
    base = torch.arange(16.0).reshape(4, 4)
    want = fn(base.clone())
    x = base.to("tpu")
    if mode == "compiled":
        torch._dynamo.reset()
        got = torch.compile(fn, backend="tpu")(x)
    elif mode == "fused":
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            got = fn(x)
    else:
        got = fn(x)
    torch.testing.assert_close(got.cpu(), want)


def test_compiled_as_strided_outside_its_input_raises():
    # storage elements outside the input view are not among a graph's values: a clear error
    fn = torch.compile(lambda x: torch.as_strided(x[1:, 1:], (2, 2), (1, 2)) + 0, backend="tpu")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="outside its input"):
        fn(torch.arange(16.0).reshape(4, 4).to("tpu"))


def test_strided_spec_memo_matches_planning():
    """A strided view's spec comes from a memo keyed by (shape, strides, offset, storage size):
    the same spec planning gives, the offset stays the tensor's own (same strides at other
    offsets share the entry), and the values read through it are CPU's."""
    from torchtpu.eager import views
    from torchtpu.runtime import buffer

    base_cpu = torch.arange(2 * 6 * 4 * 5, dtype=torch.float32).reshape(2, 6, 4, 5)
    base = base_cpu.to(DEV)
    cases = [lambda x: x.transpose(1, 2), lambda x: x[:, 1:4].transpose(2, 3),
             lambda x: x[:, 2:5].transpose(2, 3), lambda x: x[1, :, ::2],
             lambda x: x.permute(3, 1, 0, 2)[1:]]
    views._STRIDED.clear()
    for f in cases:
        v = f(base)
        arr = buffer.buffer_of(v).array
        want = views._strided_spec(tuple(v.shape), tuple(v.stride()), v.storage_offset(),
                                    arr.size)
        for _ in range(2):  # planned, then from the memo
            spec, off = views.spec_of(v, arr)
            assert spec == want and off == v.storage_offset()
        torch.testing.assert_close((v * 2).cpu(), f(base_cpu) * 2, rtol=0, atol=0)
    assert len(views._STRIDED) == len(cases)


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_negative_view_over_a_whole_storage(mode, dtype):
    """PyTorch's lazy negative bit on a tensor that is its storage's whole array
    (``torch._neg_view``, as autograd formulas and ``.imag`` of a conjugate make): every read
    applies it and every write stores its inverse. Such a tensor read as its plain array
    before (wrong sign everywhere: ops, ``.cpu()``, ``clone``, ``resolve_neg``)."""
    base = torch.tensor([1.0, 2.0, -3.0]).to(dtype)
    with torch.tpu.set_eager_mode(mode):
        bt = base.to(DEV)
        n, nt = torch._neg_view(base.clone()), torch._neg_view(bt)
        assert nt.is_neg()
        for _ in range(2):  # a cached program (the C++ fast path's hit) the second time
            torch.testing.assert_close((nt * 2).cpu(), n * 2)
            torch.testing.assert_close((nt + 1).cpu(), n + 1)
        torch.testing.assert_close(nt.clone().cpu(), n.clone())
        torch.testing.assert_close(nt.resolve_neg().cpu(), n.resolve_neg())
        torch.testing.assert_close(nt.cpu().resolve_neg(), n.resolve_neg())
        nt.add_(10)  # the write stores -(value) in the base
        torch.testing.assert_close(bt.cpu(), -(n.resolve_neg() + 10))
