"""torchtpu's integration patches (torchtpu/integrations) across transformers / accelerate
releases and import orders.

A patch must never break the library it patches: it is applied only once its target module has
finished executing, whatever the import order (torch's backend autoload imports torchtpu from
inside the first ``import torch``, which may sit in the middle of a transformers module), and
when its target is missing or has moved it is skipped (said once under
``TORCHTPU_DEBUG_INTEGRATIONS=1``, counted) and the library runs unpatched.

Releases other than the installed ones are installed without dependencies into a folder
(``pip install --no-deps --target``, with the few dependencies whose pins differ, cached in
pytest's cache folder) that comes first on PYTHONPATH of a fresh process running
tests/integration_probe.py. The claimed range is stated in docs/guides/integrations.md: transformers 5.10.4 (the
oldest, in the default run) to the installed newest, accelerate 1.1.0 to 1.16.0.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROBE = os.path.join(HERE, "integration_probe.py")

# transformers releases and the dependencies whose pins differ from the test environment's
# (5.10-5.12 pin huggingface_hub<2 and tokenizers<=0.23.0; each release pins its "kernels")
OLD_HUB = ("huggingface_hub==1.33.0", "tokenizers==0.22.2")
TRANSFORMERS = {
    "5.10.4": ("transformers==5.10.4", *OLD_HUB, "kernels==0.12.3"),  # SGLang 0.5.18-0.5.21
    "5.12.1": ("transformers==5.12.1", *OLD_HUB, "kernels==0.12.3"),  # SGLang 0.5.23
    "5.19.0": ("transformers==5.19.0", "kernels==0.17.2"),  # verl 0.9.1
}
ACCELERATE = {"1.1.0": ("accelerate==1.1.0",), "1.16.0": ("accelerate==1.16.0",)}
ORDERS = ("submodule_first", "cb_first", "transformers_first", "model_first", "torch_first",
          "accelerate_first", "explicit_after", "explicit_before")

_OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name "
                      r"resolution|Name or service not known|Network is unreachable|"
                      r"ConnectTimeout|Connection refused|ProxyError")


def release(request, name: str, reqs) -> str:
    """A folder holding ``reqs`` (installed once, kept in pytest's cache)."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        root = str(cache.mkdir("torchtpu-compat"))
    else:
        root = str(request.getfixturevalue("tmp_path_factory").getbasetemp())
    target = os.path.join(root, name)
    stamp = os.path.join(target, ".torchtpu-complete")
    if os.path.exists(stamp) and open(stamp).read() == " ".join(reqs):
        return target
    shutil.rmtree(target, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
           "--disable-pip-version-check", "--target", target, *reqs]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip install {' '.join(reqs)} did not finish in 600 s")
    if p.returncode:
        out = p.stdout + p.stderr
        if _OFFLINE.search(out):
            pytest.skip(f"the package registry is unreachable: cannot install {reqs[0]}")
        pytest.fail(f"pip install {' '.join(reqs)} failed:\n{out[-3000:]}")
    with open(stamp, "w") as f:
        f.write(" ".join(reqs))
    return target


def probe(order, *flags, path=(), env=None, timeout=400):
    """Run the probe in a fresh process with ``path`` first on PYTHONPATH; its output."""
    e = dict(os.environ)
    e.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    e.pop("TORCHTPU_INTEGRATIONS", None)
    e["PYTHONPATH"] = os.pathsep.join([*path, ROOT])
    if order.startswith("explicit"):
        e["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    e.update(env or {})
    p = subprocess.run([sys.executable, PROBE, order, *flags], capture_output=True, text=True,
                       env=e, timeout=timeout, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "ALL OK" in p.stdout, out[-6000:]
    return out


FAST_ORDERS = ("submodule_first", "explicit_after")


@pytest.mark.parametrize("order", [o if o in FAST_ORDERS
                                   else pytest.param(o, marks=pytest.mark.slow)
                                   for o in ORDERS])
def test_installed_transformers_in_every_import_order(order):
    """The installed (newest claimed) transformers and accelerate: every patch applied and
    every module that imported a patched function by name holds the patched one."""
    out = probe(order)
    assert "transformers 5." in out


def test_oldest_transformers_runs_a_model_and_says_what_it_skipped(request):
    """transformers 5.10.4 (the oldest claimed): ``import transformers.generation.utils``
    first, then a tiny Llama's forward and generate on "tpu" equal CPU's. Three targets are
    not where 5.25 has them (5.10.4 has no DeferredStopCheck): each is skipped, said once under
    TORCHTPU_DEBUG_INTEGRATIONS=1, and counted."""
    path = release(request, "transformers-5.10.4", TRANSFORMERS["5.10.4"])
    out = probe("submodule_first", "--model", path=[path],
                env={"TORCHTPU_DEBUG_INTEGRATIONS": "1"})
    assert "transformers 5.10.4" in out and "equal CPU's" in out
    said = [line for line in out.splitlines() if line.startswith("torchtpu: not patching")]
    assert sorted(said) == [
        "torchtpu: not patching transformers.generation.continuous_batching.initialization."
        "resolve_continuous_batching_config (its signature has no device); it runs unpatched",
        "torchtpu: not patching transformers.generation.continuous_batching.utils."
        "get_device_and_memory_breakdown (not found); it runs unpatched",
        "torchtpu: not patching transformers.generation.utils.DeferredStopCheck (not found); "
        "it runs unpatched"], said


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(TRANSFORMERS))
def test_pinned_transformers_releases_run_a_model(request, version):
    """The releases SGLang and verl pin: the issue's failing import, a forward and generate."""
    path = release(request, f"transformers-{version}", TRANSFORMERS[version])
    out = probe("model_first", "--model", path=[path])
    assert f"transformers {version}" in out and "equal CPU's" in out


@pytest.mark.slow
@pytest.mark.parametrize("order", [o for o in ORDERS if o != "submodule_first"])
def test_oldest_transformers_in_every_import_order(request, order):
    path = release(request, "transformers-5.10.4", TRANSFORMERS["5.10.4"])
    assert "transformers 5.10.4" in probe(order, path=[path])


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(ACCELERATE))
@pytest.mark.parametrize("order", ["accelerate_first", "explicit_after"])
def test_accelerate_releases(request, version, order):
    """accelerate's oldest (transformers' own minimum) and newest releases with the installed
    transformers: patches applied, a model runs, ``PartialState().default_device`` is tpu."""
    path = release(request, f"accelerate-{version}", ACCELERATE[version])
    out = probe(order, "--model", path=[path])
    assert "equal CPU's" in out


def _run_py(code, tmp_path, timeout=300):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=e, timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout


def test_hooks_run_after_the_module_finished_and_never_break_it(tmp_path):
    """``when_imported`` on a module that is half-initialised (as torch's autoload does from
    inside ``import torch``) waits for the end of its execution; a hook that raises or a
    target that is missing leaves the module imported and working."""
    (tmp_path / "lib_half.py").write_text(textwrap.dedent("""
        from torchtpu.integrations import when_imported
        seen = []
        when_imported(__name__, lambda m: seen.append(hasattr(m, "late")))
        late = 1
    """))
    (tmp_path / "lib_later.py").write_text("def f(x):\n    return x + 1\n")
    out = _run_py("""
        import torch, sys
        from torchtpu import integrations as ti
        from torchtpu.runtime import metrics
        def boom(mod):
            raise KeyError("layout changed")
        def wrap(orig):
            return lambda x: orig(x) * 10
        ti.when_imported("lib_later", boom)
        ti.when_imported("lib_later", lambda m: ti.patch(m, "g", wrap))
        ti.when_imported("lib_later", lambda m: ti.patch(m, "f", wrap, params=("y",)))
        import lib_half, lib_later
        assert lib_half.seen == [True], lib_half.seen
        assert lib_later.f(1) == 2  # unpatched
        assert type(sys.modules["lib_half"].__spec__).__name__ == "ModuleSpec"
        skips = {k: v for k, v in ti.STATUS.items() if "lib_" in k}
        assert len(skips) == 3 and all(v.startswith("skipped: ") for v in skips.values()), skips
        assert "KeyError: 'layout changed'" in str(skips), skips
        assert metrics.COUNTERS["integration_patches_skipped"] >= 3
        ti.when_imported("lib_later", lambda m: ti.patch(m, "f", wrap, params=("x",)))
        assert lib_later.f(1) == 20 and ti.STATUS["lib_later.f"] == "applied"
        print("ok")
    """, tmp_path)
    assert "ok" in out


def test_integrations_off_leaves_transformers_alone():
    e = dict(os.environ, TORCHTPU_INTEGRATIONS="0", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c",
                        "import transformers.generation.utils as u; "
                        "assert not hasattr(u.GenerationMixin._prefill, '_torchtpu'); "
                        "import torch; assert torch.device('tpu').type == 'tpu'; print('ok')"],
                       capture_output=True, text=True, env=e, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
