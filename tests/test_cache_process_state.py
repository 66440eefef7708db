"""A program read back from the compile cache runs only when this process can run it.

XLA:CPU's linear-algebra custom calls read a LAPACK table that JAX fills only while it lowers a
linalg op; an executable loaded from disk skips lowering, and before runtime/custom_calls.py a
second process died with SIGSEGV on every cached linalg program. Entries now record their
custom-call targets and are made ready (or rebuilt, never run) before they are loaded.
"""
from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_json

from torchtpu.runtime import custom_calls, program_cache as pc
from torchtpu.runtime.metrics import COUNTERS, PER_OP

# Linear algebra in every executor: Strict (and its backward), Debug, Fused, compiled
# forward + backward. Each result is printed exactly (float.hex) so two runs compare bit for bit
# (ops that fall back to CPU are left out: linalg.lstsq on CPU differs in the last bits between
# runs of one script).
SCRIPT = r"""
import json, sys, torch
torch.manual_seed(0)
a = torch.randn(5, 5, dtype=torch.float64) + 5 * torch.eye(5, dtype=torch.float64)
spd = a @ a.T + torch.eye(5, dtype=torch.float64)
b = torch.randn(5, 2, dtype=torch.float64)
f = torch.randn(4, 4)

def ops(a, spd, b, f):
    L = torch.linalg.cholesky(spd)
    lu, piv = torch.linalg.lu_factor(a)
    return [torch.linalg.inv(a), L, torch.linalg.qr(a).R.abs(), torch.linalg.svdvals(a),
            torch.linalg.eigvalsh(spd), torch.linalg.det(a).reshape(1),
            torch.linalg.slogdet(a).logabsdet.reshape(1), torch.linalg.solve(a, b),
            torch.linalg.lu_solve(lu, piv, b),
            torch.linalg.solve_triangular(L, b, upper=False), torch.linalg.matrix_exp(a / 10),
            torch.linalg.pinv(a), torch.linalg.matrix_norm(a, "nuc").reshape(1),
            torch.linalg.inv(f), torch.cholesky_solve(b, L)]

dev = [t.to("tpu") for t in (a, spd, b, f)]
out = {}
out["strict"] = ops(*dev)
x = dev[0].clone().requires_grad_()
torch.linalg.inv(x).sum().backward()
out["strict_grad"] = [x.grad]
with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
    out["debug"] = ops(*dev)
with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
    out["fused"] = [t.cpu() for t in ops(*dev)]
g = torch.compile(lambda x, s: (torch.linalg.inv(x).sum() + torch.linalg.cholesky(s).sum()),
                  backend="tpu")
xs = dev[0].clone().requires_grad_()
loss = g(xs, dev[1])
loss.backward()
out["compiled"] = [loss.reshape(1), xs.grad]
res = {k: [[float(v).hex() for v in t.detach().cpu().reshape(-1).tolist()] for t in ts]
       for k, ts in out.items()}
ref = [t.reshape(-1).tolist() for t in ops(a, spd, b, f)]
c = torch.tpu.metrics()["counters"]
print(json.dumps({"res": res, "ref": ref, "counters": {k: v for k, v in c.items()
                  if "disk" in k or "compile" in k}}))
"""


def _run(cache):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(cache))
    return run_json(SCRIPT, env, timeout=400)


def test_second_process_runs_cached_linear_algebra(tmp_path):
    cache = tmp_path / "cache"
    cold = _run(cache)
    warm = _run(cache)  # was: SIGSEGV (exit -11) at the first cached linalg program
    assert warm["res"] == cold["res"]  # bit for bit: the same executables
    for mode in ("strict", "debug", "fused"):
        for got, want in zip(cold["res"][mode], cold["ref"]):
            np.testing.assert_allclose([float.fromhex(v) for v in got], want, rtol=1e-5,
                                       atol=1e-6, err_msg=mode)
    c = warm["counters"]
    assert c.get("eager_xla_compiles", 0) == 0 and c.get("fused_xla_compiles", 0) == 0, c
    assert c["eager_disk_cache_hits"] > 20 and c["fused_disk_cache_hits"] >= 1, c
    assert c.get("xla_compiles", 0) == 0 and c["compile_disk_cache_hits"] >= 2, c
    assert not any("unsafe" in k or "errors" in k for k in c), c


def test_custom_call_targets_are_read_off_the_module():
    text = jax.jit(jnp.linalg.inv).lower(jnp.eye(3, dtype=jnp.float32)).as_text()
    assert "lapack_sgetrf_ffi" in custom_calls.targets(text)
    assert custom_calls.targets(jax.jit(jnp.sin).lower(1.0).as_text()) == ()
    generic = 'x = "stablehlo.custom_call"(%a) <{call_target_name = "foo$bar", api_version = 4}>'
    assert custom_calls.targets(generic) == ("foo$bar",)
    assert custom_calls.ready(("lapack_dgesdd_ffi", "Sharding")) is None
    assert "not known" in custom_calls.ready(("some_users_ffi_kernel",))
    assert "callback" in custom_calls.storable(("xla_ffi_python_cpu_callback",))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "c"))
    return tmp_path / "c"


def _entries(root):
    return sorted(os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns
                  if n.endswith(".xla"))


def test_entry_with_a_custom_call_this_process_cannot_set_up_is_rebuilt(cache_dir):
    """An entry naming a target unknown here (a user's FFI kernel registered at lowering) is a
    miss with its reason, rebuilt by lowering, never deserialized or run."""
    key = ("test.unready", os.getpid())
    x = jnp.eye(3, dtype=jnp.float32) * 2
    np.testing.assert_allclose(pc.Program("eager", jnp.linalg.inv, key)(x), np.eye(3) / 2)
    [path] = _entries(cache_dir)
    data = open(path, "rb").read()
    head = data.index(b"\n", len(pc._MAGIC)) + 1
    (n,) = struct.unpack("<Q", data[head:head + 8])
    in_tree, out_tree, targets = pickle.loads(data[head + 8:head + 8 + n])
    assert any(t.startswith("lapack_") for t in targets)
    trees = pickle.dumps((in_tree, out_tree, targets + ("some_users_ffi_kernel",)))
    open(path, "wb").write(data[:head] + struct.pack("<Q", len(trees)) + trees
                           + data[head + 8 + n:])
    compiles, hits = COUNTERS["eager_xla_compiles"], COUNTERS["eager_disk_cache_hits"]
    np.testing.assert_allclose(pc.Program("eager", jnp.linalg.inv, key)(x), np.eye(3) / 2)
    assert COUNTERS["eager_xla_compiles"] == compiles + 1
    assert COUNTERS["eager_disk_cache_hits"] == hits
    assert any("some_users_ffi_kernel" in r for r in PER_OP["eager_disk_cache_unsafe"])


def test_host_callback_programs_are_not_written(cache_dir):
    def fn(x):
        return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

    before = COUNTERS["eager_disk_cache_unstorable"]
    out = pc.Program("eager", fn, ("test.callback", os.getpid()))(jnp.ones(3, jnp.float32))
    np.testing.assert_allclose(out, np.sin(np.ones(3)) + 1, rtol=1e-6)
    assert COUNTERS["eager_disk_cache_unstorable"] == before + 1
    assert _entries(cache_dir) == []


EXPORT_LOAD = r"""
import sys, torch
from torchtpu.export import stablehlo
p = stablehlo.load(sys.argv[1])
a = torch.load(sys.argv[1] + "/a.pt")
print(repr(p(a.to("tpu"), torch.eye(4, dtype=torch.float64, device="tpu")).cpu().tolist()))
"""


def test_exported_linear_algebra_runs_in_a_new_process(tmp_path):
    """A saved export of linalg ops (with their effect-ordered error checks) loads and runs in
    a fresh process, equal to the exporting process's result."""
    import torch

    class M(torch.nn.Module):
        def forward(self, a, b):
            return torch.linalg.solve(torch.linalg.inv(a), b) + torch.linalg.cholesky(a @ a.T)

    a = torch.randn(4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    b = torch.eye(4, dtype=torch.float64)
    ep = torch.export.export(M(), (a, b))
    prog = torch.tpu.export.exported_program_to_stablehlo(ep)
    out = prog(a.to("tpu"), b.to("tpu")).cpu()
    torch.testing.assert_close(out, M()(a, b))
    d = str(tmp_path / "exported")
    prog.save(d)
    torch.save(a, d + "/a.pt")
    r = subprocess.run([sys.executable, "-c", EXPORT_LOAD, d], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "c")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert eval(r.stdout.strip().splitlines()[-1]) == out.tolist()


# A compiled function that writes its inputs in place and returns views of what it wrote: the
# program leaves those outputs to the runtime as views of the written inputs (lower.py
# _mutation_views), which the lowering finds from the written values' metadata. A later process
# loads the graph from AOTAutogradCache (the metadata aot_cache keeps) and the program from the
# disk cache: before, it found no such views and the call died with KeyError.
MUTVIEW_SCRIPT = r"""
import json, torch

def f(x, y):
    x.mul_(2)
    y[1:3].add_(x[0])
    return x.t(), y[1:3], y[:, ::2]

out = []
for dev in ("cpu", "tpu"):
    x = torch.arange(12.).reshape(3, 4).to(dev)
    y = torch.arange(20.).reshape(5, 4).to(dev)
    fn = torch.compile(f, backend="tpu") if dev == "tpu" else f
    r = fn(x, y)
    r[1].fill_(-1)  # outputs are views of the inputs: the write shows in y
    out.append([t.cpu().tolist() for t in (*r, x, y)])
c = torch.tpu.metrics()["counters"]
print(json.dumps({"cpu": out[0], "tpu": out[1], "counters": {k: v for k, v in c.items()
                  if "compile" in k or "aot" in k}}))
"""


def test_later_process_runs_cached_graphs_returning_views_of_written_inputs(tmp_path):
    env = dict(os.environ, TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    for run in ("cold", "warm"):
        r = run_json(MUTVIEW_SCRIPT, env, timeout=300)  # warm was: KeyError in backend.py
        assert r["tpu"] == r["cpu"], run
    assert r["counters"].get("compile_disk_cache_hits", 0) >= 1, r["counters"]
    assert r["counters"].get("compile_disk_cache_mismatches", 0) == 0, r["counters"]
