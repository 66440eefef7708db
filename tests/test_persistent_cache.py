"""Eager programs persist across processes (runtime/program_cache.py).

A second process running the same Strict and Fused code compiles nothing: every program comes
from the compile cache folder. Entries are safe: a corrupt, truncated, foreign or garbage entry
is a counted miss that is rebuilt (never a crash, never a wrong result); two processes writing
the same entries at once leave them usable; an executable is keyed by the device it runs on.
"""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import json_result
import torch

from torchtpu.runtime import program_cache as pc
from torchtpu.runtime.metrics import COUNTERS

# Strict ops (scalars, a matmul, a strided view read, a factory, a seeded random op), a Fused
# graph, and, with two devices, the same op on tpu:1 and a Program keyed alike on both devices.
SCRIPT = r"""
import json, torch, jax, jax.numpy as jnp
from torchtpu.runtime import program_cache as pc
torch.manual_seed(0)
a = torch.arange(12., device="tpu").reshape(3, 4)
b = (a * 2.5 + 1).t().contiguous()                 # strided read of a transposed view
c = a @ b + torch.zeros(3, 3, device="tpu")
r = torch.rand(5, device="tpu")
with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
    f = ((a - 1).sin() * 3).sum(dim=1)
    f = f.cpu()
d1 = (torch.arange(4., device="tpu:1") * 2.5 + 1).cpu()
p = pc.Program("eager", lambda x: x * 3 + 1, ("test.program",))
x0 = jax.device_put(jnp.arange(3.), jax.devices()[0])
x1 = jax.device_put(jnp.arange(3.), jax.devices()[1])
y0, y1 = p(x0), p(x1)
g = torch.compile(lambda x: (x * 3).sin() + 1, backend="tpu")  # one compiled graph, two devices
g0, g1 = g(torch.ones(3, device="tpu:0")), g(torch.ones(3, device="tpu:1"))
c_ = torch.tpu.metrics()["counters"]
print(json.dumps({"b": b.cpu().tolist(), "c": c.cpu().tolist(), "r": r.cpu().tolist(),
                  "f": f.tolist(), "d1": d1.tolist(), "y": [y0.tolist(), y1.tolist()],
                  "y_dev": [next(iter(y0.devices())).id, next(iter(y1.devices())).id],
                  "g": [g0.cpu().tolist(), g1.cpu().tolist(), str(g0.device), str(g1.device)],
                  "counters": {k: v for k, v in c_.items() if "disk" in k or "compile" in k}}))
"""


def _start(cache):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(cache),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc):
    return json_result(proc, timeout=240)


def _expected():
    a = torch.arange(12.).reshape(3, 4)
    b = (a * 2.5 + 1).t().contiguous()
    return {"b": b.tolist(), "c": (a @ b).tolist(), "f": ((a - 1).sin() * 3).sum(dim=1),
            "d1": (torch.arange(4.) * 2.5 + 1).tolist()}


def test_second_process_compiles_nothing_and_concurrent_writers_are_safe(tmp_path):
    cache = tmp_path / "cache"
    # two cold processes writing the same entries at the same time
    first = [_start(cache), _start(cache)]
    cold = [_result(p) for p in first]
    warm = _result(_start(cache))
    exp = _expected()
    for run in cold + [warm]:
        assert run["b"] == exp["b"]
        torch.testing.assert_close(torch.tensor(run["c"]), torch.tensor(exp["c"]))
        torch.testing.assert_close(torch.tensor(run["f"]), exp["f"])
        assert run["d1"] == exp["d1"]
        assert run["y"] == [[1.0, 4.0, 7.0]] * 2
        assert run["y_dev"] == [0, 1]  # each device's executable runs on that device
        g = (torch.ones(3) * 3).sin() + 1
        torch.testing.assert_close(torch.tensor(run["g"][0]), g)
        assert run["g"][0] == run["g"][1] and run["g"][2:] == ["tpu:0", "tpu:1"]
        assert run["r"] == cold[0]["r"]  # the seeded random op: same program, same numbers
    # a cold process compiles each program or loads what the other one wrote meanwhile
    n = []
    for run in cold:
        c = run["counters"]
        n.append(c.get("eager_xla_compiles", 0) + c.get("eager_disk_cache_hits", 0))
        assert c.get("fused_xla_compiles", 0) + c.get("fused_disk_cache_hits", 0) == 1
        # every program compiled is written (the Program on tpu:0 and tpu:1 with one key: two)
        assert c.get("eager_disk_cache_writes", 0) == c.get("eager_xla_compiles", 0)
    assert n[0] == n[1] > 5
    w = warm["counters"]
    assert w.get("eager_xla_compiles", 0) == 0 and w.get("eager_compiles", 0) == 0
    assert w.get("fused_xla_compiles", 0) == 0
    assert w.get("eager_disk_cache_errors", 0) == 0 and w.get("fused_disk_cache_errors", 0) == 0
    assert w["eager_disk_cache_hits"] == n[0]
    assert w["fused_disk_cache_hits"] == 1
    assert w.get("xla_compiles", 0) == 0 and w["compile_disk_cache_hits"] >= 2  # both devices


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "c"))
    return tmp_path / "c"


def _entries(root):
    return sorted(os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns
                  if n.endswith(".xla"))


_n = [0]


def _program(tag):
    return pc.Program("eager", lambda x: jnp.cos(x) * 2 - 1, ("test.safety", tag))


def _fresh_tag():
    _n[0] += 1
    return f"{os.getpid()}-{_n[0]}"


def _check(prog, x):
    np.testing.assert_allclose(np.asarray(prog(x)), np.cos(np.asarray(x)) * 2 - 1, rtol=1e-6)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty", "foreign",
                                    "other_format"])
def test_damaged_entry_is_rebuilt(cache_dir, damage):
    tag = _fresh_tag()
    x = jnp.linspace(0, 1, 7, dtype=jnp.float32)
    _check(_program(tag), x)
    [path] = _entries(cache_dir)
    data = open(path, "rb").read()
    if damage == "flip":  # one payload byte changed: the checksum refuses it
        data = data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:]
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "garbage":
        data = os.urandom(len(data))
    elif damage == "empty":
        data = b""
    elif damage == "foreign":  # another key's entry under this name
        _check(_program(tag + "other"), x)
        other = [p for p in _entries(cache_dir) if p != path][0]
        data = open(other, "rb").read()
    elif damage == "other_format":
        data = b"TORCHTPU-XLA-PROGRAM-0\n" + data[23:]
    open(path, "wb").write(data)
    errors = COUNTERS["eager_disk_cache_errors"]
    compiles = COUNTERS["eager_xla_compiles"]
    _check(_program(tag), x)  # a new Program: as a new process would (warned once a process)
    assert COUNTERS["eager_xla_compiles"] == compiles + 1
    assert COUNTERS["eager_disk_cache_errors"] == errors + (damage != "other_format")
    # the rebuilt entry was rewritten and is loaded next time
    hits = COUNTERS["eager_disk_cache_hits"]
    _check(_program(tag), x)
    assert COUNTERS["eager_disk_cache_hits"] == hits + 1
    assert COUNTERS["eager_xla_compiles"] == compiles + 1


def test_keys_separate_what_changes_a_program(cache_dir, monkeypatch):
    monkeypatch.setattr(pc._prefetch, "THREADS", 0)  # shape 3 then 4 would build 5 ahead
    tag = _fresh_tag()
    p = _program(tag)
    p(jnp.ones(3, jnp.float32))
    p(jnp.ones(4, jnp.float32))          # shape
    p(jnp.ones(3, jnp.float64))          # dtype
    p(jnp.ones(3, jnp.float32) + 0.5)    # same signature: no new entry
    _program(tag + "x")(jnp.ones(3, jnp.float32))  # another executor key
    assert len(_entries(cache_dir)) == 4
    scalar = pc.Program("eager", lambda x, s: x * s, ("test.scalar", tag))
    assert float(scalar(jnp.ones(()), 2)[()]) == 2.0  # Python int and float: two programs
    assert float(scalar(jnp.ones(()), 2.5)[()]) == 2.5
    assert len(_entries(cache_dir)) == 6


def test_unstable_key_stays_in_memory(cache_dir):
    p = pc.Program("eager", lambda x: x + 1, ("test.unstable", object()))
    before = COUNTERS["eager_disk_cache_unkeyable"]
    assert float(p(jnp.ones(()))[()]) == 2.0
    assert COUNTERS["eager_disk_cache_unkeyable"] == before + 1
    assert _entries(cache_dir) == []


def test_stable_spellings():
    # values that compare equal but build different programs are spelt apart
    assert pc.stable(0.0) != pc.stable(-0.0)
    assert pc.stable(1) != pc.stable(1.0) != pc.stable(True)
    assert pc.stable(np.dtype("float32")) != pc.stable(np.dtype(jnp.bfloat16))
    assert pc.stable((torch.float32, torch.device("tpu", 0))) == \
        pc.stable((torch.float32, torch.device("tpu", 0)))
    with pytest.raises(pc.NotStable):
        pc.stable(lambda: 0)


def test_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", "")
    p = _program(_fresh_tag())
    _check(p, jnp.ones(2, jnp.float32))
    assert not any(tmp_path.iterdir())


def test_a_second_signature_switches_to_keyed_lookups():
    """A program whose shapes keep changing (an op on a growing KV cache) gives the right
    result for every shape. While it has one executable it calls it directly; from its second
    signature on every call looks its signature up (no failing direct call first: each costs
    JAX an error message), alternating signatures included."""
    p = pc.Program("eager", lambda x: x * 2, ("test.growing", _fresh_tag()))
    p(jnp.arange(1, dtype=jnp.float32))
    assert p._last is not None
    for n in range(2, 8):
        out = p(jnp.arange(n, dtype=jnp.float32))
        np.testing.assert_array_equal(np.asarray(out), np.arange(n, dtype=np.float32) * 2)
        assert p._last is None and len(p.by_sig) == n
    for n in (3, 5, 3, 7):  # seen signatures: hits, no new executable
        np.testing.assert_array_equal(np.asarray(p(jnp.ones(n, jnp.float32))), [2] * n)
    assert p._last is None and len(p.by_sig) == 7
    q = pc.Program("eager", lambda x: x + 1, ("test.steady", _fresh_tag()))
    for _ in range(3):
        q(jnp.ones(4, jnp.float32))
    assert q._last is not None  # a steady program keeps its direct call


def _special_values(dtype):
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.floating) or dtype in (jnp.bfloat16,):
        finfo = jnp.finfo(dtype)
        sp = [0.0, -0.0, 1.0, -1.0, 0.5, 2.5, -2.5, 3.5, float(finfo.max), float(finfo.min),
              float(finfo.tiny), float(finfo.tiny) / 4, np.inf, -np.inf, np.nan, 1e30, -7.25]
        vals = np.concatenate([np.array(sp), rng.standard_normal(47) * 100])
        return jnp.asarray(vals.astype(np.dtype(dtype)))  # numpy's cast keeps subnormals
    if dtype == jnp.bool_:
        return jnp.asarray(rng.integers(0, 2, 64).astype(bool))
    info = jnp.iinfo(dtype)
    sp = [0, 1, -1 if info.min < 0 else 2, info.max, info.min, 7, 3]
    vals = np.concatenate([np.array(sp, dtype=np.int64),
                           rng.integers(max(info.min, -1000), min(info.max, 1000), 57)])
    return jnp.asarray(vals.astype(np.dtype(dtype)))


def _same_bits_with_either_emitter(lowered, args, name):
    assert pc.exact_ops_only(lowered.as_text()), name
    fast = lowered.compile(compiler_options=pc.FAST_OPTIONS)(*args)
    classic = lowered.compile(compiler_options=pc.CLASSIC_OPTIONS)(*args)
    for i, (u, v) in enumerate(zip(jax.tree_util.tree_leaves(fast),
                                   jax.tree_util.tree_leaves(classic))):
        u, v = np.atleast_1d(np.asarray(u)), np.atleast_1d(np.asarray(v))
        assert u.dtype == v.dtype
        if u.dtype.kind == "f" or u.dtype == jnp.bfloat16:  # a NaN's sign is unspecified
            both = np.isnan(u.astype(np.float32)) & np.isnan(v.astype(np.float32))
            u, v = np.where(both, 0, u).astype(u.dtype), np.where(both, 0, v).astype(v.dtype)
        np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8), err_msg=f"{name}[{i}]")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16", "int32",
                                   "int64", "int8", "uint8", "bool"])
def test_classic_emitters_are_bit_identical_on_exact_ops(dtype):
    """XLA:CPU's classic emitters compile small programs ~3x faster; they are used only for
    programs made of _EXACT_OPS. Each such operation gives the same bits with either emitter,
    on special values (nan, inf, -0, subnormals, integer extremes) too; a transcendental one
    is refused by the check."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the classic emitters are an XLA:CPU option")
    from jax import lax

    dt = jnp.dtype(dtype)
    v = _special_values(dt)
    x, y = jnp.repeat(v, 64), jnp.tile(v, 64)  # every pair of values
    isf = jnp.issubdtype(dt, jnp.floating)
    isb = dt == jnp.bool_
    fns = {
        "compare": lambda a, b: [a < b, a == b, a >= b, a != b],
        "moves": lambda a, b: [jnp.concatenate([a, b])[3:50:2], jnp.pad(a, (2, 3)), a[::-1],
                               a.reshape(64, 64).T, jnp.broadcast_to(a[:8], (3, 8))],
        "convert": lambda a, b: [a.astype(t) for t in (jnp.float32, jnp.float64, jnp.bfloat16,
                                                       jnp.float16, jnp.int32, jnp.int64,
                                                       jnp.int8, jnp.uint8)],
    }
    if not isb:
        fns["add"] = lambda a, b: [a + b, a - b, -a, (a + b) - (a - b)]
        fns["mul"] = lambda a, b: [a * b, -a, lax.iota(a.dtype, a.shape[0]) * a, (a * b) * -b]
        mixed = (lambda a: a * a + a, lambda a: a - a[::-1] * a, lambda a: (a + a) * (a - 1))
        for f in mixed:  # a float multiply and add may be fused into one FMA on some hosts
            assert pc.exact_ops_only(jax.jit(f).lower(x).as_text()) == (not isf)
    if isf or (not isb and jnp.issubdtype(dt, jnp.signedinteger)):
        fns["sign"] = lambda a, b: [lax.sign(a), lax.abs(a)]
    if isf:
        fns["float"] = lambda a, b: [a / b, jnp.floor(a), jnp.ceil(a), jnp.round(a),
                                     lax.round(a, lax.RoundingMethod.AWAY_FROM_ZERO),
                                     jnp.fmod(a, b), jnp.isfinite(a)]
    elif not isb:
        fns["int"] = lambda a, b: [a & b, a | b, a ^ b, ~a, lax.shift_left(a, b & 7),
                                   lax.shift_right_arithmetic(a, b & 7),
                                   lax.shift_right_logical(a, b & 7), lax.population_count(a),
                                   lax.div(a, b), lax.rem(a, b)]  # x/0 is defined in XLA
    if dt != jnp.bfloat16:  # the classic emitters compare a subnormal bfloat16 as zero
        fns["to_bool"] = lambda a, b: a.astype(jnp.bool_)
    else:
        fns.pop("compare")
        for f in (lambda a: a.astype(bool), lambda a: a < a[::-1]):
            assert not pc.exact_ops_only(jax.jit(f).lower(x).as_text())
    if not isf:
        fns["select"] = lambda a, b: [jnp.where(a < b, a, b), jnp.maximum(a, b),
                                      jnp.minimum(a, b)] + ([] if isb else [lax.clamp(b[3], a, b[5])])
    for name, f in fns.items():
        _same_bits_with_either_emitter(jax.jit(f).lower(x, y), (x, y), f"{name} {dtype}")
    # a view read with a traced offset (eager views: an index past either end is clamped, a
    # negative one wraps) and a view write
    idx = jnp.asarray([5, -3, 4000, -9000], jnp.int32)

    def dyn(a, i):
        return ([lax.dynamic_slice(a, (i[k],), (50,)) for k in range(4)]
                + [lax.dynamic_update_slice(a, a[:9], (i[k],)) for k in range(4)]
                + [a[i[0]], a[i[1]]])
    _same_bits_with_either_emitter(jax.jit(dyn).lower(x, idx), (x, idx), f"dynamic {dtype}")
    if isf:
        # excluded: the default emitters flush subnormals in select/max/min (PyTorch does not;
        # the classic ones do not either), and approximate the transcendental functions
        # differently; reductions may sum in another order
        for f in (jnp.tanh, jnp.exp, lambda a: a.sum(), lambda a: jax.lax.rsqrt(a),
                  lambda a: jnp.where(a > 0, a, 1.0), lambda a: jnp.maximum(a, 0)):
            assert not pc.exact_ops_only(jax.jit(f).lower(x).as_text())


@pytest.mark.parametrize("isa", ["AVX2", "AVX"])
def test_classic_emitters_bit_identical_on_another_vector_isa(isa):
    """The same check with XLA:CPU limited to another vector ISA: whether LLVM fuses a multiply
    and an add differs between the emitters per ISA (CI's host contracted ``a - b * b`` in
    float64 with one emitter only; here, under AVX2, the check before that fix failed the same
    way). Each ISA in a fresh process, since XLA reads the flag once."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the classic emitters are an XLA:CPU option")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_cpu_max_isa={isa}").strip()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::test_classic_emitters_are_bit_identical_on_exact_ops"],
        env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "9 passed" in r.stdout, r.stdout[-2000:]


def test_prune_removes_least_recently_used_entries(cache_dir):
    """Over the size limit, the least recently used entries go (a hit counts as a use) down
    to 80% of the limit, stale temporary files too; a pruned program is rebuilt, correctly."""
    import time

    from torchtpu.compile import cache

    progs = [_program(_fresh_tag()) for _ in range(6)]
    x = jnp.linspace(0, 1, 5, dtype=jnp.float32)
    for p in progs:
        _check(p, x)
    files = _entries(cache_dir)
    assert len(files) == 6
    size = os.path.getsize(files[0])
    # ages: the entries were written 600..100 s ago, oldest first ...
    for i, f in enumerate(files):
        os.utime(f, (time.time() - 600 + 100 * i,) * 2)
    # ... then the oldest one is read by a new Program (a disk hit marks it used)
    oldest = files[0]
    tag_of_oldest = [p for p in progs if p._stable_key() and
                     cache._path(p._disk_key(pc.signature([x]), [x], {"fast": True})[0])
                     == oldest]
    assert len(tag_of_oldest) == 1
    again = pc.Program("eager", tag_of_oldest[0].fn, tag_of_oldest[0].key)
    hits = COUNTERS["eager_disk_cache_hits"]
    _check(again, x)
    assert COUNTERS["eager_disk_cache_hits"] == hits + 1
    stale = os.path.join(os.path.dirname(oldest), "x.tmp")
    open(stale, "wb").close()
    os.utime(stale, (time.time() - 7200,) * 2)
    fresh_tmp = os.path.join(os.path.dirname(oldest), "y.tmp")  # a writer at work: kept
    open(fresh_tmp, "wb").close()

    assert cache.prune(max_bytes=size * 100) == 0  # under the limit: nothing goes
    removed = cache.prune(max_bytes=int(size * 4.5))  # 6 entries > 4.5: keep <= 3.6 entries
    assert removed == 3
    left = _entries(cache_dir)
    assert oldest in left  # used most recently
    assert set(left) == {oldest, files[4], files[5]}
    assert not os.path.exists(stale) and os.path.exists(fresh_tmp)
    os.unlink(fresh_tmp)
    # a pruned entry is a miss: rebuilt and rewritten
    for p in progs:
        _check(pc.Program("eager", p.fn, p.key), x)
    assert len(_entries(cache_dir)) == 6


def test_prune_never_touches_other_files(cache_dir):
    from torchtpu.compile import cache

    _check(_program(_fresh_tag()), jnp.ones(3, jnp.float32))
    other = cache_dir / "native"
    other.mkdir()
    (other / "lib.so").write_bytes(b"x" * 10000)
    assert cache.prune(max_bytes=1) == 1
    assert _entries(cache_dir) == [] and (other / "lib.so").exists()
