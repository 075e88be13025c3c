"""Suite-wide collection order: the tests that start multi-device subprocesses
(``tests.support.multidevice``: minutes each, mostly compiling) run first, so that under
``pytest -n 2`` the short tests fill the workers' tails instead of one long test running
alone at the end. Only the order changes, never what runs."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _spawns(path: str) -> bool:
    text = Path(path).read_text()
    return "run_case(" in text or "run_multiprocess(" in text or "subprocess.run(" in text


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: not _spawns(str(item.path)))  # stable: order kept otherwise
