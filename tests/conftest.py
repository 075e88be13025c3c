"""Suite-wide hooks.

* Collection order: the tests that start multi-device subprocesses
  (``tests.support.multidevice``: minutes each, mostly compiling) run first, so that under
  ``pytest -n 2`` the short tests fill the workers' tails instead of one long test running
  alone at the end. Only the order changes, never what runs.
* Compiled code is released after each test module. Every XLA:CPU executable keeps about
  three memory mappings of JIT code (eager ops with a new shape compile too), and JAX's
  caches keep every executable alive: one pytest worker running half the suite reached
  Linux's default ``vm.max_map_count`` (65,530), after which LLVM's next code allocation
  fails and the worker aborts inside a compile. ``jax.clear_caches`` drops them (the
  mappings go with the executables); a module's own tests still share their compiles.
"""

from __future__ import annotations

import functools
import gc
from pathlib import Path

import jax
import pytest


@functools.cache
def _spawns(path: str) -> bool:
    text = Path(path).read_text()
    return "run_case(" in text or "run_multiprocess(" in text or "subprocess.run(" in text


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: not _spawns(str(item.path)))  # stable: order kept otherwise


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """After each module: drop JAX's compiled executables and their JIT code mappings."""
    yield
    jax.clear_caches()
    gc.collect()
