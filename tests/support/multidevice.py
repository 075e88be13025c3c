"""Run a test case in a fresh Python process that sees several CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=N`` only takes effect before JAX
initialises its backend, and the rest of the suite must keep one device, so every
multi-device case runs in its own subprocess (works the same under ``pytest -n``). A case
is a function ``"tests.<package>.<module>:<name>"`` returning a dict of JSON-able
measurements; the pytest test asserts on them, so a failure shows the numbers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from jax.sharding import AbstractMesh, AxisType

from models.mesh import AXES
from tests.support import ROOT

_MARK = "CASE-RESULT "


def abstract_mesh(**sizes: int) -> AbstractMesh:
    """An ``AbstractMesh`` with the ``models.mesh`` axes (unnamed sizes 1): stands in for
    a mesh of many devices wherever nothing is compiled (rules, shape checks)."""
    shape = tuple(sizes.get(a, 1) for a in AXES)
    return AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


#: XLA flags of the subprocess cases: LLVM optimisation off, about half the compile time
#: of a case (most of its time). The HLO is the same but not every value: float32 model
#: log-probs move by an ulp or two against the default flags' (and XLA:CPU's tiles stop
#: being batch-invariant, docs/numerics.md), so a case compares only programs compiled
#: with the same flags, and the invariant-numerics cases compile without these.
CASE_FLAGS = "--xla_backend_optimization_level=0"


def device_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a CPU subprocess with ``devices`` host devices (and
    ``CASE_FLAGS``; ``extra`` may replace ``XLA_FLAGS`` whole)."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = f"{CASE_FLAGS} {flags} --xla_force_host_platform_device_count={devices}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", **extra}


def _command(case: str) -> list[str]:
    module, name = case.split(":")
    code = (f"import importlib, json; m = importlib.import_module({module!r}); "
            f"print({_MARK!r} + json.dumps(m.{name}()), flush=True)")
    return [sys.executable, "-c", code]


def _result(proc_stdout: str, stderr: str, case: str) -> dict:
    for line in proc_stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise AssertionError(f"{case} printed no result; stderr tail:\n{stderr[-4000:]}")


def run_case(case: str, devices: int = 8, timeout: float = 600, **env: str) -> dict:
    """Run ``case`` (``"tests.<package>.<module>:<function>"``) with ``devices`` CPU
    devices and return its dict.

    Raises:
      AssertionError: the process failed (its stderr tail is shown).
    """
    proc = subprocess.run(
        _command(case), cwd=ROOT, env=device_env(devices, **env), capture_output=True, check=False,
        text=True, timeout=timeout,
    )
    if proc.returncode:
        raise AssertionError(f"{case} failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return _result(proc.stdout, proc.stderr, case)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_multiprocess(case: str, processes: int, devices_per_process: int,
                     timeout: float = 600, **env: str) -> list[dict]:
    """Run ``case`` in ``processes`` processes joined by ``jax.distributed`` on localhost
    (``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, read by
    ``train.run.distributed.initialize_distributed``; ``env``: more variables for all of them);
    returns each process's dict, in order."""
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            _command(case), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
            env=device_env(devices_per_process, JAX_COORDINATOR_ADDRESS=address,
                           JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i), **env),
        )
        for i in range(processes)
    ]
    outs = []
    try:
        for i, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=timeout)
            if proc.returncode:
                raise AssertionError(
                    f"{case} process {i} failed (rc={proc.returncode}):\n{stderr[-6000:]}")
            outs.append(_result(stdout, stderr, case))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs
