"""The docs: every runnable snippet runs, every relative link resolves, the site builds.

A fenced ```python block immediately preceded by a line ``<!-- runnable -->`` (in README.md or
under docs/) is run as a script in a fresh process (cwd: a temporary folder, no network needed)
and must exit 0 within its timeout. Keep such snippets cheap (a few seconds on CPU): they run
two at a time, all of them started together when the first one is asked for.
"""
import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
MARK = "<!-- runnable -->"
TIMEOUT = 180  # seconds per snippet (a loaded machine; a few seconds on an idle one)
_BLOCK = re.compile(r"^" + re.escape(MARK) + r"\n```python\n(.*?)^```", re.S | re.M)


def _snippets():
    out = []
    for path in DOCS:
        text = open(path).read()
        for i, m in enumerate(_BLOCK.finditer(text)):
            line = text.count("\n", 0, m.start()) + 2
            out.append((f"{os.path.relpath(path, ROOT)}:{line}", m.group(1)))
        # a marker not followed by a python block is a mistake, not a silent skip
        marks = len(re.findall(r"^" + re.escape(MARK) + r"$", text, re.M))
        assert marks == len(_BLOCK.findall(text)), f"{path}: {MARK} before no python block"
    return out


SNIPPETS = _snippets()


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as cwd:
        try:
            return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "",
                                               f"timed out after {TIMEOUT}s\n{e.stderr or ''}")


@pytest.fixture(scope="module")
def results():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    futures = {where: pool.submit(_run, code) for where, code in SNIPPETS}
    yield futures
    pool.shutdown(cancel_futures=True)


def test_there_are_runnable_snippets():
    where = {w.split(":")[0] for w, _ in SNIPPETS}
    assert "README.md" in where
    assert len([w for w in where if w.startswith("docs/guides/")]) >= 10, where


@pytest.mark.parametrize("where", [w for w, _ in SNIPPETS])
def test_snippet_runs(where, results):
    r = results[where].result()
    assert r.returncode == 0, f"{where} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", [os.path.relpath(p, ROOT) for p in DOCS])
def test_relative_links_resolve(path):
    text = re.sub(r"```.*?```", "", open(os.path.join(ROOT, path)).read(), flags=re.S)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target.split("#")[0]))
        assert os.path.exists(file), f"{path}: link to {target}, which does not exist"


def test_readme_is_short():
    assert len(open(os.path.join(ROOT, "README.md")).read().splitlines()) <= 200


def test_site_builds(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test and docs extras")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.exists(tmp_path / "site" / "guides" / "getting-started.html")
