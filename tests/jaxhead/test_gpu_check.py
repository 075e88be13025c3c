"""``benchmarks/gpu_check.py``: the CPU dry run (interpret mode) prints a full table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def dry_run():
    """One ``--dry-run`` of the script, for the tests of its tables."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_dry_run_prints_the_table(dry_run):
    proc = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()
            and line.split()[0] in ("reference", "xla", "pallas_triton")}
    assert set(rows) == {"reference", "xla", "pallas_triton"}, proc.stdout
    header = next(line.split() for line in lines if line.startswith("impl"))
    for name, row in rows.items():
        assert len(row) == len(header), row
        assert row[-1] == "True", f"{name} produced non-finite values"
    triton = dict(zip(header, rows["pallas_triton"]))
    assert float(triton["|dlogp|"]) < 1e-3 and float(triton["|dent|"]) < 1e-3
    assert float(triton["|ddh|"]) < 1e-3 and float(triton["|ddW|"]) < 1e-3
    assert "dry run (interpret mode)" in proc.stdout and "elapsed" in proc.stdout


def test_dry_run_checks_invariant_numerics_bit_for_bit(dry_run):
    """Issue #41 asks ``gpu_check.py`` to prove the invariant mode's bit-equality on a
    GPU: the dry run prints the same check on the CPU, and it holds there."""
    proc = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("numerics=invariant"))
    header, row = lines[start + 1].split(), lines[start + 2].split()
    check = dict(zip(header, row))
    assert check["dtype"] == "bfloat16" and int(check["tokens"]) > 0, proc.stdout
    assert check["bit_equal"] == "True" and float(check["max|diff|"]) == 0.0, proc.stdout


def test_full_run_refuses_without_a_gpu(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as `python benchmarks/gpu_check.py`
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert module.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().err
