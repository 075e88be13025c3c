"""The README's Python examples run as written: every ```python block, in order, in one
namespace, except blocks right after a ``<!-- not run: reason -->`` line."""

from __future__ import annotations

import re

import pytest

from tests.support import ROOT

_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.DOTALL)


def readme_blocks() -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of each Python block of README.md."""
    text = (ROOT / "README.md").read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        skip = re.match(r"<!-- not run: (.*) -->", m.group("before").strip())
        out.append((line, m.group("code"), skip.group(1) if skip else None))
    return out


def test_readme_python_examples_run_as_written():
    blocks = readme_blocks()
    runnable = [(line, code) for line, code, skip in blocks if skip is None]
    assert len(runnable) >= 2, blocks  # the Use examples are found
    namespace: dict = {}
    for line, code in runnable:
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102
        except Exception as err:  # noqa: BLE001 - any failure of a block: its message is the point
            pytest.fail(f"README.md block at line {line} failed: {err!r}")
