"""Ops that write several tensors, applied to views of ONE storage, give CPU's result.

Generated over the lowering table: every in-place list op (the ``_foreach_*_`` family) runs on
lists of views of one buffer (disjoint slices, ``as_strided`` windows, split and chunk pieces,
interleaved strided windows, a view and its base, seeded random windows, and a second list that
is the first one rotated, so later positions read what earlier ones wrote), in every eager
executor, and the whole buffer is compared with PyTorch CPU. Fused optimizers, GradScaler's
unscale, ``clip_grad_norm_``, ``out=`` ops with several outputs, ``split_with_sizes_copy`` and
``copy_`` chains are checked the same way, and a subset runs under ``torch.compile``.

Before the storage-group fix each write replaced the storage's array computed from the array
as it was before the op, so every write but the last was lost (FSDP2's copy-in, clip_grad_norm_
on FSDP2 gradients, fused optimizers over parameters that are views of one flat buffer).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from torchtpu.eager import kernels
from torchtpu.lowering import registry

MODES = {
    "strict": torch.tpu.EagerMode.DEFER_NEVER,
    "debug": torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    "fused": torch.tpu.EagerMode.DEFER_AND_FUSE,
}


# ---- views of one storage: (name, base numel, fn(base) -> list of views) ----

def _split(b):  # FSDP2's copy-in: split pieces of a narrowed flat buffer
    return [p.view(2, 3) for p in b.narrow(0, 2, 18).split([6, 6, 6])]


def _as_strided(b):
    return [b.as_strided((2, 3), (3, 1), k * 6) for k in range(3)]


def _chunk_cols(b):  # non-contiguous column blocks
    return list(b.view(2, 9).chunk(3, dim=1))


def _interleaved(b):  # disjoint windows whose address ranges overlap
    return [b.as_strided((2, 3), (9, 3), k) for k in range(3)]


def _base_and_view(b):  # overlapping: CPU applies the list position by position
    base = b[:6].view(2, 3)
    return [base, base[:, 1:], base.t()]


def _random(seed):
    """Seeded random disjoint windows: interleaved as_strided runs over the first half, random
    slices of the second, in random list order (the plan is drawn once, outside any trace)."""
    rng = random.Random(seed)
    stride = rng.choice([1, 2, 3])
    plan = [("s", rng.randint(2, 20 // stride), stride, k)
            for k in (rng.sample(range(stride), stride) if stride > 1 else [0])]
    cut = sorted(rng.sample(range(21, 40), 2))
    plan += [("c", 20, cut[0]), ("c", cut[0], cut[1])]
    rng.shuffle(plan)

    def make(b):
        return [b.as_strided((p[1],), (p[2],), p[3]) if p[0] == "s" else b[p[1]:p[2]]
                for p in plan]

    return make


PATTERNS = {"split": (20, _split), "as_strided": (18, _as_strided),
            "chunk_cols": (18, _chunk_cols), "interleaved": (18, _interleaved),
            "base_and_view": (6, _base_and_view),
            **{f"random{s}": (40, _random(s)) for s in range(3)}}
DISJOINT = ("split", "as_strided", "chunk_cols", "interleaved", "random0", "random1",
            "random2")


def _inplace_list_ops():
    """Every in-place list op of the table (the in-place siblings of _foreach_* lowerings)."""
    ops = []
    for op in list(registry.LOWERINGS):
        if not op._schema.name.startswith("aten::_foreach_"):
            continue
        inplace, _ = kernels._siblings(op)
        if inplace is not None and inplace._schema.arguments[0].type.__str__() == "List[Tensor]":
            ops.append(inplace)
    return sorted(ops, key=str)


INPLACE_OPS = _inplace_list_ops()


def _args(op, views, rotate, device, gen):
    """Arguments from the schema: ``self`` the views; other tensor lists fresh tensors shaped
    like them (or, with ``rotate``, the views rotated by one); scalars in range of every op."""
    n = len(views)
    args, kwargs = [views], {}
    for a in op._schema.arguments[1:]:
        t = str(a.type)
        if t == "List[Tensor]":
            if rotate:
                v = views[1:] + views[:1]
            else:
                v = [(torch.rand(v.shape, generator=gen) * 0.8 + 0.1).to(device) for v in views]
        elif t == "Tensor":
            if a.name == "scalars":
                v = torch.tensor([0.5 + 0.25 * i for i in range(n)])
            else:
                v = torch.tensor(0.75).to(device)
        elif t in ("List[number]", "List[Scalar]"):
            v = [0.5 + 0.25 * i for i in range(n)]
        elif t in ("number", "Scalar"):
            v = 0.75 if a.name != "exponent" else 2.0
        elif a.has_default_value():
            continue
        else:
            raise AssertionError(f"unhandled argument {a} of {op}")
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    return args, kwargs


def _run_list_op(op, pattern, rotate, device):
    numel, make = PATTERNS[pattern]
    gen = torch.Generator().manual_seed(0)
    base = (torch.rand(numel, generator=gen) * 0.8 + 0.1).to(device)
    views = make(base)
    assert not rotate or len({tuple(v.shape) for v in views}) == 1
    args, kwargs = _args(op, views, rotate, device, gen)
    op(*args, **kwargs)
    return base.cpu()


def _ids(ops):
    return [str(o).replace("aten.", "") for o in ops]


# TORCHTPU_OPINFO=full (or --opinfo=full) runs every pattern for every op; the default CI
# subset gives each op three patterns in turn (every pattern is used by ~25 ops) and, for ops
# with a second tensor list, one rotated case.
FULL = os.environ.get("TORCHTPU_OPINFO", "fast") == "full"
_ORDER = list(PATTERNS)
_SAME_SHAPE = ("split", "as_strided", "chunk_cols", "interleaved")


def _cases(op, index):
    two_lists = any(str(a.type) == "List[Tensor]" for a in op._schema.arguments[1:])
    if FULL:
        return [(p, r) for p in _ORDER for r in (False, True)
                if not r or (two_lists and p in _SAME_SHAPE)]
    cases = [(_ORDER[(index + k * 3) % len(_ORDER)], False) for k in range(3)]
    if two_lists:
        cases.append((_SAME_SHAPE[index % len(_SAME_SHAPE)], True))
    return cases


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("op", INPLACE_OPS, ids=_ids(INPLACE_OPS))
def test_inplace_list_op_on_views_of_one_storage(op, mode):
    assert len(INPLACE_OPS) > 60  # the table's in-place foreach family, not a handful
    for pattern, rotate in _cases(op, INPLACE_OPS.index(op)):
        expected = _run_list_op(op, pattern, rotate, "cpu")
        with torch.tpu.set_eager_mode(MODES[mode]):
            got = _run_list_op(op, pattern, rotate, "tpu")
        torch.testing.assert_close(got, expected, equal_nan=True,
                                   msg=lambda m: f"{op} {pattern} rotate={rotate}: {m}")


def test_issue_reproduction_every_mode():
    for mode in MODES.values():
        with torch.tpu.set_eager_mode(mode):
            res = {}
            for dev in ("cpu", "tpu"):
                buf = torch.zeros(20, device=dev)
                srcs = [torch.full((6,), 1.0, device=dev), torch.full((4,), 2.0, device=dev)]
                torch._foreach_copy_(list(torch.split(buf.narrow(0, 10, 10), [6, 4])), srcs)
                b2 = torch.ones(8, device=dev)
                torch._foreach_mul_([b2.as_strided((4,), (1,), 0),
                                     b2.as_strided((4,), (1,), 4)], 3.0)
                res[dev] = (buf.cpu(), b2.cpu())
            assert torch.equal(res["tpu"][0], res["cpu"][0])
            assert torch.equal(res["tpu"][1], res["cpu"][1])
            assert res["tpu"][0][10:16].eq(1).all() and res["tpu"][1].eq(3).all()


# ---- optimizers, GradScaler, clip_grad_norm_ over views of flat buffers (FSDP2's layout) ----

SHAPES = [(2, 5), (15,), (5, 5)]


def _flat_params(device, layout):
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(50, generator=gen).to(device)
    gflat = torch.randn(50, generator=gen).to(device)
    sizes = [10, 15, 25]
    if layout == "split":
        pieces, gpieces = flat.split(sizes), gflat.split(sizes)
        shaped = [p.view(s) for p, s in zip(pieces, SHAPES)]
        gshaped = [g.view(s) for g, s in zip(gpieces, SHAPES)]
    else:  # as_strided windows, as FSDP2 hands out views of its reduce-scatter output
        offs = [0, 10, 25]
        shaped = [flat.as_strided(s, torch.empty(s).stride(), o) for s, o in zip(SHAPES, offs)]
        gshaped = [gflat.as_strided(s, torch.empty(s).stride(), o)
                   for s, o in zip(SHAPES, offs)]
    params = [torch.nn.Parameter(p) for p in shaped]
    for p, g in zip(params, gshaped):
        p.grad = g
    return flat, gflat, params


OPTIMIZERS = {"Adam": dict(lr=0.1, weight_decay=0.01), "AdamW": dict(lr=0.1, amsgrad=True),
              "SGD": dict(lr=0.1, momentum=0.9, nesterov=True), "Adagrad": dict(lr=0.1)}


def _optimizer_run(device, name, impl, layout, scaler=False):
    flat, gflat, params = _flat_params(device, layout)
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = getattr(torch.optim, name)(params, **OPTIMIZERS[name], **kw)
    for _ in range(3):
        if scaler:
            found = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [p.grad for p in params], found, torch.tensor([0.5], device=device))
            assert found.item() == 0
        torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=impl != "single")
        opt.step()
    return flat.cpu(), gflat.cpu()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_over_views_of_flat_buffers(name, impl, mode):
    for layout in ("split", "as_strided"):
        exp = _optimizer_run("cpu", name, impl, layout, scaler=impl == "fused")
        with torch.tpu.set_eager_mode(MODES[mode]):
            got = _optimizer_run("tpu", name, impl, layout, scaler=impl == "fused")
        # float32 rounding of the fused kernels' formulas (CPU's and ours), not lost writes:
        # a lost write differs by the whole update (~0.1-3)
        torch.testing.assert_close(got[0], exp[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], exp[1])


# ---- out= with several outputs, split_with_sizes_copy, copy_ chains, *_scatter ----

def _out_ops(device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, generator=gen).to(device)
    res = []
    buf = torch.zeros(16, device=device)
    torch.aminmax(x, dim=0, out=(buf[0:6], buf[6:12]))  # two outputs in one storage
    res.append(buf)
    buf = torch.zeros(30, device=device)  # FSDP2's copy-out: split_with_sizes_copy(out=views)
    torch.split_with_sizes_copy(x.reshape(-1), [10, 14], 0, out=list(buf[2:26].split([10, 14])))
    res.append(buf)
    outs = [torch.empty(0, device=device) for _ in range(3)]
    r = torch.split_with_sizes_copy(x, [1, 2, 1], 0, out=outs)
    assert r is None
    res += outs
    buf = torch.zeros(24, device=device)
    torch.unbind_copy(x, 0, out=list(buf.view(4, 6).unbind(0)))
    res.append(buf)
    v = torch.zeros(12, device=device)
    torch.max(x, 1, out=(v[0:4], torch.empty(0, dtype=torch.long, device=device)))
    res.append(v)
    a = torch.arange(12.).to(device)  # copy_ chains through views of one storage
    a[0:4].copy_(x[0, :4])
    a[4:8].copy_(a[0:4] * 2)
    a[8:12].copy_(a[4:8].flip(0))
    a.view(3, 4)[:, 3].copy_(a[0:3])
    res.append(a)
    base = torch.arange(24.).to(device).view(4, 6)
    res.append(torch.slice_scatter(base, base[1:3] * 2, 0, 0, 2))
    res.append(torch.select_scatter(base, base[3], 0, 0))
    res.append(torch.diagonal_scatter(base, base[0, :4], 0))
    res.append(torch.as_strided_scatter(base, base[2, :3], (3,), (7,), 1))
    return [t.cpu() for t in res]


@pytest.mark.parametrize("mode", list(MODES))
def test_out_ops_and_copy_chains_on_views(mode):
    exp = _out_ops("cpu")
    with torch.tpu.set_eager_mode(MODES[mode]):
        got = _out_ops("tpu")
    assert len(got) == len(exp)
    for g, e in zip(got, exp):
        torch.testing.assert_close(g, e)


# ---- compiled graphs ----

COMPILED_OPS = ["_foreach_copy_.default", "_foreach_mul_.Scalar", "_foreach_add_.List",
                "_foreach_addcmul_.Scalar", "_foreach_lerp_.Scalar", "_foreach_sqrt_.default"]


def _compiled_run(op, pattern, rotate, device, backend):
    numel, make = PATTERNS[pattern]
    gen = torch.Generator().manual_seed(0)
    base = (torch.rand(numel, generator=gen) * 0.8 + 0.1).to(device)
    args, kwargs = _args(op, make(base), rotate, device, gen)
    extra = [] if rotate else args[1:]

    def step(b, *rest):
        views = make(b)
        rest = [views[1:] + views[:1]] + list(args[2:]) if rotate else rest
        op(views, *rest, **kwargs)
        return b * 1

    out = torch.compile(step, backend=backend, fullgraph=True)(base, *extra)
    return base.cpu(), out.cpu()


@pytest.mark.parametrize("name", COMPILED_OPS)
def test_compiled_list_ops_on_views(name):
    """Disjoint views: compiled "tpu" == CPU eager. Overlapping ones (a view and its base, a
    rotated second list): PyTorch's own compiled semantics (aot_autograd's functionalization
    computes every position from the values before the op), checked against CPU aot_eager."""
    packet, overload = name.split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    for pattern in ("split", "chunk_cols", "interleaved", "random1", "base_and_view"):
        for rotate in (False, True):
            if rotate and (pattern not in ("split", "interleaved") or not any(
                    str(a.type) == "List[Tensor]" for a in op._schema.arguments[1:])):
                continue
            torch._dynamo.reset()  # each case is a new graph of the same code object
            try:
                ref = _compiled_run(op, pattern, rotate, "cpu", "aot_eager")
            except torch._dynamo.exc.BackendCompilerFailed as e:
                # PyTorch bans mutating through as_strided views in compile: so must we
                assert "as_strided() is non-compositional" in str(e)
                torch._dynamo.reset()
                with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                                   match="as_strided.. is non-compositional"):
                    _compiled_run(op, pattern, rotate, "tpu", "tpu")
                continue
            torch._dynamo.reset()
            got = _compiled_run(op, pattern, rotate, "tpu", "tpu")
            for g, r in zip(got, ref):
                torch.testing.assert_close(g, r, msg=lambda m: f"{pattern} {rotate}: {m}")
            if pattern in DISJOINT and not rotate:
                torch.testing.assert_close(got[0], _run_list_op(op, pattern, False, "cpu"))


def test_compiled_step_over_views_of_flat_buffers():
    """clip_grad_norm_ + a foreach Adam step compiled, parameters views of one flat buffer."""
    res = {}
    for device, backend in (("cpu", None), ("tpu", "tpu")):
        flat, gflat, params = _flat_params(device, "as_strided")
        opt = torch.optim.Adam(params, lr=0.1, foreach=True)

        def step():
            torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
            opt.step()

        fn = step if backend is None else torch.compile(step, backend=backend)
        for _ in range(2):
            fn()
        res[device] = flat.cpu()
    torch.testing.assert_close(res["tpu"], res["cpu"], rtol=1e-5, atol=1e-5)


# ---- UntypedStorage.resize_ (FSDP2 frees and re-allocates unsharded parameters) ----

@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_storage_resize_frees_and_reallocates(mode):
    import gc

    with torch.tpu.set_eager_mode(MODES[mode]):
        p = torch.randn(256, 1024).to("tpu")
        ref = p.cpu()
        torch.tpu.synchronize()
        gc.collect()
        before = torch.tpu.memory_allocated()
        st = p.untyped_storage()
        st.resize_(0)
        gc.collect()
        freed = before - torch.tpu.memory_allocated()
        assert st.nbytes() == 0 and p.untyped_storage().nbytes() == 0
        assert freed >= 256 * 1024 * 4
        st.resize_(256 * 1024 * 4)
        assert p.untyped_storage().nbytes() == 256 * 1024 * 4
        assert torch.tpu.memory_allocated() - (before - freed) >= 256 * 1024 * 4
        # FSDP2's copy-in into the re-allocated storage through split views
        torch._foreach_copy_(list(p.view(-1).split([1024 * 100, 1024 * 156])),
                             [ref.view(-1)[:1024 * 100].to("tpu"),
                              ref.view(-1)[1024 * 100:].to("tpu")])
        assert torch.equal(p.cpu(), ref)
        # growing keeps the prefix, as on CPU (the rest is uninitialised there)
        q = torch.arange(6.).to("tpu")
        q.untyped_storage().resize_(40)
        assert torch.equal(q.cpu(), torch.arange(6.))
        x = torch.empty(0, device="tpu").set_(q.untyped_storage(), 0, (10,), (1,))
        assert torch.equal(x.cpu()[:6], torch.arange(6.))
        torch.ops.inductor.resize_storage_bytes_(q, 0)
        assert q.untyped_storage().nbytes() == 0
        torch.ops.inductor.resize_storage_bytes_(q, 24)
        assert q.untyped_storage().nbytes() == 24


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_tensor_resize_growth_keeps_views_on_the_storage(mode):
    # Tensor.resize_ past its storage grows that storage in place on CPU: views taken before
    # keep sharing memory with the tensor. A new storage left them on a stale copy (reads missed
    # later writes, writes through them were lost)
    def program(dev):
        r = torch.arange(6., device=dev).view(2, 3)
        v = r[1]
        r.resize_(10)
        r[4] = 99.0  # (r[6:] is uninitialised on CPU)
        seen = v.clone()
        v.mul_(2)
        a = torch.arange(6., device=dev)
        b = a.view(torch.int32)
        b.resize_(9)
        b[7] = 5
        o = torch.zeros(2, device=dev)
        keep = o[:]
        torch.add(torch.ones(5, device=dev), 1, out=o)  # out= growth
        keep.add_(1)
        return (seen, r[:6], r[4:5], a, b[:6], b[7:8], o, keep, r.untyped_storage().nbytes(),
                v.untyped_storage().data_ptr() == r.untyped_storage().data_ptr())

    want = program("cpu")
    with torch.tpu.set_eager_mode(MODES[mode]):
        got = program("tpu")
    for w, g in zip(want, got):
        if isinstance(w, torch.Tensor):
            assert torch.equal(g.cpu(), w), (g, w)
        else:
            assert g == w
