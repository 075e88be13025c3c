"""The main job's GRPO stage teaches: held-out greedy accuracy rises well beyond the warm
start's (slow: excluded from the default suite; run with
``pytest -m slow tests/train/test_demo_seeds.py``).

It runs ``configs/grpo_tiny.py`` as the README's first command does (the same task split,
model, vocabulary, SFT warm start on 2 and 3 terms, GRPO on 4 terms) for its first 100 GRPO
steps, with the first 256 of its held-out problems (the curve's). The constant learning
rate makes these steps the same as the full run's first 100, so the full run's curve point
at step 100 is what this test measures. The measure is greedy accuracy, which no logit
scale moves: the config trains every parameter at one rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow

#: the greedy-accuracy gain the shortened run must exceed: below what it reached on seeds 0
#: and 1 (+0.110 and +0.070 at step 100 of their runs with 32 prompts a step;
#: docs/training.md, "Seeds and machines")
MARGIN = 0.05
#: seed 2 of the same config reached +0.027 at step 100 and did not learn after it
#: (docs/training.md, "Seeds and machines"): the config does not meet the target on it yet
SEED_2 = pytest.param(2, marks=pytest.mark.xfail(
    reason="issue 44: seed 2 gains +0.027 at step 100 (docs/training.md)", strict=False))


@pytest.mark.parametrize("seed", [0, 1, SEED_2])
def test_grpo_raises_held_out_greedy_accuracy(tmp_path, seed):
    """Issue 44: the main job's greedy accuracy rose by +0.001 ± 0.005 (its warm start
    already answered 97% of the held-out problems); GRPO must now teach what the warm
    start does not know."""
    work = tmp_path / f"seed{seed}"
    cmd = [sys.executable, "-m", "train.grpo", f"--config={ROOT / 'configs' / 'grpo_tiny.py'}",
           f"--config.workdir={work}", f"--config.seed={seed}",
           "--config.train.steps=100", "--config.eval.size=256", "--config.eval.samples=1"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=3600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = (np.asarray(json.loads((work / f"eval_{n}.json").read_text())
                                ["greedy_correct"]) for n in ("before", "after"))
    assert before.shape == after.shape == (256,)
    assert before.mean() < 0.5, before.mean()  # a warm start with room to gain
    d = after - before
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert d.mean() > MARGIN and d.mean() > 2 * se, (seed, d.mean(), se)
