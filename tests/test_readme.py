"""The documentation holds: the Python examples of README.md and docs/*.md run as written
(every ```python block of a page, in order, in one namespace per page, except blocks right
after a ``<!-- not run: reason -->`` line), and every relative link in them resolves to a
file inside the repository (and to a heading of it when it names one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import ROOT

_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.DOTALL)
_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of each Python block of a Markdown text."""
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        skip = re.match(r"<!-- not run: (.*) -->", m.group("before").strip())
        out.append((line, m.group("code"), skip.group(1) if skip else None))
    return out


def anchor(heading: str) -> str:
    """The anchor a forge gives a Markdown heading: lower case, punctuation dropped
    (hyphens and underscores kept), spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Anchors of the headings of a Markdown text (outside code blocks)."""
    text = _FENCE.sub("", text)
    return {anchor(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.MULTILINE)}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` that do not resolve to a file inside ``root`` (or to
    a heading of it, for ``file#anchor`` and ``#anchor``), each with the reason."""
    text = page.read_text()
    bad = []
    for m in _LINK.finditer(_FENCE.sub("", text)):
        target = m.group("target")
        if _EXTERNAL.match(target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(root.resolve()):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{frag} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run_as_written(page):
    namespace: dict = {}
    for line, code, skip in python_blocks(page.read_text()):
        if skip is not None:
            continue
        name = f"{page.relative_to(ROOT)}:{line}"
        try:
            exec(compile(code, name, "exec"), namespace)  # noqa: S102
        except Exception as err:  # noqa: BLE001 - any failure of a block: its message is the point
            pytest.fail(f"{name}: the block failed: {err!r}")


def test_the_readme_has_its_examples():
    runnable = [b for b in python_blocks((ROOT / "README.md").read_text()) if b[2] is None]
    assert len(runnable) >= 2, runnable  # the Use examples are found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    assert broken_links(page) == []


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some `code` here\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#some-code-here) [web](https://example.org/x)\n"
        "[gone](docs/b.md) [up](../outside.md) [anchor](docs/a.md#nowhere) [self](#a-page)\n"
        "```\n[in a code block](not/checked.md)\n```\n")
    assert broken_links(page, tmp_path) == [
        "docs/b.md: no such file", "../outside.md: outside the repository",
        "docs/a.md#nowhere: no heading #nowhere in a.md",
        "#a-page: no heading #a-page in README.md"]
