"""The import graph of the three packages (read from the source with ``ast``, nothing is
imported): no cycles, and the layers hold: ``jaxhead`` imports neither ``models`` nor
``train``, ``models`` does not import ``train``. Beside them, ``tests`` and ``benchmarks``
do not import each other and ``harness`` (what both use) imports neither. Imports inside
functions count too. And dispatch has one home: no module but ``jaxhead/dispatch.py``
defines a platform picker or ``KernelUnsupported``."""

from __future__ import annotations

import ast

from tests.support import ROOT

PACKAGES = ("jaxhead", "models", "train")


def _modules() -> dict[str, tuple]:
    """Module name -> (path, is a package ``__init__``)."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports (``from a.b import c``
    counts ``a.b.c`` if that is a module, else ``a.b``); a module's import of its own
    package ``__init__`` (re-exports) is left out."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, init) in mods.items():
        package = name if init else name.rpartition(".")[0]
        edges = set()
        for t in _import_targets(path.read_text(), package):
            r = resolve(t)
            if r and r != name and not (name.startswith(r + ".") and mods[r][1]):
                edges.add(r)
        graph[name] = edges
    return graph


def _import_targets(source: str, package: str) -> list[str]:
    """The dotted names a module's source imports, anywhere in it (``from a.b import c``
    gives ``a.b`` and ``a.b.c``; relative imports resolved against ``package``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = import_graph()
    assert {"jaxhead", "models.transformer", "train.grpo", "train.loop"} <= set(graph)
    assert "train.loop" in graph["train.grpo"] and "models.mesh" in graph["train.placement"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_detection_works():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_hold():
    graph = import_graph()
    bad = [(m, r) for m, rs in graph.items() for r in rs
           if (m.split(".")[0] == "jaxhead" and r.split(".")[0] in ("models", "train"))
           or (m.split(".")[0] == "models" and r.split(".")[0] == "train")]
    assert bad == []


#: Top-level folder -> the top-level folders its modules may not import.
APART = {"tests": {"benchmarks"}, "benchmarks": {"tests"}, "harness": {"tests", "benchmarks"}}


def crossings(sources: dict[str, str]) -> list[tuple[str, str]]:
    """``(module, imported name)`` for each import that ``APART`` forbids, from
    ``{dotted module name: its source}``."""
    bad = []
    for name, source in sources.items():
        top = name.split(".")[0]
        for target in _import_targets(source, name.rpartition(".")[0]):
            if target.split(".")[0] in APART.get(top, ()):
                bad.append((name, target))
    return sorted(set(bad))


def _sources(*folders: str) -> dict[str, str]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p.read_text()
            for folder in folders for p in (ROOT / folder).rglob("*.py")}


def test_tests_and_benchmarks_do_not_import_each_other():
    sources = _sources(*APART)
    assert {"tests.train.test_layout", "benchmarks.memory", "harness.oracle"} <= set(sources)
    assert crossings(sources) == []


def test_crossings_are_found():
    broken = {"benchmarks.accuracy": "from tests.support.oracle import head_inputs\n",
              "tests.models.test_x": "def f():\n    import benchmarks.memory\n",
              "harness.memory": "from benchmarks import memory\n",
              "harness.precision": "from harness.oracle import ref64\n",
              "tests.jaxhead.test_y": "from harness import oracle\n"}
    assert crossings(broken) == [
        ("benchmarks.accuracy", "tests.support.oracle"),
        ("benchmarks.accuracy", "tests.support.oracle.head_inputs"),
        ("harness.memory", "benchmarks"), ("harness.memory", "benchmarks.memory"),
        ("tests.models.test_x", "benchmarks.memory")]


DISPATCH_MODULE = "jaxhead/dispatch.py"


def dispatch_definitions(source: str) -> list[str]:
    """The platform pickers (functions named ``target_platform`` or ``*_platform``) and
    ``KernelUnsupported`` classes that ``source`` defines, at any depth."""
    return [node.name for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name.endswith("_platform"))
            or (isinstance(node, ast.ClassDef) and node.name == "KernelUnsupported")]


def stray_dispatch(root) -> dict[str, list[str]]:
    """``path -> dispatch_definitions`` of every module of the packages under ``root``
    other than ``DISPATCH_MODULE`` that defines any."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            found = dispatch_definitions(path.read_text())
            if found and rel != DISPATCH_MODULE:
                out[rel] = found
    return out


def test_dispatch_lives_in_one_module():
    assert stray_dispatch(ROOT) == {}
    assert sorted(dispatch_definitions((ROOT / DISPATCH_MODULE).read_text())) == [
        "KernelUnsupported", "target_platform"]


def test_the_dispatch_rule_fails_on_a_broken_copy(tmp_path):
    assert dispatch_definitions("def mesh_platform(mesh):\n    return 'cpu'\n") == [
        "mesh_platform"]
    for pkg in PACKAGES:  # a copy of the tree with one stray picker and one stray class
        for path in (ROOT / pkg).rglob("*.py"):
            copy = tmp_path / path.relative_to(ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(path.read_text())
    (tmp_path / "models" / "stray.py").write_text(
        "class KernelUnsupported(ValueError):\n    pass\n\n\n"
        "class Ops:\n    def target_platform(self):\n        return 'tpu'\n")
    assert stray_dispatch(tmp_path) == {
        "models/stray.py": ["KernelUnsupported", "target_platform"]}
