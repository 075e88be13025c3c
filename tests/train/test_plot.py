"""The plots of the documentation: ``benchmarks/plots.py`` draws each from a benchmark's
printed output (the copies in ``docs/data/``), and the trainer's end-of-run line says how to
get the GRPO curve when matplotlib is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support import ROOT
from train.run import plot

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


def test_curve_shows_held_out_greedy_accuracy_during_grpo(tmp_path):
    """Issue 44: ``grpo_curve.png`` shows the held-out greedy accuracy at a few points of
    GRPO (``eval.curve_every``), not only the training reward; its ends are the before /
    after evaluations counted on the same problems (the first ``problems`` of the set)."""
    import json

    import numpy as np

    from train.run.evaluate import EvalResult
    from train.run.metrics import MetricsWriter

    rng = np.random.default_rng(0)
    w = MetricsWriter(tmp_path / "metrics.jsonl", tensorboard=False)
    for step in range(1, 7):
        w.write(step, {"reward_mean": 0.1 * step})
    for step, acc in ((2, 0.5), (4, 0.625)):
        w.write(step, {"greedy_accuracy": acc, "greedy_accuracy_se": 0.1, "problems": 8},
                kind="eval_greedy")
    ends = []
    for name, step, p in (("before", 0, 0.3), ("after", 6, 0.8)):
        res = EvalResult(rng.random((32, 2)), (rng.random(32) < p).astype(float), 1.0)
        (tmp_path / f"eval_{name}.json").write_text(json.dumps(res.to_json()))
        w.write(step, {"sampled_reward": 0.5, "sampled_reward_se": 0.01,
                       "greedy_accuracy": float(res.greedy_correct.mean()),
                       "greedy_accuracy_se": 0.01}, kind=f"eval_{name}")
        first = res.greedy_correct[:8]
        ends.append((step, first.mean(), first.std(ddof=1) / np.sqrt(8), 8))
    run = plot.read_run(tmp_path)
    assert [g[0] for g in run["greedy"]] == [0, 2, 4, 6]
    assert run["greedy"][1:3] == [(2, 0.5, 0.1, 8), (4, 0.625, 0.1, 8)]
    np.testing.assert_allclose([run["greedy"][0], run["greedy"][3]], ends)
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.write_or_hint(tmp_path, "a machine") == f"plot: {tmp_path / plot.FILE}"
        assert (tmp_path / plot.FILE).read_bytes()[:8] == PNG
