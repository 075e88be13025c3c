"""``jaxhead`` is the op library: importable with only jax, flax and numpy installed, and it
never imports the models or the trainer. Checked on the source (every import statement of
every module, at any depth), so a lazy import inside a function counts too. The one
exception: an optional adapter (``jaxhead/integrations/<library>``) imports its own library,
and only that one; ``import jaxhead`` never loads it."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.support import ROOT

ALLOWED = {"jax", "jaxlib", "flax", "numpy", "jaxhead"}
#: Optional adapters: the package (relative to the root) and the one library it may add.
OPTIONAL = {"jaxhead/integrations/tunix": "tunix",
            # the fixture that runs Tunix's own learner tests under the drop-in
            "jaxhead/integrations/tunix/testing/conftest": "pytest"}


def _allowed(path, top):
    if top in ALLOWED or top in sys.stdlib_module_names:
        return True
    rel = path.relative_to(ROOT).as_posix()
    return any(top == lib and (rel == f"{pkg}.py" or rel.startswith(f"{pkg}/"))
               for pkg, lib in OPTIONAL.items())


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
            if not _allowed(path, top):
                found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    assert not found, f"jaxhead imports packages beyond jax, flax, numpy: {found}"


def test_the_check_sees_imports():
    """The walker finds module-level and function-level imports (so the test can fail)."""
    names = set(_imports(ROOT / "jaxhead" / "_src" / "head" / "xla_cpu.py"))
    assert {"jax.numpy", "functools", "jaxhead._src.head"} <= names


def test_the_exemption_is_narrow():
    """Only the adapter's own package may import its library, and nothing else new."""
    adapter = ROOT / "jaxhead" / "integrations" / "tunix" / "_losses.py"
    assert _allowed(adapter, "tunix") and not _allowed(adapter, "torch")
    assert not _allowed(ROOT / "jaxhead" / "_src" / "head" / "api.py", "tunix")
    assert not _allowed(ROOT / "jaxhead" / "integrations" / "__init__.py", "tunix")
    assert not _allowed(ROOT / "jaxhead" / "integrations" / "tunixx.py", "tunix")


def test_import_jaxhead_never_loads_an_optional_library():
    code = ("import sys, jaxhead, jaxhead.integrations; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tunix', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_tunix_adapter_without_tunix_says_how_to_install_it():
    code = ("import sys; sys.modules['tunix'] = None\n"  # as if Tunix were not installed
            "try:\n    import jaxhead.integrations.tunix\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "pip install 'jaxhead[tunix]'" in out, out
