"""The wheel built from the repository holds the ``jaxhead`` package only (the models, the
trainer and the configs run from a checkout), and its version is ``jaxhead.__version__``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile

import jaxhead
from tests.support import ROOT

# what a checkout may hold besides the sources: never part of a build's input
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info",
                                      "__pycache__", ".pytest_cache", ".ruff_cache")


def build_wheel(tmp_path) -> zipfile.ZipFile:
    """``pip wheel --no-deps .`` on a copy of the checkout (a build in place would leave
    ``build/`` and ``*.egg-info`` there), with the installed setuptools (the ``test``
    extra): no network, no build environment."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path / "dist"), "."],
        cwd=src, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return zipfile.ZipFile(wheel)


def test_the_wheel_holds_the_library_only(tmp_path):
    wheel = build_wheel(tmp_path)
    names = wheel.namelist()
    version = jaxhead.__version__
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"jaxhead", f"jaxhead-{version}.dist-info"}, sorted(tops)
    # the whole library, kernels and the optional adapter included
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxhead").rglob("*.py")}
    assert sources <= set(names), sorted(sources - set(names))
    assert "jaxhead/py.typed" in names  # PEP 561: type checkers read the annotations
    metadata = wheel.read(f"jaxhead-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in metadata
    assert wheel.filename.endswith(f"jaxhead-{version}-py3-none-any.whl")


def test_the_version_has_one_source():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "jaxhead.__version__"
    major, minor, patch = jaxhead.__version__.split(".")
    assert all(part.isdigit() for part in (major, minor, patch)), jaxhead.__version__
    # the changelog has the version's section
    assert f"\n## [{jaxhead.__version__}]" in (ROOT / "CHANGELOG.md").read_text()
