"""torch.compile(backend="tpu"): results match PyTorch on CPU; caches, mutation, RNG, options.

Small models only: every test compiles a few XLA programs on a 2-core machine.
"""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from torchtpu.runtime.metrics import COUNTERS

TPU = torch.device("tpu")


def _files(root, aot: bool):
    """Cache files: compiled-graph XLA entries, or (``aot``) AOTAutogradCache entries (not the
    eager programs' entries, named ``p...``, runtime/program_cache.py)."""
    return [os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns
            if (os.sep + "aot" + os.sep in d + os.sep) == aot and (aot or not n.startswith("p"))]


def _run_twice(code: str, cache_dir):
    """Run ``code`` in two fresh processes sharing one cache folder; each run's stdout lines."""
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(cache_dir))
    return [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.split("\n") for _ in range(2)]


def _new_process():
    """Forget this process's compiled graphs, as a new process would."""
    from torchtpu.compile import cache

    torch._dynamo.reset()
    cache._MEMO.clear()


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "xla-cache"))
    _new_process()
    yield
    torch._dynamo.reset()


def _pair(make, seed=0):
    torch.manual_seed(seed)
    cpu = make()
    tpu = make().to(TPU)
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu


def _close(a, b, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(b.detach().cpu(), a.detach(), atol=atol, rtol=rtol)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _bn_net():
    # no bias before BatchNorm: its gradient is ~0 and Adam would amplify rounding noise
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode"])
def test_inference_matches_cpu(ctx):
    cpu, tpu = _pair(_bn_net)
    cpu.eval()
    tpu.eval()
    x = torch.randn(5, 8)
    cm = torch.compile(tpu, backend="tpu")
    manager = torch.no_grad if ctx == "no_grad" else torch.inference_mode
    with manager():
        _close(cpu(x), cm(x.to(TPU)))
        _close(cpu(2 * x), cm((2 * x).to(TPU)))


def test_training_forward_backward_matches_cpu():
    cpu, tpu = _pair(_mlp)
    x = torch.randn(6, 8)
    cm = torch.compile(tpu, backend="tpu")
    out_c = cpu(x)
    out_t = cm(x.to(TPU))
    _close(out_c, out_t)
    out_c.square().sum().backward()
    out_t.square().sum().backward()
    for pc, pt in zip(cpu.parameters(), tpu.parameters()):
        _close(pc.grad, pt.grad, atol=1e-5, rtol=1e-4)
    assert COUNTERS["compile_graphs"] >= 2  # forward and backward graphs


def _train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def test_full_step_with_foreach_adamw_matches_cpu_and_donates():
    cpu, tpu = _pair(_bn_net)
    opt_c = torch.optim.AdamW(cpu.parameters(), lr=1e-2, foreach=True)
    opt_t = torch.optim.AdamW(tpu.parameters(), lr=1e-2, foreach=True)
    step = torch.compile(_train_step, backend="tpu")
    donated0 = COUNTERS["compile_donated_buffers"]
    for i in range(3):
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        lc = _train_step(cpu, opt_c, x, y)
        lt = step(tpu, opt_t, x.to(TPU), y.to(TPU))
        _close(lc, lt, atol=1e-5, rtol=1e-4)
    for (k, a), (_, b) in zip(cpu.state_dict().items(), tpu.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4, msg=lambda m: f"{k}: {m}")
    # optimizer state and BatchNorm statistics are overwritten in place: their buffers are donated
    assert COUNTERS["compile_donated_buffers"] > donated0


def test_donated_input_buffer_is_reused_and_other_holders_are_safe():
    from torchtpu.runtime.buffer import buffer_of

    @torch.compile(backend="tpu")
    def bump(state, x):
        state.add_(x)
        return state * 2

    s = torch.zeros(4, device=TPU)
    x = torch.ones(4, device=TPU)
    old = buffer_of(s).array
    del old  # only the tensor holds the buffer: it may be donated
    bump(s, x)
    bump(s, x)
    _close(torch.full((4,), 2.0), s)
    # a second tensor sharing the same jax array (copy_ shares immutable arrays) stays valid
    t = torch.empty(4, device=TPU)
    t.copy_(s)
    out = bump(s, x)
    _close(torch.full((4,), 2.0), t)
    _close(torch.full((4,), 3.0), s)
    _close(torch.full((4,), 6.0), out)


def test_whole_walk_serves_repeated_calls_and_still_donates():
    """A graph called again with every input a tpu tensor's whole array (a static-cache decode
    step) checks its inputs against the last call's instead of walking them afresh
    (CompiledGraph._walk_whole); results, writes and donation are those of the full walk."""
    from torchtpu.compile import backend

    def step(cache, w, x, pos):
        cache.index_copy_(0, pos, x)
        return (cache * w).sum(0)

    comp = torch.compile(step, backend="tpu")
    cache_c, w = torch.zeros(8, 4), torch.randn(8, 4)
    cache_t, w_t = cache_c.to(TPU), w.to(TPU)
    walks0 = COUNTERS["compile_whole_walks"]
    donated0 = COUNTERS["compile_donated_buffers"]
    for i in range(5):
        x, pos = torch.randn(1, 4), torch.tensor([i])
        want = step(cache_c, w, x, pos)
        got = comp(cache_t, w_t, x.to(TPU), pos.to(TPU))
        _close(want, got)
        assert torch.equal(cache_t.cpu(), cache_c)
    assert backend.WHOLE_WALK
    assert COUNTERS["compile_whole_walks"] - walks0 >= 3
    assert COUNTERS["compile_donated_buffers"] - donated0 >= 3  # the cache, in place


def test_whole_walk_falls_back_when_an_input_changes():
    """Inputs that are no longer their storages' whole arrays (an offset or transposed view, a
    CPU tensor), another shape, or another matmul precision take the full walk: same results
    as fresh whole-array inputs, and the whole walk did not serve them."""
    from torchtpu.compile import backend

    seen = []
    orig = backend.CompiledGraph.__call__

    def spy(self, args):
        seen.append(self)
        return orig(self, args)

    def f(a, b):
        return a @ b + a.sum()

    comp = torch.compile(f, backend="tpu")
    a, b = torch.randn(4, 4), torch.randn(4, 3)
    backend.CompiledGraph.__call__ = spy
    try:
        for _ in range(3):
            comp(a.to(TPU), b.to(TPU))
    finally:
        backend.CompiledGraph.__call__ = orig
    g = seen[-1]
    assert g._whole_sig is not None

    def run(args):
        out = g(list(args))
        return (out[0] if isinstance(out, (list, tuple)) else out).cpu()

    want = run([a.to(TPU), b.to(TPU)])
    _close(f(a, b), want)
    big = torch.zeros(20, device=TPU)
    big[4:].copy_(a.flatten().to(TPU))
    offset_view = big[4:].view(4, 4)
    transposed = a.t().contiguous().to(TPU).t()
    variants = [
        [offset_view, b.to(TPU)],
        [transposed, b.to(TPU)],
        [a, b.to(TPU)],  # a CPU tensor
        [a.to(TPU), b.to(TPU)[:, :2]],  # another shape (and a view)
    ]
    for i, args in enumerate(variants):
        walks0 = COUNTERS["compile_whole_walks"]
        got = run(args)
        assert COUNTERS["compile_whole_walks"] == walks0, i
        ref = want if i < 3 else run([a.to(TPU), b[:, :2].contiguous().to(TPU)])
        assert torch.equal(got, ref), i
    # back to whole arrays of the first signature: served again
    run([a.to(TPU), b.to(TPU)])
    walks0 = COUNTERS["compile_whole_walks"]
    assert torch.equal(run([a.to(TPU), b.to(TPU)]), want)
    assert COUNTERS["compile_whole_walks"] == walks0 + 1
    # another matmul precision is another program: never the last call's entry
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        walks0 = COUNTERS["compile_whole_walks"]
        run([a.to(TPU), b.to(TPU)])
        assert COUNTERS["compile_whole_walks"] == walks0
        keys = {k[0][-1] for k in g.entries}
        assert ("precision", "default") in keys and ("precision", "highest") in keys
    finally:
        torch.set_float32_matmul_precision(prev)


def test_whole_walk_matches_the_full_walk_bit_for_bit():
    from torchtpu.compile import backend

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).to(TPU)
    comp = torch.compile(m, backend="tpu")
    xs = [torch.randn(3, 8) for _ in range(4)]
    outs = {}
    for flag in (False, True):
        backend.WHOLE_WALK = flag
        try:
            outs[flag] = [comp(x.to(TPU)).cpu() for x in xs]
        finally:
            backend.WHOLE_WALK = True
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


def test_graph_break_and_fullgraph_error():
    def f(x):
        y = x.sin() * 2
        torch._dynamo.graph_break()
        return y + x.cos()

    x = torch.randn(7)
    before = COUNTERS["compile_graphs"]
    _close(f(x), torch.compile(f, backend="tpu")(x.to(TPU)))
    assert COUNTERS["compile_graphs"] - before == 2
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="graph_break"):
        torch.compile(f, backend="tpu", fullgraph=True)(x.to(TPU))


def test_dropout_reproducible_and_same_as_eager():
    def f(x):
        return torch.nn.functional.dropout(x, p=0.5, training=True) * 3

    cf = torch.compile(f, backend="tpu")
    x = torch.randn(64, device=TPU)
    torch.manual_seed(123)
    a = cf(x).cpu()
    b = cf(x).cpu()
    torch.manual_seed(123)
    a2 = cf(x).cpu()
    torch.manual_seed(123)
    e = f(x).cpu()
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)  # the generator advances between steps
    assert torch.equal(a, e)  # compiled or not, the same seed gives the same mask
    kept = a != 0
    torch.testing.assert_close(a[kept], (x.cpu() * 6)[kept])


def test_recompiles_only_on_new_shapes_or_dtypes():
    @torch.compile(backend="tpu")
    def f(x):
        return (x * 2).sum(0)

    c0 = COUNTERS["xla_compiles"]
    f(torch.randn(3, 4, device=TPU))
    f(torch.randn(3, 4, device=TPU))
    assert COUNTERS["xla_compiles"] - c0 == 1
    f(torch.randn(5, 4, device=TPU))
    assert COUNTERS["xla_compiles"] - c0 == 2
    out = f(torch.randn(5, 4, device=TPU, dtype=torch.float64))
    assert out.dtype == torch.float64
    assert COUNTERS["xla_compiles"] - c0 == 3


def test_mark_dynamic_is_specialised_with_a_message():
    # cumsum over the dynamic dim: neither position-wise nor masked (compile/masking.py)
    @torch.compile(backend="tpu", dynamic=True)
    def f(x):
        return x.cumsum(0) + x.shape[0]

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for n in (3, 5):
            x = torch.randn(n, 2)
            _close(x.cumsum(0) + n, f(x.to(TPU)))
    assert any("specialised" in str(m.message) for m in w)


@pytest.mark.parametrize("cache", [True, False])
def test_dynamic_training_graph_runs_backward(cache, monkeypatch):
    """A graph with symbolic sizes saves SymInts for its backward, so aot_autograd compiles
    the backward right away and wraps it in Dynamo's disable(): the wrapper must still call it
    with the boxed convention (with and without the persistent cache)."""
    if not cache:
        monkeypatch.setenv("TORCHTPU_CACHE_DIR", "")
    torch.manual_seed(0)
    cpu, tpu = _pair(_mlp)
    f = torch.compile(lambda x: tpu(x).relu().sum(), backend="tpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (3, 5):
            x = torch.randn(n, 8)
            xt = x.to(TPU)
            torch._dynamo.mark_dynamic(xt, 0)
            ref = cpu(x).relu().sum()
            out = f(xt)
            _close(ref, out)
            ref.backward()
            out.backward()
    for p_cpu, p_tpu in zip(cpu.parameters(), tpu.parameters()):
        _close(p_cpu.grad, p_tpu.grad)


def test_mode_and_unknown_options_are_ignored_with_warning():
    cpu, tpu = _pair(_mlp)
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match="does not apply"):
        cm = torch.compile(tpu, backend="tpu", options={"triton.cudagraphs": True})
        _close(cpu(x), cm(x.to(TPU)))
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="max-autotune"):
        cm = torch.compile(tpu, backend="tpu", mode="max-autotune")
        _close(cpu(x), cm(x.to(TPU)))


def test_default_backend_is_tpu_for_tpu_inputs():
    cpu, tpu = _pair(_mlp)
    x = torch.randn(3, 8)
    before = COUNTERS["compile_graphs"]
    _close(cpu(x), torch.compile(tpu)(x.to(TPU)))  # a module on tpu
    # its forward and (compiled eagerly, for the AOTAutograd cache) its backward
    assert COUNTERS["compile_graphs"] - before == 2

    def f(a):
        return a.exp() + 1

    before = COUNTERS["compile_graphs"]
    _close(f(x), torch.compile(f)(x.to(TPU)))  # a function with tpu inputs
    assert COUNTERS["compile_graphs"] - before == 1  # inference graph


def test_objects_from_before_a_compile_are_frozen_while_it_runs_and_released_after():
    """The garbage collector's passes during a Dynamo compile skip the objects that existed
    before it (gc.freeze), which are put back when it ends; a process's own freeze is kept."""
    import gc

    from torchtpu.compile.backend import tpu_backend

    torch._dynamo.reset()  # clears Dynamo's compile callbacks: torch.compile installs them again
    x = torch.randn(8)
    before = COUNTERS["compile_gc_freezes"]
    out = torch.compile(lambda a: a.exp() + 2, backend="tpu")(x.to(TPU))
    assert COUNTERS["compile_gc_freezes"] - before == 1
    assert gc.get_freeze_count() == 0
    _close(x.exp() + 2, out)
    seen = []

    def backend(gm, example_inputs):
        seen.append(gc.get_freeze_count())
        return tpu_backend(gm, example_inputs)

    before = COUNTERS["compile_gc_freezes"]
    out = torch.compile(lambda a: a * 2 + 1, backend=backend)(x.to(TPU))
    assert len(seen) == 1 and seen[0] > 0  # frozen while Dynamo compiled
    assert gc.get_freeze_count() == 0  # and put back after
    assert COUNTERS["compile_gc_freezes"] - before == 1
    assert torch.equal(out.cpu(), x * 2 + 1)
    gc.freeze()  # the process's own freeze: neither added to nor released
    try:
        n = gc.get_freeze_count()  # objects freed since leave the permanent generation
        seen.clear()
        before = COUNTERS["compile_gc_freezes"]
        out = torch.compile(lambda a: a - 3, backend=backend)(x.to(TPU))
        assert len(seen) == 1 and n // 2 < seen[0] <= n
        assert n // 2 < gc.get_freeze_count() <= n  # still frozen
        assert COUNTERS["compile_gc_freezes"] == before
        assert torch.equal(out.cpu(), x - 3)
    finally:
        gc.unfreeze()


def test_torch_source_hash_is_kept_in_the_cache_folder_under_a_stamp_of_the_files(tmp_path,
                                                                                monkeypatch):
    """AOTAutogradCache's key hashes PyTorch's source (torch_key, ~0.2 s a process): a later
    process takes it from the cache folder while the torch files are unchanged."""
    from torch._inductor import codecache

    from torchtpu.compile import aot_cache

    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "c"))
    real = codecache.torch_key()
    calls = []
    orig = codecache.torch_key

    def counted():
        calls.append(1)
        return orig()

    for k in ("set", "clear", "prefetch"):
        setattr(counted, k, getattr(orig, k))
    monkeypatch.setattr(codecache, "torch_key", counted)
    try:
        for stored in (False, True):  # the first process computes and stores, the next loads
            orig.clear()
            monkeypatch.setattr(aot_cache, "_torch_key_primed", [False])
            before = (COUNTERS["aot_torch_key_loads"], COUNTERS["aot_torch_key_stores"])
            calls.clear()
            aot_cache._prime_torch_key()
            assert orig() == real
            after = (COUNTERS["aot_torch_key_loads"], COUNTERS["aot_torch_key_stores"])
            assert (after[0] - before[0], after[1] - before[1]) == ((1, 0) if stored else (0, 1))
            assert len(calls) == (0 if stored else 1)
    finally:
        orig.clear()
        orig.set(real)
    # the stamp changes with any importable file's size, time, presence or name in a package
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "__init__.py").write_text("")
    f = root / "sub" / "m.py"
    f.write_text("x = 1\n")
    (root / "notes.txt").write_text("not importable")
    stamps = [aot_cache._torch_stamp(str(root), [])]
    (root / "notes.txt").write_text("not importable, changed")
    assert aot_cache._torch_stamp(str(root), []) == stamps[0]
    f.write_text("x = 22\n")
    stamps.append(aot_cache._torch_stamp(str(root), []))
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    stamps.append(aot_cache._torch_stamp(str(root), []))
    (root / "sub" / "n.so").write_bytes(b"")
    stamps.append(aot_cache._torch_stamp(str(root), []))
    os.rename(root / "sub" / "n.so", root / "sub" / "o.so")
    stamps.append(aot_cache._torch_stamp(str(root), []))
    stamps.append(aot_cache._torch_stamp(str(root), [str(root / "notes.txt")]))
    assert len(set(stamps)) == len(stamps)


def test_torch_stamp_covers_every_file_torch_key_reads_and_skips_other_folders(tmp_path):
    """The stamp walks packages only (``build_code_hash`` descends into nothing else): a change
    that changes PyTorch's own hash of a tree changes the stamp; a folder that is no package
    (C++ headers, ``__pycache__``) is not walked until it becomes one."""
    import hashlib

    from torch._inductor import codecache

    from torchtpu.compile import aot_cache

    root = tmp_path / "pkg"

    def both():
        h = hashlib.sha256()
        codecache.build_code_hash([str(root)], "", h)
        return h.hexdigest(), aot_cache._torch_stamp(str(root), [])

    (root / "a" / "b").mkdir(parents=True)
    (root / "include" / "deep").mkdir(parents=True)
    (root / "__pycache__").mkdir()
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("")
    (root / "a" / "b" / "__init__.py").write_text("")
    (root / "a" / "b" / "m.py").write_text("x = 1\n")
    (root / "include" / "deep" / "h.py").write_text("y = 1\n")
    (root / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"1")
    seen = [both()]
    for change in (lambda: (root / "a" / "b" / "m.py").write_text("x = 22\n"),
                   lambda: (root / "a" / "b" / "n.py").write_text(""),
                   lambda: (root / "a" / "b" / "n.py").rename(root / "a" / "b" / "o.py"),
                   lambda: (root / "include" / "deep" / "h.py").write_text("y = 22\n"),
                   lambda: (root / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"22"),
                   lambda: (root / "include" / "__init__.py").write_text(""),
                   lambda: (root / "include" / "deep" / "__init__.py").write_text(""),
                   lambda: (root / "include" / "deep" / "h.py").write_text("y = 333\n"),
                   lambda: (root / "a" / "b" / "__init__.py").unlink()):
        change()
        now = both()
        if now[0] != seen[-1][0]:  # PyTorch's hash changed: so must the stamp
            assert now[1] != seen[-1][1]
        seen.append(now)
    # the C++-header-like folder and __pycache__ left the stamp alone while no package
    assert seen[4][1] == seen[3][1] and seen[5][1] == seen[4][1]
    # and torch's hash did change on every other step here (so the check above was exercised)
    assert all(seen[i][0] != seen[i - 1][0] for i in (1, 2, 3, 7, 8, 9))


def test_persistent_cache_hit_and_corrupt_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "c"))

    def f(x):
        return (x @ x.T).tanh()

    x = torch.randn(4, 4)
    ref = f(x)
    _close(ref, torch.compile(f, backend="tpu")(x.to(TPU)))
    files = _files(tmp_path / "c", aot=False)
    assert len(files) == 2  # the executable under its graph key and under its HLO key
    assert len(_files(tmp_path / "c", aot=True)) == 1  # aot_autograd's result
    _new_process()
    hits, compiles = COUNTERS["compile_disk_cache_hits"], COUNTERS["xla_compiles"]
    _close(ref, torch.compile(f, backend="tpu")(x.to(TPU)))
    assert COUNTERS["compile_disk_cache_hits"] == hits + 1
    assert COUNTERS["xla_compiles"] == compiles
    for name in files:  # corrupt the entries
        with open(name, "r+b") as fh:
            fh.seek(60)
            fh.write(b"garbage" * 20)
    _new_process()
    errors = COUNTERS["compile_disk_cache_errors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(ref, torch.compile(f, backend="tpu")(x.to(TPU)))
    assert COUNTERS["compile_disk_cache_errors"] == errors + 2
    assert COUNTERS["xla_compiles"] == compiles + 1
    _new_process()  # the rebuilt entries are good again
    _close(ref, torch.compile(f, backend="tpu")(x.to(TPU)))
    assert COUNTERS["xla_compiles"] == compiles + 1


def test_persistent_cache_across_processes(tmp_path):
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: (x * 3).sin(), backend='tpu')\n"
        "print(float(f(torch.ones(3, device='tpu')).sum().cpu()))\n"
        "c = torch.tpu.metrics()['counters']\n"
        "print(c.get('xla_compiles', 0), c.get('compile_disk_cache_hits', 0),\n"
        "      c.get('compile_traces', 0), c.get('aot_cache_hits', 0))\n")
    runs = _run_twice(code, tmp_path / "p")
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == "1 0 1 0"
    # aot_autograd's result and the graph entry hit: no aot trace, no JAX trace, no XLA compile
    assert runs[1][1] == "0 1 0 1"


def test_aot_cache_key_skips_inductor_backends_and_still_tells_graphs_apart(tmp_path):
    """AOTAutogradCache's key is computed without registering Inductor's code generators (their
    imports were ~1 s of a warm start) and does not depend on whether the process registered
    them: a process that used Inductor first still hits. A changed shape or a changed constant
    in the function is a miss, traced again, with the right values."""
    code = (
        "import sys, torch\n"
        "from torch._inductor.codegen import common\n"
        "if sys.argv[1] == 'inductor':\n"
        "    common.init_backend_registration()\n"
        "n, k = int(sys.argv[2]), int(sys.argv[3])\n"
        "f = torch.compile(lambda x: (x * k).sin() + 1, backend='tpu')\n"
        "x = torch.arange(n, dtype=torch.float32)\n"
        "torch.testing.assert_close(f(x.to('tpu')).cpu(), (x * k).sin() + 1)\n"
        "c = torch.tpu.metrics()['counters']\n"
        "print(c.get('aot_cache_hits', 0), c.get('compile_traces', 0),\n"
        "      int('cuda' in common.device_codegens))\n")
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "k"))

    def run(*argv):
        out = subprocess.run([sys.executable, "-c", code, *argv], env=env,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    assert run("plain", "4", "3") == "0 1 0"  # traced; Inductor's backends never registered
    assert run("plain", "4", "3") == "1 0 0"
    assert run("inductor", "4", "3") == "1 0 1"  # the same key with them registered
    assert run("plain", "5", "3") == "0 1 0"  # another shape
    assert run("plain", "4", "2") == "0 1 0"  # another constant


def test_aot_cache_folder_depends_on_options_and_can_be_off(tmp_path, monkeypatch):
    from torchtpu.compile import aot_cache

    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "c"))
    a = aot_cache.entry_dir({})
    assert a.startswith(str(tmp_path / "c" / "aot"))
    assert aot_cache.entry_dir({}) == a
    assert aot_cache.entry_dir({"donate": False}) != a  # other options: other entries
    assert aot_cache.entry_dir({"persistent_cache": False}) is None
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", "")
    assert aot_cache.entry_dir({}) is None


def test_warm_start_of_a_training_step_skips_aot_autograd(tmp_path):
    """A second process loads forward and backward from AOTAutogradCache and their programs
    from the XLA cache: same losses, nothing traced or compiled, and the optimizer's CPU step
    counts still update on the host (no sync per step)."""
    code = (
        "import torch\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),\n"
        "                        torch.nn.Linear(16, 4)).to('tpu')\n"
        "opt = torch.optim.AdamW(m.parameters(), lr=0.05, foreach=True)\n"
        "x, y = torch.randn(32, 8).to('tpu'), torch.randn(32, 4).to('tpu')\n"
        "@torch.compile(backend='tpu')\n"
        "def step(x, y):\n"
        "    opt.zero_grad(set_to_none=True)\n"
        "    loss = torch.nn.functional.mse_loss(m(x), y)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    return loss.detach()\n"
        "losses = [step(x, y) for _ in range(4)]\n"
        "c = torch.tpu.metrics()['counters']\n"
        "syncs = c.get('host_syncs', 0)\n"
        "print([round(float(l), 6) for l in losses])\n"
        "print(c.get('aot_cache_hits', 0), c.get('compile_traces', 0), c.get('xla_compiles', 0),\n"
        "      syncs, float(opt.state[m[0].weight]['step']))\n")
    runs = _run_twice(code, tmp_path / "t")
    assert runs[0][0] == runs[1][0]
    cold, warm = runs[0][1].split(), runs[1][1].split()
    assert cold[0] == "0" and int(cold[1]) > 0
    assert int(warm[0]) >= 2 and warm[1:3] == ["0", "0"]  # forward+backward, optimizer
    assert warm[3] == cold[3] == "0" and warm[4] == "4.0"


def test_warm_start_of_graphs_with_constants_rng_and_batchnorm(tmp_path):
    """Graphs holding a tensor constant, random ops (dropout, randn) and BatchNorm's
    running-stat updates load from AOTAutogradCache in a new process and give the same
    values (the RNG draws from the same seed), with nothing traced or compiled."""
    code = (
        "import torch\n"
        "torch.manual_seed(0)\n"
        "bn = torch.nn.BatchNorm1d(3).to('tpu')\n"
        "def f(x):\n"
        "    y = bn(x * torch.tensor([1., 2., 3.], device=x.device))\n"
        "    y = torch.nn.functional.dropout(y, 0.5, training=True)\n"
        "    return (y + torch.randn(4, 3, device=x.device)).sum()\n"
        "x = torch.randn(4, 3, device='tpu', requires_grad=True)\n"
        "torch.manual_seed(1)\n"
        "out = torch.compile(f, backend='tpu')(x)\n"
        "out.backward()\n"
        "print(float(out), x.grad.cpu().tolist(), bn.running_mean.cpu().tolist())\n"
        "c = torch.tpu.metrics()['counters']\n"
        "print(c.get('aot_cache_hits', 0), c.get('compile_traces', 0),\n"
        "      c.get('compile_cpu_fallbacks', 0))\n")
    runs = _run_twice(code, tmp_path / "r")
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == "0 2 0"
    assert runs[1][1] == "1 0 0"


def test_graph_entry_written_from_a_disk_hit_runs_in_a_new_process(tmp_path):
    """A graph entry written when only the program entry was on disk must still be complete.

    XLA:CPU drops kernels when an executable that was deserialized is serialized again; the
    copy then fails in another process with "Function ... not found". The cache must copy the
    program's original bytes instead.
    """
    code = (
        "import torch\n"
        "def f(x, y):\n"
        "    return (x @ y.T + 1).tanh().sum(0) * 3 + (x * 2 - y).exp().mean()\n"
        "torch.manual_seed(0)\n"
        "x, y = torch.randn(16, 8), torch.randn(16, 8)\n"
        "out = torch.compile(f, backend='tpu')(x.to('tpu'), y.to('tpu')).cpu()\n"
        "torch.testing.assert_close(out, f(x, y), rtol=1e-5, atol=1e-5)\n"
        "c = torch.tpu.metrics()['counters']\n"
        "print(c.get('xla_compiles', 0), c.get('compile_disk_cache_hits', 0))\n")
    cache = tmp_path / "p"
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(cache))

    def run():
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    def graph_entries():
        return [p for p in cache.rglob("*.xla") if p.name.startswith("g")]

    assert run() == "1 0"  # compiled; program and graph entries written
    for p in graph_entries():
        p.unlink()
    assert run() == "0 1"  # the program entry is a hit; the graph entry is rewritten from it
    assert len(graph_entries()) == 1
    assert run() == "0 1"  # the rewritten graph entry loads and runs
    assert len(graph_entries()) == 1  # ... under the same key (the key is stable across processes)


def test_custom_compiler_options():
    def f(x):
        return x.exp() * 2

    x = torch.randn(5)
    c0 = COUNTERS["xla_compiles"]
    with torch.tpu.compiler.custom_compiler_options({"xla_cpu_enable_fast_math": False}):
        assert torch.tpu.compiler.get_custom_compiler_options() == {
            "xla_cpu_enable_fast_math": False}
        _close(f(x), torch.compile(f, backend="tpu")(x.to(TPU)))
    assert torch.tpu.compiler.get_custom_compiler_options() == {}
    _new_process()
    _close(f(x), torch.compile(f, backend="tpu")(x.to(TPU)))
    assert COUNTERS["xla_compiles"] - c0 == 2  # the options are part of the cache key


def test_conv_net_inference_and_training_match_cpu():
    def make():
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))

    cpu, tpu = _pair(make)
    x = torch.randn(2, 3, 16, 16)
    cm = torch.compile(tpu, backend="tpu")
    out_c, out_t = cpu(x), cm(x.to(TPU))
    _close(out_c, out_t, atol=1e-4, rtol=1e-4)
    out_c.sum().backward()
    out_t.sum().backward()
    _close(cpu[0].weight.grad, tpu[0].weight.grad, atol=1e-4, rtol=1e-4)
    _close(cpu[1].running_var, tpu[1].running_var, atol=1e-5, rtol=1e-5)


def test_attention_block_matches_cpu():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return y.transpose(1, 2).reshape(2, 5, 16)

    cpu, tpu = _pair(Attn)
    x = torch.randn(2, 5, 16)
    _close(cpu(x), torch.compile(tpu, backend="tpu")(x.to(TPU)), atol=1e-5, rtol=1e-4)


_lib = torch.library.Library("torchtpu_test", "DEF")
_lib.define("twice(Tensor x) -> Tensor")
_lib.impl("twice", lambda x: x * 2, "CPU")
_lib.impl("twice", lambda x: torch.empty_like(x), "Meta")


def test_op_without_lowering_runs_on_cpu_inside_the_program():
    op = torch.ops.torchtpu_test.twice.default
    torch.library.register_fake("torchtpu_test::twice")(lambda x: torch.empty_like(x))

    def f(x):
        return op(x.sin()) + 1

    x = torch.randn(6)
    before = COUNTERS["compile_cpu_fallbacks"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(x.sin() * 2 + 1, torch.compile(f, backend="tpu")(x.to(TPU)))
    assert COUNTERS["compile_cpu_fallbacks"] == before + 1
    torch._dynamo.reset()
    torch.tpu.enable_cpu_fallback = False
    try:
        with pytest.raises(Exception, match="torchtpu_test::twice"):
            torch.compile(f, backend="tpu")(x.to(TPU))
    finally:
        torch.tpu.enable_cpu_fallback = True


def test_compiled_adamw_updates_cpu_step_counts_on_host_without_a_sync():
    """A non-capturable optimizer keeps ``step`` on the CPU; the compiled step must update it
    on the host (no device round trip, no host sync) and match CPU eager."""
    cpu, tpu = _pair(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                                 torch.nn.Linear(8, 4)))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, foreach=True) for m in (cpu, tpu)]

    def step(m, opt, x):
        opt.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    cstep = torch.compile(step, backend="tpu")
    x = torch.randn(16, 8)
    for _ in range(2):
        step(cpu, opts[0], x)
        cstep(tpu, opts[1], x.to(TPU))
    syncs = COUNTERS["host_syncs"]
    for _ in range(3):
        step(cpu, opts[0], x)
        cstep(tpu, opts[1], x.to(TPU))
    assert COUNTERS["host_syncs"] == syncs  # nothing waited for the device
    for pc, pt in zip(cpu.parameters(), tpu.parameters()):
        st = opts[1].state[pt]["step"]
        assert st.device.type == "cpu" and float(st) == 5.0
        _close(pc, pt, atol=1e-5, rtol=1e-4)


def _compile_fallbacks():
    return dict(torch.tpu.metrics()["per_op"].get("compile_cpu_fallbacks", {}))


def test_graph_device_moves_and_dynamo_fma_need_no_cpu_fallback():
    """prims.device_put (a .to(device) or .cpu() inside the graph) and Dynamo's own prims.fma
    (its rewrite of addcmul_ with a value: single-tensor Adam/AdamW) have lowerings; a graph
    with a CPU fallback could not be cached on disk."""
    torch._dynamo.reset()
    before = _compile_fallbacks()
    x = torch.randn(4, device="tpu")
    f = torch.compile(lambda x: x + torch.tensor(3).to(x.device), backend="tpu")
    torch.testing.assert_close(f(x).cpu(), x.cpu() + 3)
    g = torch.compile(lambda x: (x * 2).cpu(), backend="tpu")
    out = g(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, x.cpu() * 2)

    torch.manual_seed(0)
    cpu_model = nn.Linear(4, 4)
    tpu_model = copy.deepcopy(cpu_model).to("tpu")

    def train(model, device, compiled):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

        def step(inp):
            opt.zero_grad()
            model(inp).pow(2).sum().backward()
            opt.step()

        if compiled:
            step = torch.compile(step, backend="tpu")
        for i in range(3):
            step(torch.full((2, 4), float(i + 1), device=device))
        return [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(train(tpu_model, "tpu", True), train(cpu_model, "cpu", False)):
        torch.testing.assert_close(a, b)
    assert _compile_fallbacks() == before


@pytest.mark.parametrize("requires_grad", [False, True])
def test_outputs_that_view_another_output_alias_it(requires_grad):
    """As in eager: writing one output shows through the outputs that are views of it (an
    inference graph leaves that to the compiler; around a training graph aot_autograd
    regenerates the views itself)."""
    def f(x):
        y = x * 2
        return y, y[1:], y.view(2, 2).t()

    torch._dynamo.reset()
    a, b, c = torch.compile(f, backend="tpu")(torch.zeros(4, device="tpu", requires_grad=requires_grad))
    assert b._base is a and c._base is a
    with torch.no_grad():
        a[1] = 100.0
    assert b[0].item() == 100.0 and c[1, 0].item() == 100.0


def test_captured_data_dependent_shapes_raise_a_clear_error():
    """With Dynamo told to capture .item() / nonzero into the graph, the static-shape program
    cannot hold the result: a clear message (by default Dynamo breaks the graph there)."""
    x = torch.arange(6.0, device="tpu")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="data-dependent result"):
            torch.compile(lambda x, n: x[:n.item()] * 2, backend="tpu")(
                x, torch.tensor(3, device="tpu"))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="data-dependent result"):
            torch.compile(lambda x: x[x > 2].sum(), backend="tpu")(x)
    torch._dynamo.reset()
    assert torch.compile(lambda x: x[x > 2].sum(), backend="tpu")(x).item() == 12.0

def test_programs_that_ignore_an_input_of_another_size_are_not_shared(tmp_path, monkeypatch):
    """A graph that computes nothing from an input (it returns it) lowers to the same module for
    every size of that input (jit drops unused arguments), and JAX's executable refuses
    arguments of other shapes: the program key must hold the arguments' shapes (transformers'
    continuous batching died with "Argument types differ" on its second query size)."""
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()

    def f(m):
        return m.contiguous(), m.shape[-1] * 2

    g = torch.compile(f, backend="tpu", dynamic=False)
    for n in (4, 8):
        m = torch.arange(2.0 * n).reshape(2, n)
        out, k = g(m.to("tpu"))
        ref, k_ref = f(m)
        assert k == k_ref
        torch.testing.assert_close(out.cpu(), ref)
