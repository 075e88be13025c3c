"""``replaced``: a module attribute of Tunix swapped for the block, put back on exit."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType


@contextlib.contextmanager
def replaced(module: ModuleType, name: str, make: Callable) -> Iterator[None]:
    """Inside the block ``module.name`` is ``make(original)``; on exit, errors included,
    it is ``original`` again (blocks nest: each restores what it found). Not thread-safe
    while entering or leaving."""
    original = getattr(module, name)
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)
