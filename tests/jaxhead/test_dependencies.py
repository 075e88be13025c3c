"""``jaxhead`` is the op library: importable with only jax, flax and numpy installed, and it
never imports the models or the trainer. Checked on the source (every import statement of
every module, at any depth), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import sys

from tests.support import ROOT

ALLOWED = {"jax", "jaxlib", "flax", "numpy", "jaxhead"}


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_jaxhead_imports_only_jax_flax_numpy_and_the_standard_library():
    found = {}
    for path in (ROOT / "jaxhead").rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in ALLOWED and top not in sys.stdlib_module_names:
                found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    assert not found, f"jaxhead imports packages beyond jax, flax, numpy: {found}"


def test_the_check_sees_imports():
    """The walker finds module-level and function-level imports (so the test can fail)."""
    names = set(_imports(ROOT / "jaxhead" / "_src" / "head" / "xla_cpu.py"))
    assert {"jax.numpy", "functools", "jaxhead._src.head"} <= names
