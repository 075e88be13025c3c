"""The plots of the documentation: ``benchmarks/plots.py`` draws each from a benchmark's
printed output (the copies in ``docs/data/``), and the trainer's end-of-run line says how to
get the GRPO curve when matplotlib is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support import ROOT
from train import plot

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, data", [("head-memory", "head_memory.txt"),
                                        ("memory-breakdown", "memory_v6e.txt")])
def test_each_plot_is_drawn_by_one_command_from_a_benchmark_output(name, data, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    proc = subprocess.run([sys.executable, "benchmarks/plots.py", name, f"docs/data/{data}",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert out.read_bytes()[:8] == PNG


def test_without_matplotlib_the_run_says_how_to_get_its_curve(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    line = plot.write_or_hint(tmp_path, "a machine")
    assert line == (f"plot: matplotlib is not installed; pip install -e '.[plots]', then "
                    f"python benchmarks/plots.py grpo-curve {tmp_path}")
    assert list(tmp_path.iterdir()) == []
