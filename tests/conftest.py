"""Suite-wide hooks.

* Collection order: the tests that start multi-device subprocesses
  (``tests.support.multidevice``: minutes each, mostly compiling) run first, so that under
  ``pytest -n 2`` the short tests fill the workers' tails instead of one long test running
  alone at the end. Only the order changes, never what runs.
* Compiled code is released when a worker holds too much of it. Every XLA:CPU executable
  keeps about three memory mappings of JIT code (eager ops with a new shape compile too),
  and JAX's caches keep every executable alive: one pytest worker running half the suite
  went past 19,600 mappings by a third of the run, and a process at Linux's default
  ``vm.max_map_count`` (65,530) fails its next compile ("LLVM compilation error: Cannot
  allocate memory") and dies. After a module, if the worker holds over ``MAX_MAPPINGS``,
  ``jax.clear_caches`` drops the executables (the mappings go with them); below it the
  compiled code stays, for the next modules to reuse.
* One persistent compilation cache for the run (``JAX_COMPILATION_CACHE_DIR``, shared by
  the pytest workers and every subprocess a test starts; removed when the run ends): what
  one module, process or worker compiled is not compiled again by another. Its keys hold
  the program, the devices, the compile options and ``XLA_FLAGS``, so a hit is the same
  executable.
"""

from __future__ import annotations

import functools
import gc
import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

# in the environment, for the subprocesses the tests start; in jax's config, for this one
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())  # one per run
CACHE = Path(tempfile.gettempdir()) / f"jaxhead-tests-jax-cache-{_RUN}"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


@functools.cache
def _spawns(path: str) -> bool:
    text = Path(path).read_text()
    return "run_case(" in text or "run_multiprocess(" in text or "subprocess.run(" in text


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: not _spawns(str(item.path)))  # stable: order kept otherwise


#: A third of Linux's default vm.max_map_count: room for a module's compiles on top.
MAX_MAPPINGS = 20_000


def _mappings() -> int:
    """This process's memory mappings (0 where ``/proc`` has none)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """After a module: drop JAX's compiled executables and their JIT code mappings if the
    worker holds more than ``MAX_MAPPINGS``."""
    yield
    if _mappings() > MAX_MAPPINGS:
        jax.clear_caches()
        gc.collect()


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput"):  # the controller, after every worker
        shutil.rmtree(CACHE, ignore_errors=True)
