"""In-place writes donate their storage's old array (XLA buffer donation) only where nothing
else can read it, and donation never changes a result.

The main check generates random programs (seeded) that mix views (slices, selects, transposes,
flattening, ``.detach()``, ``.data``), tensors that share one immutable array (a whole-tensor
``copy_`` shares it, ``.to`` the same device returns the tensor), in-place writes of every kind
(elementwise, ``copy_``, ``index_copy_``/``index_add_``/``index_put_``, scatter, masked and slice
assignment, ``fill_``/``zero_``), ``out=`` ops into views, foreach writes over aliasing lists,
the fused AdamW op, tensors saved for backward (a backward that must fail as on CPU when a
saved tensor was overwritten), device Events holding arrays, and value reads in between. Each
program is built and run on CPU first (a candidate op that CPU rejects is dropped), then
replayed on tpu in every executor (Strict, Debug, Fused, torch.compile), and every tensor, every
read value and every gradient is compared with CPU.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from torchtpu.eager import executor
from torchtpu.runtime import buffer as _buffer

MODES = {
    "strict": torch.tpu.EagerMode.DEFER_NEVER,
    "debug": torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
    "fused": torch.tpu.EagerMode.DEFER_AND_FUSE,
}


def _counters():
    return dict(torch.tpu.metrics()["counters"])


def _delta(before, name):
    return _counters().get(name, 0) - before.get(name, 0)


# ---- the random program generator ----

class _Env:
    """The tensors a program has made (index = name), values read on the way, autograd."""

    def __init__(self, device):
        self.device = device
        self.t: list = []
        self.reads: list = []
        self.leaves: list = []
        self.losses: list = []
        self.keep: list = []  # objects holding arrays (Events)


def _bases(env, rng_seed):
    g = torch.Generator().manual_seed(rng_seed)
    dev = env.device
    env.t.append(torch.randn(6, 8, generator=g).to(dev))
    env.t.append(torch.randn(48, generator=g).to(dev))
    env.t.append(torch.randn(4, 5, generator=g, dtype=torch.float64).to(dev))
    env.t.append(torch.randn(3, 4, 5, generator=g).to(dev))


def _floats(env):
    return [i for i, t in enumerate(env.t) if t.is_floating_point() and t.numel() > 0]


def _on(c, env):
    """A program constant on the program's device, never the constant itself (CPU's ``.to``
    would return it, and a later write or ``requires_grad_`` would change the program)."""
    return c.to(env.device) if env.device != "cpu" else c.clone()


def _const(rng, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return torch.randn(shape, generator=g, dtype=dtype)


def _same_shape(env, t, rng):
    """Another tensor of the program with ``t``'s shape (maybe ``t`` itself), or None."""
    cands = [i for i in _floats(env) if tuple(env.t[i].shape) == tuple(t.shape)]
    return rng.choice(cands) if cands else None


def _gen_view(rng, env):
    i = rng.choice(_floats(env))
    t = env.t[i]
    choices = ["detach", "data", "same_to"]
    if t.dim() >= 1 and t.shape[0] > 1:
        a = rng.randrange(t.shape[0] - 1)
        b = rng.randrange(a + 1, t.shape[0] + 1)
        choices += [("slice", a, b), ("step", rng.choice([2, 3])), ("select", a)]
    if t.dim() >= 2:
        choices += ["t", ("narrow", t.dim() - 1, 0, max(1, t.shape[-1] - 1))]
    if t.is_contiguous():
        choices += ["flat"]
    c = rng.choice(choices)

    def op(env):
        x = env.t[i]
        if c == "detach":
            v = x.detach()
        elif c == "data":
            v = x.data
        elif c == "same_to":
            v = x.to(env.device)  # the same tensor
        elif c == "t":
            v = x.transpose(0, -1)
        elif c == "flat":
            v = x.view(-1)
        elif c[0] == "slice":
            v = x[c[1]:c[2]]
        elif c[0] == "step":
            v = x[::c[1]]
        elif c[0] == "select":
            v = x[c[1]]
        else:
            v = x.narrow(c[1], c[2], c[3])
        env.t.append(v)
    return op


def _gen_new(rng, env):
    i = rng.choice(_floats(env))
    c = rng.choice(["clone", "share", "share", "arith"])

    def op(env):
        x = env.t[i]
        if c == "clone":
            env.t.append(x.clone())
        elif c == "share":  # a whole-tensor copy_: on tpu the two storages share one array
            y = torch.empty_like(x)
            y.copy_(x)
            env.t.append(y)
        else:
            env.t.append(x * 1.5 + 0.25)
    return op


def _gen_write(rng, env):
    i = rng.choice(_floats(env))
    t = env.t[i]
    shape = tuple(t.shape)
    kinds = ["add", "mul", "clamp", "fill", "zero", "neg", "binary", "copy", "copy_cast",
             "masked", "out", "foreach"]
    if t.dim() >= 1 and shape[0] >= 1:
        kinds += ["index_copy", "index_add", "index_put", "index_put_acc", "scatter",
                  "scatter_add", "slice_assign", "index_fill", "mask_assign"]
    k = rng.choice(kinds)
    dt = t.dtype
    if k in ("add", "mul"):
        c = rng.choice([0.5, 1.25, -2.0, 3])
        return lambda env: getattr(env.t[i], k + "_")(c)
    if k == "clamp":
        return lambda env: env.t[i].clamp_(-1.0, 1.5)
    if k == "fill":
        c = rng.choice([0.0, 1.0, -3.5])
        return lambda env: env.t[i].fill_(c)
    if k == "zero":
        return lambda env: env.t[i].zero_()
    if k == "neg":
        return lambda env: env.t[i].neg_()
    if k == "binary":
        j = _same_shape(env, t, rng)  # maybe the tensor itself (x.mul_(x))
        f = rng.choice(["add_", "mul_", "sub_", "addcmul_"])
        if f == "addcmul_":
            return lambda env: env.t[i].addcmul_(env.t[j], env.t[j], value=0.5)
        return lambda env: getattr(env.t[i], f)(env.t[j])
    if k in ("copy", "copy_cast"):
        j = _same_shape(env, t, rng)
        if k == "copy_cast" or j is None:
            src = _const(rng, shape, torch.float64 if dt == torch.float32 else torch.float32)
            return lambda env: env.t[i].copy_(_on(src, env))
        return lambda env: env.t[i].copy_(env.t[j])
    if k == "masked":
        c = rng.choice([0.0, 2.0])
        return lambda env: env.t[i].masked_fill_(env.t[i] > 0.3, c)
    if k == "out":
        j = _same_shape(env, t, rng)
        other = _const(rng, shape, dt)
        f = rng.choice([torch.add, torch.mul, torch.maximum])
        return lambda env: f(env.t[j], _on(other, env), out=env.t[i])
    if k == "foreach":
        # a list over tensors of the program: may alias (a view and its base, one tensor twice)
        js = [rng.choice(_floats(env)) for _ in range(rng.randint(1, 3))]
        js = [j for j in js if env.t[j].dtype == env.t[js[0]].dtype]
        f = rng.choice(["add", "mul"])
        c = rng.choice([0.5, 2.0])
        return lambda env: getattr(torch, f"_foreach_{f}_")([env.t[j] for j in js], c)
    n0 = shape[0]
    idx = torch.tensor(rng.sample(range(n0), rng.randint(1, n0)))
    rows = _const(rng, (len(idx),) + shape[1:], dt)
    if k == "index_copy":
        return lambda env: env.t[i].index_copy_(0, _on(idx, env), _on(rows, env))
    if k == "index_add":
        return lambda env: env.t[i].index_add_(0, _on(idx, env), _on(rows, env),
                                               alpha=0.5)
    if k == "index_fill":
        return lambda env: env.t[i].index_fill_(0, _on(idx, env), -1.0)
    if k in ("index_put", "index_put_acc"):
        acc = k == "index_put_acc"
        return lambda env: env.t[i].index_put_((_on(idx, env),), _on(rows, env),
                                               accumulate=acc)
    if k in ("scatter", "scatter_add"):
        index = torch.stack([torch.randperm(n0, generator=torch.Generator().manual_seed(
            rng.randrange(1 << 30)))[:len(idx)] for _ in range(1)])[0]
        index = index.view((-1,) + (1,) * (len(shape) - 1)).expand((len(idx),) + shape[1:])
        index = index.contiguous()
        if k == "scatter":
            return lambda env: env.t[i].scatter_(0, _on(index, env), _on(rows, env))
        return lambda env: env.t[i].scatter_add_(0, _on(index, env), _on(rows, env))
    if k == "slice_assign":
        a = rng.randrange(n0)
        val = _const(rng, (n0 - a,) + shape[1:], dt)

        def op(env):
            env.t[i][a:] = _on(val, env)
        return op
    if k == "mask_assign":
        def op(env):
            x = env.t[i]
            x[x < -0.5] = 0.125
        return op
    raise AssertionError(k)


def _gen_read(rng, env):
    i = rng.choice(_floats(env))

    def op(env):
        x = env.t[i]
        env.reads.append(x.cpu() if env.device != "cpu" else x.clone())
    return op


def _gen_grad(rng, env):
    """A leaf times a tensor of the program: the tensor (through a ``.detach()`` alias that
    shares its version counter) is saved for backward; overwriting it later must make
    backward fail, as on CPU."""
    i = rng.choice(_floats(env))
    w0 = _const(rng, tuple(env.t[i].shape), env.t[i].dtype)

    def op(env):
        w = _on(w0, env).requires_grad_()
        env.leaves.append(w)
        env.losses.append((w * env.t[i].detach()).sum())
    return op


def _gen_event(rng, env):
    def op(env):
        if env.device != "cpu":
            ev = torch.tpu.Event()
            ev.record()  # holds the arrays still being computed: they are not donated
            env.keep.append(ev)
    return op


def _gen_adamw(rng, env):
    """The fused AdamW op on tensors of the program (parameters may share arrays with other
    tensors: ``copy_`` shares); gradients and states are fresh."""
    # contiguous parameters: PyTorch CPU's fused kernel walks a parameter's memory as if it
    # were contiguous (on a step-sliced view it updates the elements between the view's rows)
    cands = [j for j in _floats(env) if env.t[j].dtype == torch.float32
             and env.t[j].is_contiguous()]
    js = sorted(set(rng.sample(cands, min(len(cands), rng.randint(1, 2)))))
    shapes = [tuple(env.t[j].shape) for j in js]
    grads = [_const(rng, s) for s in shapes]
    steps = [torch.tensor(float(rng.randint(1, 5))) for _ in js]

    def op(env):
        ps = [env.t[j] for j in js]
        if len({id(p.untyped_storage()) for p in ps}) != len(ps):
            raise RuntimeError("not for parameters that share a storage")
        d = env.device
        ms = [torch.zeros(s, device=d) + 0.1 for s in shapes]
        vs = [torch.zeros(s, device=d) + 0.2 for s in shapes]
        torch._fused_adamw_(ps, [_on(g, env) for g in grads], ms, vs, [],
                            [_on(s, env) for s in steps], lr=0.01, beta1=0.9, beta2=0.999,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        env.reads.extend([m.cpu() for m in ms] + [v.cpu() for v in vs])
    return op


_GENS = [(_gen_view, 4), (_gen_new, 2), (_gen_write, 9), (_gen_read, 2), (_gen_grad, 1),
         (_gen_event, 1), (_gen_adamw, 1)]


def _generate(seed, n_ops=30, graph=False):
    """A random program (list of ops) that CPU runs without error."""
    rng = random.Random(seed)
    gens = [g for g, w in _GENS for _ in range(w)
            if not (graph and g in (_gen_read, _gen_grad, _gen_event, _gen_adamw))]
    ops: list = []
    tries = 0
    while len(ops) < n_ops and tries < 20 * n_ops:
        tries += 1
        env = _replay(seed, ops, "cpu")
        try:
            cand = rng.choice(gens)(rng, env)
            cand(env)
        except (RuntimeError, IndexError, ValueError, TypeError):
            continue  # CPU rejects it (overlapping writes, shapes...): not part of the program
        ops.append(cand)
    return ops


def _replay(seed, ops, device):
    env = _Env(device)
    _bases(env, seed)
    for op in ops:
        op(env)
    return env


def _finish(env):
    """Backward over the saved products: (gradients, or the error type CPU must match too)."""
    if not env.losses:
        return None
    try:
        sum(env.losses).backward()
    except RuntimeError as e:
        return ("error", "modified by an inplace operation" in str(e))
    return [w.grad.cpu() for w in env.leaves]


def _compare(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def _check_program(seed, mode):
    ops = _generate(seed)
    ref = _replay(seed, ops, "cpu")
    ref_grads = _finish(ref)
    with torch.tpu.set_eager_mode(MODES[mode]):
        env = _replay(seed, ops, "tpu")
        values = [t.cpu() for t in env.t]
        reads = list(env.reads)
        grads = _finish(env)
    for k, (a, b) in enumerate(zip(values, ref.t)):
        _compare(a, b, f"seed {seed} {mode}: tensor {k}")
    assert len(reads) == len(ref.reads)
    for k, (a, b) in enumerate(zip(reads, ref.reads)):
        _compare(a, b, f"seed {seed} {mode}: read {k}")
    if ref_grads is None or isinstance(ref_grads, tuple):
        assert grads == ref_grads, f"seed {seed} {mode}: backward {grads} vs CPU {ref_grads}"
    else:
        for a, b in zip(grads, ref_grads):
            _compare(a, b, f"seed {seed} {mode}: gradient")


# 12 programs per executor by default; --runslow adds 48 more (TORCHTPU_DONATION_SEEDS: more)
SEEDS = [pytest.param(s, marks=pytest.mark.slow) if s >= 12 else s
         for s in range(int(os.environ.get("TORCHTPU_DONATION_SEEDS", "60")))]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", SEEDS)
def test_random_programs_match_cpu(seed, mode):
    if mode == "debug" and seed % 3:
        pytest.skip("Debug mode runs every third seed (the same path as Strict, blocking)")
    _check_program(seed, mode)


def test_random_programs_donate_and_copy():
    """The generated programs exercise both outcomes: donated writes and writes that copy
    because another tensor shares the array (the generator's whole-tensor copy_)."""
    before = _counters()
    for seed in range(6):
        _check_program(seed, "strict")
    assert _delta(before, "eager_donated_writes") > 20
    assert _delta(before, "eager_copied_writes") > 0


@pytest.mark.parametrize("seed", range(3))
def test_random_programs_compiled(seed):
    """The same kind of program (no reads, backward or events inside) as one compiled
    function of its base tensors."""
    ops = _generate(1000 + seed, n_ops=20, graph=True)

    def program(*bases):
        env = _Env(bases[0].device.type)
        env.t.extend(bases)
        for op in ops:
            op(env)
        return env.t

    ref = _replay(1000 + seed, ops, "cpu")
    base_env = _Env("cpu")
    _bases(base_env, 1000 + seed)
    torch._dynamo.reset()
    fn = torch.compile(program, backend="tpu")
    tpu_bases = [b.to("tpu") for b in base_env.t]
    out = fn(*tpu_bases)
    for k, (a, b) in enumerate(zip(out, ref.t)):
        _compare(a.cpu(), b, f"compiled seed {seed}: tensor {k}")
    for k, (a, b) in enumerate(zip(tpu_bases, ref.t)):  # the inputs were written in place
        _compare(a.cpu(), b, f"compiled seed {seed}: input {k}")


# ---- what blocks donation ----

def _arr(t):
    return _buffer.buffer_of(t).array


def _ptr(t):
    """The address of a tensor's storage buffer (no reference kept: holding the array itself
    would block donation)."""
    return _arr(t).unsafe_buffer_pointer()


def test_write_donates_the_old_array():
    x = torch.arange(12.0, device="tpu")
    before_ptr = _ptr(x)
    before = _counters()
    x[3:5].add_(1.0)
    assert _delta(before, "eager_donated_writes") == 1
    assert _ptr(x) == before_ptr  # written in place: the new array is the old buffer
    assert x.cpu().tolist() == [0, 1, 2, 4, 5, 5, 6, 7, 8, 9, 10, 11]


def test_array_shared_by_another_storage_is_copied():
    x = torch.arange(6.0, device="tpu")
    y = torch.empty_like(x)
    y.copy_(x)  # y's storage holds x's immutable array
    assert _arr(y) is _arr(x)
    before = _counters()
    y[1:3].fill_(-1.0)
    assert _delta(before, "eager_donated_writes") == 0
    assert torch.tpu.metrics()["per_op"]["eager_copied_writes"].get("shared", 0) >= 1
    assert x.cpu().tolist() == [0, 1, 2, 3, 4, 5]
    assert y.cpu().tolist() == [0, -1, -1, 3, 4, 5]
    before = _counters()
    y[4:].fill_(7.0)  # now y has its own array: donated
    assert _delta(before, "eager_donated_writes") == 1
    assert y.cpu().tolist() == [0, -1, -1, 3, 7, 7]


def test_views_and_detach_share_the_buffer_not_a_copy():
    x = torch.zeros(4, 4, device="tpu")
    v, d, p = x[1], x.detach(), x.data
    before = _counters()
    v.add_(2.0)
    d[:, 0].mul_(3.0)
    p[3, 3] = 5.0
    assert _delta(before, "eager_donated_writes") == 3
    want = torch.zeros(4, 4)
    want[1] += 2
    want[:, 0] *= 3
    want[3, 3] = 5
    for t in (x, d, p):
        assert torch.equal(t.cpu(), want)
    assert torch.equal(v.cpu(), want[1])


def test_user_jax_array_blocks_donation():
    x = torch.arange(5.0, device="tpu")
    held = _arr(x)  # a user's reference to the storage's array (torch.tpu <-> jax interop)
    x.mul_(2.0)
    assert not held.is_deleted()
    assert np.asarray(held).tolist() == [0, 1, 2, 3, 4]
    assert x.cpu().tolist() == [0, 2, 4, 6, 8]


def test_numpy_view_of_the_array_blocks_donation():
    """A zero-copy numpy view (XLA:CPU) holds the array (through a memoryview): copied."""
    x = torch.arange(4.0, device="tpu")
    view = np.asarray(_arr(x))
    before = _counters()
    x.add_(10.0)
    assert _delta(before, "eager_donated_writes") == 0
    assert view.tolist() == [0, 1, 2, 3]
    assert x.cpu().tolist() == [10, 11, 12, 13]


def test_dlpack_export_is_refused_by_pjrt_silently():
    """A DLPack export holds the buffer without a Python reference to the array: donation is
    requested, PJRT refuses a buffer with external references and copies (no error), and the
    exported CPU tensor keeps the old value."""
    x = torch.arange(4.0, device="tpu")
    exported = torch.utils.dlpack.from_dlpack(_arr(x))
    before = _counters()
    x.add_(10.0)
    assert _delta(before, "eager_donated_writes") == 1
    assert exported.tolist() == [0, 1, 2, 3]
    assert x.cpu().tolist() == [10, 11, 12, 13]
    x.mul_(2.0)
    assert exported.tolist() == [0, 1, 2, 3]
    assert x.cpu().tolist() == [20, 22, 24, 26]


def test_same_array_twice_in_one_call():
    x = torch.arange(1.0, 5.0, device="tpu")
    before = _counters()
    x.mul_(x)  # the written array is also read: passed once to the donating program
    x.addcmul_(x, x, value=-1.0)
    assert _delta(before, "eager_donated_writes") == 2
    c = torch.arange(1.0, 5.0)
    c.mul_(c)
    c.addcmul_(c, c, value=-1.0)
    assert torch.equal(x.cpu(), c)


def test_pending_fused_graph_input_is_not_donated():
    x = torch.arange(6.0, device="tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        y = x * 2  # recorded: the graph captured x's array as an input
        executor.run_strict(executor.copy_lowering(), executor.DIRECT_INPLACE,
                            (x[2:4], torch.full((2,), -1.0, device="tpu")), {})
        assert y.cpu().tolist() == [0, 2, 4, 6, 8, 10]
    assert x.cpu().tolist() == [0, 1, -1, -1, 4, 5]


def test_event_snapshot_is_not_donated():
    x = torch.arange(6.0, device="tpu") + 0
    ev = torch.tpu.Event()
    ev.record()
    x.add_(1.0)
    ev.synchronize()
    assert ev.query()
    assert x.cpu().tolist() == [1, 2, 3, 4, 5, 6]


def test_saved_for_backward_overwritten_raises_like_cpu():
    for dev in ("cpu", "tpu"):
        w = torch.ones(3, device=dev, requires_grad=True)
        a = torch.arange(3.0, device=dev)
        loss = (w * a).sum()
        a.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_disabled_by_environment():
    code = textwrap.dedent("""
        import torch
        x = torch.zeros(8, device="tpu")
        x[2:4].add_(1.0)
        c = torch.tpu.metrics()
        assert c["counters"].get("eager_donated_writes", 0) == 0, c
        assert c["per_op"]["eager_copied_writes"] == {"disabled": 1}, c
        assert x.cpu().tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
        print("ok")
    """)
    env = dict(os.environ, TORCHTPU_DONATE="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_fused_adamw_donates_parameters_and_states():
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(5, 3, generator=gen) for _ in range(3)]
    gs = [torch.randn(5, 3, generator=gen) for _ in range(3)]
    res = {}
    for dev in ("cpu", "tpu"):
        # "+ 0": a buffer XLA allocated (a transferred tensor's buffer may wrap the host
        # staging copy on XLA:CPU, which PJRT does not donate: that first write copies)
        p = [x.clone().to(dev) + 0 for x in ps]
        m = [torch.zeros(5, 3, device=dev) for _ in ps]
        v = [torch.zeros(5, 3, device=dev) for _ in ps]
        ptrs = [_ptr(x) for x in p + m + v] if dev == "tpu" else []
        before = _counters()
        torch._fused_adamw_(p, [g.to(dev) for g in gs], m, v, [],
                            [torch.tensor(1.0, device=dev) for _ in ps], lr=0.01, beta1=0.9,
                            beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False,
                            maximize=False)
        if dev == "tpu":
            assert _delta(before, "eager_donated_writes") == 9  # 3 params, 3 m, 3 v
            assert [_ptr(x) for x in p + m + v] == ptrs  # updated in place
        res[dev] = [x.cpu() for x in p + m + v]
    for a, b in zip(res["tpu"], res["cpu"]):
        torch.testing.assert_close(a, b)


def test_write_cost_does_not_grow_with_the_storage():
    """A KV-cache-style write of 2 rows: donated, in place (the storage's buffer is reused),
    whatever the storage's size (its time is measured in benchmarks/inplace_writes.py)."""
    for rows in (16, 256):
        cache = torch.zeros(rows, 1024, device="tpu")
        idx = torch.tensor([3, 7], device="tpu")
        ptr = _ptr(cache)
        before = _counters()
        cache.index_copy_(0, idx, torch.ones(2, 1024, device="tpu"))
        cache[8:10].copy_(torch.ones(2, 1024, device="tpu"))
        assert _delta(before, "eager_donated_writes") == 2
        assert _delta(before, "eager_copied_writes") == 0
        assert _ptr(cache) == ptr
        assert cache.sum().item() == 4096


def test_second_process_loads_donating_programs_and_still_writes_in_place(tmp_path):
    """Donating variants persist like every eager program: a second process compiles nothing
    and its writes are still in place (the executable loaded from disk keeps the aliasing)."""
    code = textwrap.dedent("""
        import json, torch
        from torchtpu.runtime import buffer
        ptr = lambda t: buffer.buffer_of(t).array.unsafe_buffer_pointer()
        x = torch.zeros(64, 256, device="tpu")
        idx = torch.tensor([1, 5], device="tpu")
        p0 = ptr(x)
        x.index_copy_(0, idx, torch.ones(2, 256, device="tpu"))
        x[10:12].copy_(torch.full((2, 256), 2.0, device="tpu"))
        x[20:22].mul_(x[1:3])
        same = ptr(x) == p0
        total = x.sum().item()
        c = torch.tpu.metrics()["counters"]
        print(json.dumps({"same": same, "total": total, "compiles": c.get("eager_xla_compiles", 0),
                          "hits": c.get("eager_disk_cache_hits", 0),
                          "donated": c.get("eager_donated_writes", 0)}))
    """)
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path), TORCHTPU_PREFETCH_THREADS="0")
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiles"] > 0 and second["compiles"] == 0, runs
    assert second["hits"] > 0 and second["donated"] == first["donated"] == 3, runs
    assert first["same"] and second["same"], runs  # in place in both processes
    assert first["total"] == second["total"] == 2 * 256 + 4 * 256


# ---- memory: an AdamW step needs no second copy of its parameters ----

_ADAMW = textwrap.dedent("""
    import json, sys, time, torch
    MiB = 1 << 20
    n_params, mib, impl = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    def settle():  # XLA:CPU frees dead buffers on a runtime thread, shortly after a sync
        last = None
        for _ in range(50):
            now = status("VmRSS")
            if last is not None and abs(now - last) < 4 * MiB:
                return now
            last = now
            time.sleep(0.1)
        return last

    n = mib * MiB // 4
    params = [torch.nn.Parameter(torch.empty(n, device="tpu").normal_()) for _ in range(n_params)]
    for p in params:
        p.grad = torch.empty(n, device="tpu").normal_()
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=impl == "foreach",
                            fused=(impl == "fused") or None)
    opt.step()  # creates the states, compiles
    torch.tpu.synchronize()
    before = settle()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM
    opt.step()
    torch.tpu.synchronize()
    print(json.dumps({"extra_mib": (status("VmHWM") - before) / MiB,
                      "donated": torch.tpu.metrics()["counters"].get("eager_donated_writes", 0)}))
""")


def _adamw_extra(n_params, mib, impl):
    r = subprocess.run([sys.executable, "-c", _ADAMW, str(n_params), str(mib), impl],
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, TORCHTPU_PREFETCH_THREADS="0"))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _clear_refs_works():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _clear_refs_works(), reason="needs /proc/self/clear_refs (Linux) to "
                    "reset the peak resident size")
@pytest.mark.parametrize("n_params,mib", [(8, 16), pytest.param(8, 128, marks=pytest.mark.slow)])
def test_adamw_step_peak_memory(n_params, mib):
    """The peak resident memory of a steady AdamW step over the parameters, measured in a fresh
    process: the fused step updates parameters and states in place (CUDA's budget: one
    parameter's worth of temporaries at most), the foreach step needs what PyTorch's foreach
    code allocates (one list of temporaries: exp_avg_sq's square roots). Before donation the
    fused step held a second copy of parameters and states (+4 x the parameters at 8 x 128 MiB)
    and the foreach step two lists."""
    fused = _adamw_extra(n_params, mib, "fused")
    assert fused["donated"] > 0
    assert fused["extra_mib"] <= mib + 24, fused
    foreach = _adamw_extra(n_params, mib, "foreach")
    assert foreach["extra_mib"] <= n_params * mib + mib + 24, foreach


# ---- compiled graphs returning what they write ----

def test_compiled_output_that_is_written_input_is_not_recomputed():
    """``return x.index_copy_(...)`` and ``return x[2:4].fill_(v)``: the graph's output is the
    written input's new value or a view of it; the runtime returns those (XLA:CPU copied the
    whole donated buffer to compute them as extra outputs). Values and aliasing as eager."""
    from torchtpu.compile import backend

    made = []
    orig = backend.CompiledGraph._compile

    def spy(self, *a, **k):
        entry = orig(self, *a, **k)
        made.append(entry)
        return entry

    backend.CompiledGraph._compile = spy
    try:
        torch._dynamo.reset()
        idx = torch.tensor([1, 3])
        for dev in ("cpu", "tpu"):
            x = torch.zeros(6, 4, device=dev)
            f = torch.compile(lambda x, i, s: x.index_copy_(0, i, s),
                              backend="tpu" if dev == "tpu" else "eager")
            out = f(x, idx.to(dev), torch.ones(2, 4, device=dev))
            g = torch.compile(lambda x: x[4:6].fill_(3.0),
                              backend="tpu" if dev == "tpu" else "eager")
            view = g(x)
            view.add_(1.0)  # a view of x, as in eager
            if dev == "cpu":
                want = (out.clone(), x.clone())
            else:
                torch.testing.assert_close(out.cpu(), want[0])
                torch.testing.assert_close(x.cpu(), want[1])
        kinds = [k for e in made for k, _ in e.consts[0]]
        assert "new" in kinds or "input" in kinds, kinds
        assert "mutview" in kinds, kinds
        assert "array" not in kinds, kinds  # no output computed as an XLA output
    finally:
        backend.CompiledGraph._compile = orig
        torch._dynamo.reset()


def test_row_write_program_has_no_buffer_copy():
    """The program writing rows 2-3 of a donated (64, 1024) storage updates it in place: its
    optimized HLO has no copy (through the flattened array it copied the whole buffer)."""
    import jax
    from torchtpu.eager import views

    x = torch.zeros(64, 1024, device="tpu")
    arr = _arr(x)
    spec, off = views.spec_of(x[2:4], arr)
    assert spec == ("c", (2, 1024), 1024) and off == 2048
    for sp in (spec, ("c", (2, 1024))):
        fn = jax.jit(lambda a, o, v, sp=sp: views.write(a, sp, o, v), donate_argnums=0)
        text = fn.lower(arr, off, jax.numpy.ones((2, 1024))).compile().as_text()
        has_copy = " copy(" in text
        assert has_copy == (sp is not spec), (sp, text[-1500:])
    box, off = views.spec_of(x[:, :8], arr)
    assert box[0] == "k" and box[3] == (64, 1024)  # the box is the array's own shape
    fn = jax.jit(lambda a, o: views.write(a, box, o, views.read(a, box, o) * 2.0),
                 donate_argnums=0)
    assert " copy(" not in fn.lower(arr, off).compile().as_text()
