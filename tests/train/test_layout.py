"""The import graph of the three packages (read from the source with ``ast``, nothing is
imported): no cycles, and the layers hold: ``jaxhead`` imports neither ``models`` nor
``train``, ``models`` does not import ``train``; inside every package no upward import
(its sub-packages and modules, each taken whole, import each other without a cycle).
Beside them, ``tests`` and ``benchmarks`` do not import each other and ``harness`` (what
both use) imports neither. Imports inside functions count too. No module of the packages
imports private ``jax._src`` but the one pinned module (``PINNED_PRIVATE``), whose
private names the installed jax must have. And dispatch has one home: no module but
``jaxhead/dispatch.py`` defines a platform picker or ``KernelUnsupported``, and every op
with several implementations (``OP_REGISTRIES``) declares them as ``dispatch.Entry``s of
one ``dispatch.Registry``. Every logger the code, the tests or the docs name exists."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

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
    assert {"jaxhead", "models.transformer", "train.grpo", "train.run.loop"} <= set(graph)
    assert "train.run.grpo_stage" in graph["train.grpo"]
    assert "train.run.loop" in graph["train.run.grpo_stage"]
    assert "models.mesh" in graph["train.rl.placement"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_detection_works():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def unit_graphs(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """Package -> the import graph of its units: each direct sub-package (all its modules
    as one node) and each direct module; the package's ``__init__`` (its re-exports, on
    top of everything) is left out."""
    packages = {m for m in graph if any(k.startswith(m + ".") for k in graph)}
    out = {}
    for pkg in packages:
        def unit(m, pkg=pkg):
            return f"{pkg}.{m[len(pkg) + 1:].split('.')[0]}" if m.startswith(pkg + ".") \
                else None

        units: dict[str, set[str]] = {}
        for m, targets in graph.items():
            if (u := unit(m)) is not None:
                units.setdefault(u, set()).update(
                    v for t in targets if (v := unit(t)) not in (None, u))
        for targets in list(units.values()):
            for v in targets:
                units.setdefault(v, set())
        out[pkg] = units
    return out


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[list[str]]]:
    """Package -> the cycles among its units (``unit_graphs``): where a unit imports one
    that imports it back, one of the two arrows points up. Empty when every package is
    layered."""
    return {pkg: found for pkg, units in sorted(unit_graphs(graph).items())
            if (found := cycles(units))}


def test_no_upward_import_inside_any_package():
    graph = import_graph()
    assert {"models", "models.attention", "jaxhead._src", "train"} <= set(unit_graphs(graph))
    assert upward_imports(graph) == {}


def test_upward_imports_are_found():
    # models.config importing the attention registry while the attention layer imports
    # the config: no module cycle, but the package models.attention and models.config
    # import each other
    graph = {"models": set(), "models.config": {"models.attention.api"},
             "models.attention": set(), "models.attention.api": {"models.mesh"},
             "models.attention.layer": {"models.config", "models.attention.api"},
             "models.mesh": set()}
    assert cycles(graph) == []
    assert upward_imports(graph) == {"models": [["models.attention", "models.config"]]}
    graph["models.config"] = set()
    assert upward_imports(graph) == {}


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


#: The one module of the packages that imports ``jax._src`` (the probe's ``_one_device``).
PINNED_PRIVATE = "jaxhead/_src/head/probe.py"


def private_jax_imports(root) -> dict[str, list[str]]:
    """``path -> the jax._src modules it imports`` for every module of the packages under
    ``root`` that imports any (``import jax._src...``, ``from jax._src... import``,
    ``from jax import _src``), at any depth."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            found = [t for t in _import_targets(path.read_text(), "")
                     if t == "jax._src" or t.startswith("jax._src.")]
            if found:
                out[path.relative_to(root).as_posix()] = sorted(set(found))
    return out


def test_private_jax_is_imported_in_one_pinned_module():
    from jaxhead._src.head import probe

    found = private_jax_imports(ROOT)
    assert list(found) == [PINNED_PRIVATE], found
    # the names it uses are the ones it declares, and this jax has them
    modules = {m for m, _ in probe.PRIVATE_JAX}
    assert {m for m in found[PINNED_PRIVATE] if m in modules} == modules
    for module, name in probe.PRIVATE_JAX:
        assert getattr(importlib.import_module(module), name, None) is not None, (module, name)


def test_a_private_jax_import_is_found(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "stray.py").write_text(
        "import jax\n\n\ndef f():\n    from jax._src import core\n    return core\n")
    assert private_jax_imports(tmp_path) == {"models/stray.py": ["jax._src", "jax._src.core"]}


#: Every op with several implementations: module -> its registry's ``op`` (the name of
#: the parameter or config field that picks one).
OP_REGISTRIES = {"jaxhead._src.head.api": "impl", "models.attention.api": "attention_impl",
                 "models.attention.paged": "paged_attention_impl",
                 "models.moe.api": "expert_dispatch"}


def registry_modules(root) -> list[str]:
    """The modules of the packages under ``root`` that build a ``Registry(...)``."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(
                    n.func, "id", None)) == "Registry" for n in ast.walk(tree)):
                out.append(".".join(path.relative_to(root).with_suffix("").parts))
    return sorted(m for m in out if m != "jaxhead.dispatch")


def test_every_op_declares_its_implementations_in_one_shape():
    from jaxhead import dispatch

    assert registry_modules(ROOT) == sorted(OP_REGISTRIES)
    for module, op in OP_REGISTRIES.items():
        registry = importlib.import_module(module).REGISTRY
        assert type(registry) is dispatch.Registry and registry.op == op, module
        entries = list(registry.entries.values())
        for e in entries:
            assert type(e) is dispatch.Entry and callable(e.call), (module, e.name)
            assert e.check is None or callable(e.check), (module, e.name)
            assert e.probe is None or callable(e.probe), (module, e.name)
            assert e.platforms is None or set(e.platforms) <= {"cpu", "gpu", "tpu"}
        # "auto" has a last resort on every platform, and its kernels say where they run
        auto = [e for e in entries if e.auto]
        assert auto[-1].platforms is None, module
        assert all(e.platforms is not None for e in entries if e.probe is not None), module


#: A logger named in the code, the tests or the docs: ``logger="x"``, logger ``"x"``,
#: logger `x`.
LOGGER_MENTION = re.compile(r'logger(?:=| ``| `)"?([A-Za-z_][\w.]*)')


def unknown_loggers(root) -> list[tuple[str, str]]:
    """``(path, name)`` of each logger mentioned under ``root`` (sources, tests, docs) that
    no module of the packages creates (``logging.getLogger("name")``)."""
    files = [p for pkg in (*PACKAGES, "tests", "harness", "benchmarks", "docs")
             for p in (root / pkg).rglob("*") if p.suffix in (".py", ".md")]
    files += [root / "README.md"] if (root / "README.md").exists() else []
    created = {m for pkg in PACKAGES for p in (root / pkg).rglob("*.py")
               for m in re.findall(r'getLogger\("([\w.]+)"\)', p.read_text())}
    return sorted({(p.relative_to(root).as_posix(), name) for p in files
                   for name in LOGGER_MENTION.findall(p.read_text()) if name not in created})


def test_every_logger_named_exists(tmp_path):
    this = Path(__file__).relative_to(ROOT).as_posix()  # its examples name others
    assert [(p, n) for p, n in unknown_loggers(ROOT) if p != this] == []
    (tmp_path / "jaxhead").mkdir()
    (tmp_path / "jaxhead" / "d.py").write_text('logger = logging.getLogger("jaxhead")\n')
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "config.py").write_text(
        '"""falls back with a warning on logger ``"models"``."""\n')
    assert unknown_loggers(tmp_path) == [("models/config.py", "models")]


#: The constructors of ``train.config.domains`` (a call of one states a rule).
DOMAIN_MAKERS = {"integer", "number", "one_of", "boolean", "string", "names", "pairs",
                 "mapping", "Domain"}


def rule_statements(source: str) -> list[tuple[str, str]]:
    """The rules a module states: each call of a ``DOMAIN_MAKERS`` constructor (by its text,
    the module prefix dropped; once per module: a schema gives many keys one domain), and
    each set of named choices (a ``one_of`` of literal strings, or a module-level tuple of
    two or more literal strings, the form a hand-made ``value in CHOICES`` check takes), as
    ``("choices", the sorted names)``, as often as it is written."""
    calls, choices = set(), []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        name = isinstance(node, ast.Call) and getattr(
            node.func, "attr", getattr(node.func, "id", None))
        if name not in DOMAIN_MAKERS:
            continue
        words = [a.value for a in node.args
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if name == "one_of" and len(words) == len(node.args):
            choices.append(("choices", ", ".join(sorted(words))))
        else:
            calls.add((name, ast.unparse(ast.Call(ast.Name(name), node.args, node.keywords))))
    for node in tree.body:
        value = getattr(node, "value", None)
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(value, ast.Tuple) and (
                len(value.elts) >= 2 and all(isinstance(e, ast.Constant)
                                             and isinstance(e.value, str) for e in value.elts)):
            choices.append(("choices", ", ".join(sorted(e.value for e in value.elts))))
    return sorted(calls) + choices


def restated_rules(root, keys: list[str]) -> dict[str, list[str]]:
    """Each rule of a config value stated in more than one place under ``root/train``:

    * a rule (``rule_statements``) that two modules state: ``"<rule>" -> the modules``;
    * an error a module raises itself that states a rule of a config key (its message
      names the key, as ``section.key`` or by its path from a section, and says "must")
      instead of taking it from the rule's one statement (``Domain.require``,
      ``domains.enforce``, whose messages ``train/config/domains.py`` words):
      ``"<path>:<line>" -> [the key]``.
    """
    names = {".".join(k.split(".")[i:]) for k in keys for i in range(k.count("."))}
    named = re.compile(r"(?<![\w.])(" + "|".join(
        sorted(map(re.escape, names), key=len, reverse=True)) + r")(?!\w)")
    where: dict[str, list[str]] = {}
    out = {}
    for path in sorted((root / "train").rglob("*.py")):
        rel, source = path.relative_to(root).as_posix(), path.read_text()
        for kind, text in rule_statements(source):
            where.setdefault(f"{kind}: {text}", []).append(rel)
        if rel == "train/config/domains.py":
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = " ".join(n.value for n in ast.walk(node.exc)
                                if isinstance(n, ast.Constant) and isinstance(n.value, str))
                if "must" in text and (m := named.search(text)):
                    out[f"{rel}:{node.lineno}"] = [m.group(1)]
    out.update({rule: paths for rule, paths in where.items() if len(paths) > 1})
    return out


def _config_keys() -> list[str]:
    from train.config import domains
    from train.run import schema as config

    return list(domains.keys(config.schema()))


def test_each_rule_is_stated_once():
    """Each config value's rule (its domain, its relation to other keys) is stated in one
    place, where the value is used or in ``train/config/domains.py``; ``train/run/schema.py`` and
    the modules import it (``train.config.domains`` module docstring)."""
    from train.rl import rl_loss, rollout, updates
    from train.run import schema as config

    assert restated_rules(ROOT, _config_keys()) == {}
    schema = config.schema()
    for section, key, domain in [("loss", "old_logprobs", updates.OLD_LOGPROBS),
                                 ("loss", "logprob_support", rollout.LOGPROB_SUPPORT),
                                 ("loss", "negative_weight", rl_loss.NEGATIVE_WEIGHT),
                                 ("loss", "clip_ratio_c", rl_loss.OFF_OR_ABOVE_1),
                                 ("train", "mini_batches", updates.d.COUNT)]:
        assert schema[section][key].domain is domain, key
    assert updates.whole_groups in config.RELATIONS


def test_a_restated_rule_is_found(tmp_path):
    """On a copy of ``train/`` with each of the rules once stated twice (a domain written
    again in the schema, a choice list beside its domain, a hand-made range check, a
    relation checked again by hand), every copy is named."""
    for path in (ROOT / "train").rglob("*.py"):
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    keys = _config_keys()
    assert restated_rules(tmp_path, keys) == {}

    def edit(rel, old, new):
        text = (tmp_path / rel).read_text()
        assert old in text, (rel, old)
        (tmp_path / rel).write_text(text.replace(old, new, 1))

    edit("train/run/schema.py", 'Key("sampler", rollout.LOGPROB_SUPPORT)',
         'Key("sampler", d.one_of("sampler", "full"))')
    edit("train/rl/updates.py", "COUNTS = (", 'OLD_POLICIES = ("trainer", "sampler")\nCOUNTS = (')
    edit("train/run/schema.py", "Key(1.0, rl_loss.NEGATIVE_WEIGHT)", "Key(1.0, d.number(0, 1))")
    edit("train/rl/rl_loss.py",
         '    NEGATIVE_WEIGHT.require("loss.negative_weight", negative_weight)\n',
         "    if not 0 <= negative_weight <= 1:\n"
         '        raise ValueError(f"loss.negative_weight must be in [0, 1]: {negative_weight}")\n')
    edit("train/rl/updates.py", "        d.enforce(cfg, [whole_groups])\n",
         "        if cfg.rollout.prompts_per_step % cfg.train.mini_batches:\n"
         '            raise ValueError("train.mini_batches must divide the prompts")\n')
    found = restated_rules(tmp_path, keys)
    assert sorted(found.pop("choices: full, sampler")) == ["train/rl/rollout.py",
                                                          "train/run/schema.py"]
    assert found.pop("choices: sampler, trainer") == ["train/rl/updates.py"] * 2
    assert sorted(found.pop("number: number(0, 1)")) == ["train/config/domains.py",
                                                        "train/run/schema.py"]
    assert sorted(found.values()) == [["loss.negative_weight"], ["train.mini_batches"]]
    assert all(k.startswith(("train/rl/rl_loss.py:", "train/rl/updates.py:")) for k in found)
