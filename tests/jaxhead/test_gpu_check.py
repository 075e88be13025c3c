"""``benchmarks/gpu_check.py``: the CPU dry run (interpret mode) prints a full table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def test_dry_run_prints_the_table():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        capture_output=True, text=True, timeout=120, check=False,
    )
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


def test_full_run_refuses_without_a_gpu(capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    assert module.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().err
