"""The layers as a contract: ``.importlinter`` (run by ``lint-imports``, which ``make test`` runs
before pytest) holds, and it fails when a lower layer imports a higher one.

The contract (see ``.importlinter`` and docs/ARCHITECTURE.md, "Layers"): runtime -> lowering ->
eager -> compile -> export / profiler / pallas -> device -> ops -> distributed -> integrations /
vllm / sglang / verl, no import upward (function-level imports included), no cycle between the
modules of a package. Here also: no cycle between any two files at all (a package's
``__init__`` and its own modules included), which import-linter's contracts do not check.
"""
import os
import shutil
import subprocess
import sys

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter is in the test extra")
nx = pytest.importorskip("networkx")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _lint(root: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.run(
        [sys.executable, "-c", LINT, "--config", os.path.join(root, ".importlinter"),
         "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _copy(tmp_path) -> str:
    """The package and the contract, copied to a temporary root."""
    dst = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "torchtpu"), dst / "torchtpu",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.cpp"))
    shutil.copy(os.path.join(ROOT, ".importlinter"), dst / ".importlinter")
    return str(dst)


def _append(root: str, rel: str, code: str) -> None:
    with open(os.path.join(root, "torchtpu", rel), "a") as f:
        f.write("\n\n" + code + "\n")


def test_contract_holds():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_contract_fails_on_an_upward_import_inside_a_function(tmp_path):
    root = _copy(tmp_path)
    # the runtime (lowest layer) reaching up into the integrations, inside a function
    _append(root, "runtime/metrics.py",
            "def _reach_up():\n    from ..integrations import hooks\n\n    return hooks")
    r = _lint(root)
    assert r.returncode != 0
    assert "torchtpu.runtime is not allowed to import torchtpu.integrations" in r.stdout, r.stdout
    assert "torchtpu.runtime.metrics -> torchtpu.integrations.hooks" in r.stdout, r.stdout


def test_contract_fails_on_an_import_of_the_package_root(tmp_path):
    # the package root wires every layer: a lower layer importing it imports them all
    root = _copy(tmp_path)
    _append(root, "lowering/registry.py",
            "def _version():\n    from .. import __version__\n\n    return __version__")
    r = _lint(root)
    assert r.returncode != 0
    assert "torchtpu.lowering is not allowed to import torchtpu.device" in r.stdout, r.stdout


def test_contract_fails_on_a_cycle_between_siblings(tmp_path):
    root = _copy(tmp_path)
    # two modules of the lowering package that import each other
    _append(root, "lowering/_util.py", "def _cycle():\n    from . import hops\n\n    return hops")
    _append(root, "lowering/hops.py", "from . import _util as _u  # noqa: E402")
    r = _lint(root)
    assert r.returncode != 0
    assert "No cycles are allowed in torchtpu.lowering" in r.stdout, r.stdout


def test_no_import_cycle_between_any_files():
    # the graph drawn from the code, function-level imports included
    sys.path.insert(0, ROOT)
    try:
        g = grimp.build_graph("torchtpu", include_external_packages=False, cache_dir=None)
    finally:
        sys.path.remove(ROOT)
    dg = nx.DiGraph()
    for m in g.modules:
        dg.add_node(m)
        for imported in g.find_modules_directly_imported_by(m):
            dg.add_edge(m, imported)
    cycles = [sorted(c) for c in nx.strongly_connected_components(dg) if len(c) > 1]
    assert not cycles, cycles
