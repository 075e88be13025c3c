"""The README's API table is the API: every call written in it (``name(param, ...)``) is
checked against ``inspect.signature`` of the callable it names.

In the table's first column a call is a signature: its parameters in order, the ``*``
where keyword-only ones start, each default as written (``...`` stands for parameters
left out; without it the list is complete). In the description column a call lists
parameter names in order (``XlaConfig(token_chunk, ...)``); ``head(...)`` /
``head.sharded(...)`` are ``LMHead.__call__`` / ``LMHead.sharded``."""

from __future__ import annotations

import ast
import inspect
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxhead
from tests.support import ROOT

_CALL = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\((?P<params>.*)\)$")
_METHODS = {"head": jaxhead.LMHead.__call__, "head.sharded": jaxhead.LMHead.sharded}
_NAMESPACE = {"jnp": jnp, "np": np, "nnx": nnx, "lecun_normal": nnx.initializers.lecun_normal}
_ELIDED = object()


def table_rows(text: str) -> list[tuple[str, str]]:
    """``(first cell, description)`` of each row of the table under the heading ``## Use``
    whose first column is ``API``."""
    section = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows and rows[0].startswith("| API |"), "no API table under ## Use"
    out = []
    for line in rows[1:]:  # after the header (the separator "|---|" has no space)
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        out.append((cells[0], " | ".join(cells[1:])))
    return out


def calls(cell: str) -> list[tuple[str, str]]:
    """``(name, parameter text)`` of every backticked call in a cell."""
    found = []
    for code in re.findall(r"`([^`]+)`", cell):
        m = _CALL.match(code.strip())
        if m:
            found.append((m.group("name"), m.group("params")))
    return found


def split_params(text: str) -> list[str]:
    """Parameters at the top level of a call's parentheses (defaults may hold calls)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


def target(name: str):
    """The callable a table name stands for and its parameters (a class whose signature
    is only ``*args, **kwargs``, as an ``nnx.Module``'s: its ``__init__``'s)."""
    if name in _METHODS:
        fn = _METHODS[name]
        params = list(inspect.signature(fn).parameters.values())[1:]
        return fn, params
    obj = getattr(jaxhead, name, None)
    assert obj is not None, f"the README's API table names {name}, which jaxhead lacks"
    params = list(inspect.signature(obj).parameters.values())
    if isinstance(obj, type) and {p.kind for p in params} <= {inspect.Parameter.VAR_POSITIONAL,
                                                              inspect.Parameter.VAR_KEYWORD}:
        params = list(inspect.signature(obj.__init__).parameters.values())[1:]  # an nnx.Module
    return obj, [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _default(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return eval(text, dict(_NAMESPACE))  # the README's own text: jnp.float32, ...


def signature_errors(name: str, text: str, strict: bool) -> list[str]:
    """How the table's ``name(text)`` differs from the callable's signature."""
    _, actual = target(name)
    by_name = {p.name: p for p in actual}
    listed = split_params(text)
    elided = "..." in listed
    errors = []
    keyword_only = False
    order = []
    for item in listed:
        if item == "...":
            continue
        if item == "*":
            keyword_only = True
            continue
        pname, eq, default = (s.strip() for s in item.partition("="))
        p = by_name.get(pname)
        if p is None:
            errors.append(f"{name}: no parameter {pname!r} (it has {list(by_name)})")
            continue
        order.append(pname)
        if not strict:
            continue
        if keyword_only != (p.kind == p.KEYWORD_ONLY):
            errors.append(f"{name}: {pname!r} is {p.kind.description}, the table shows it "
                          f"{'keyword-only' if keyword_only else 'positional'}")
        if not eq and p.default is not p.empty:
            errors.append(f"{name}: {pname!r} is shown required but defaults to {p.default!r}")
        elif eq and p.default is p.empty:
            errors.append(f"{name}: {pname!r} is shown with default {default} but is required")
        elif eq:
            want = _default(default)
            comparable = not callable(p.default) or isinstance(p.default, type)
            if comparable and not (want == p.default and type(want) is type(p.default)):
                errors.append(f"{name}: {pname!r} defaults to {p.default!r}, the table says "
                              f"{default}")
    actual_order = [p.name for p in actual if p.name in order]
    if order != actual_order:
        errors.append(f"{name}: parameters in the order {order}, the signature's is "
                      f"{actual_order}")
    missing = [p.name for p in actual if p.name not in order]
    if not elided and missing:
        errors.append(f"{name}: the table leaves out {missing} without '...'")
    return errors


def test_the_api_table_matches_the_signatures():
    rows = table_rows((ROOT / "README.md").read_text())
    checked, errors = [], []
    for first, description in rows:
        for strict, cell in ((True, first), (False, description)):
            for name, params in calls(cell):
                if name in _METHODS or hasattr(jaxhead, name):
                    checked.append(name)
                    errors += signature_errors(name, params, strict)
    assert not errors, "\n".join(errors)
    public_functions = {n for n in jaxhead.__all__ if inspect.isfunction(getattr(jaxhead, n))}
    assert public_functions <= set(checked), public_functions - set(checked)
    assert {"LMHead", "head", "head.sharded", "XlaConfig"} <= set(checked)


@pytest.mark.parametrize(("row", "want"), [
    ("bucket_ladder(max_size)", "leaves out ['multiple', 'growth']"),
    ("LMHead(hidden_size, vocab_size, *, rngs, ...)", "'rngs' is shown required"),
    ("sample(hidden, weight, key, temperature=1.0, ...)", "'temperature' is keyword-only"),
    ("token_logprobs(hidden, weight, labels, keep=None, *, ..., ignore_index=-1, ...)",
     "'ignore_index' defaults to -100"),
    ("keep_mask(*, segment_ids=None, loss_mask=None, ...)", "in the order"),
])
def test_the_check_finds_a_wrong_row(row, want):
    name, params = calls(f"`{row}`")[0]
    assert any(want in e for e in signature_errors(name, params, strict=True))
