"""The rooms of the house (docs/layout.md), read from the source with ``ast``:

* no module of one top-level package reaches a private name (``_x``) of another: neither
  ``from other.pkg import _x`` nor an attribute ``obj._x`` whose name only another package
  defines (``Generator._fn`` read by a benchmark was the case);
* no ``isinstance`` on the KV-cache classes outside ``models/cache/``: the decoder and the
  attention layer use the caches' one interface (``begin`` / ``layer`` / ``end``,
  ``write`` / ``attend``);
* ``train/`` holds its commands (``grpo``, ``sft``, ``export``) and sub-packages by role,
  nothing else at its top, and ``train/grpo.py`` stays at most 150 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGES = ("jaxhead", "models", "train", "harness", "benchmarks", "configs", "examples")
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}
CACHE_CLASSES = {"KVCache", "PagedKVCache", "LayerKV", "PagedLayerKV"}
COMMANDS = {"__init__.py", "grpo.py", "sft.py", "export.py"}


def _sources(root: Path) -> dict[Path, tuple[str, ast.Module]]:
    """Each module of the packages: (its top-level package, its syntax tree)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            out[path] = (pkg, ast.parse(path.read_text(), str(path)))
    return out


def _defined(tree: ast.Module) -> set[str]:
    """The names a module defines or binds (functions, classes, variables, attributes it
    assigns, arguments)."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            names.add(n.attr)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
    return names


def private_reaches(sources: dict[Path, tuple[str, ast.Module]]) -> list[str]:
    """``path:line: what`` for every private name one package takes from another."""
    defined: dict[str, set[str]] = {pkg: set() for pkg in PACKAGES}
    for pkg, tree in sources.values():
        defined[pkg] |= _defined(tree)
    found = []
    for path, (pkg, tree) in sources.items():
        others = set().union(*(defined[p] for p in PACKAGES if p != pkg))
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and not n.level:
                if n.module.split(".")[0] in PACKAGES and n.module.split(".")[0] != pkg:
                    found += [f"{path.name}:{n.lineno}: from {n.module} import {a.name}"
                              for a in n.names if _private(a.name)]
            elif (isinstance(n, ast.Attribute) and _private(n.attr)
                  and n.attr not in NAMEDTUPLE_API and n.attr in others
                  and n.attr not in defined[pkg]):
                found.append(f"{path.name}:{n.lineno}: {ast.unparse(n)}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def cache_type_tests(sources: dict[Path, tuple[str, ast.Module]], root: Path) -> list[str]:
    """``path:line`` of every ``isinstance`` on a KV-cache class outside models/cache/."""
    found = []
    for path, (_, tree) in sources.items():
        if path.relative_to(root).parts[:2] == ("models", "cache"):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance" \
                    and len(n.args) == 2:
                named = {getattr(x, "id", getattr(x, "attr", None))
                         for x in ast.walk(n.args[1])}
                if named & CACHE_CLASSES:
                    found.append(f"{path.relative_to(root)}:{n.lineno}")
    return found


def test_no_package_reaches_another_packages_private_names():
    assert private_reaches(_sources(ROOT)) == []


def test_a_private_reach_is_found(tmp_path):
    """The check can fail: a benchmark reading an engine's private compile cache and a
    harness importing a private helper are both found; the same names inside their own
    package, a NamedTuple's ``_replace`` and a library's privates are not."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "models" / "engine.py").write_text(
        "class Engine:\n    def _fn(self):\n        return self._cache\n"
        "    def step(self):\n        return self._fn()\n")
    (tmp_path / "harness" / "helpers.py").write_text("def _devices():\n    return []\n")
    (tmp_path / "benchmarks" / "bench.py").write_text(
        "from harness.helpers import _devices\n"
        "def run(engine, cache, np):\n"
        "    engine._fn()\n"
        "    cache._replace(index=0)\n"
        "    return np._NoValue, _devices()\n")
    found = private_reaches(_sources(tmp_path))
    assert found == ["bench.py:1: from harness.helpers import _devices",
                     "bench.py:3: engine._fn"], found


def test_no_isinstance_on_cache_kinds_outside_the_caches():
    assert cache_type_tests(_sources(ROOT), ROOT) == []


def test_an_isinstance_on_a_cache_kind_is_found(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
    (tmp_path / "models" / "cache").mkdir()
    (tmp_path / "models" / "cache" / "paged.py").write_text(
        "def f(c, PagedKVCache):\n    return isinstance(c, PagedKVCache)\n")
    (tmp_path / "models" / "decoder.py").write_text(
        "from models import cache\n"
        "def f(c):\n    return isinstance(c, (tuple, cache.PagedKVCache))\n")
    assert cache_type_tests(_sources(tmp_path), tmp_path) == ["models/decoder.py:3"]


def test_train_holds_its_commands_and_rooms_only():
    top = {p.name for p in (ROOT / "train").glob("*.py")}
    assert top == COMMANDS, sorted(top - COMMANDS)
    rooms = sorted(p.name for p in (ROOT / "train").iterdir()
                   if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == ["config", "data", "rl", "run"], rooms
    lines = len((ROOT / "train" / "grpo.py").read_text().splitlines())
    assert lines <= 150, f"train/grpo.py has {lines} lines (at most 150)"
