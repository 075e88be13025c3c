"""The main job's reward rises from its first GRPO steps on more than one seed (slow:
excluded from the default suite; run with ``pytest -m slow tests/train/test_demo_seeds.py``:
373 s on a 2-core AMD EPYC, 197 s and 176 s per seed).

Each seed runs ``configs/grpo_tiny.py`` as the README's first command does (the
same task, model, vocabulary, SFT warm start and GRPO settings; the ``seed`` changes the
model init, the data order and the sampling noise) for its first 30 GRPO steps, with a
256-problem held-out set. The measure is the policy's probability of the reference answer
on the held-out problems (the expected reward, counted on the reference spelling): unlike
a sampled reward it has no sampling noise, so a few steps' gain is visible. The warm start
must be the config's own: after a 150-step SFT stage, seed 1's first 20 GRPO steps
lowered this measure (by 0.0023 +- 0.0007).
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


@pytest.mark.parametrize("seed", [1, 2])
def test_first_grpo_steps_raise_the_reward(tmp_path, seed):
    work = tmp_path / f"seed{seed}"
    cmd = [sys.executable, "-m", "train.grpo", f"--config={ROOT / 'configs' / 'grpo_tiny.py'}",
           f"--config.workdir={work}", f"--config.seed={seed}",
           "--config.train.steps=30", "--config.eval.size=256", "--config.eval.samples=1"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=1800, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = (np.asarray(json.loads((work / f"eval_{n}.json").read_text())
                                ["answer_prob"]) for n in ("before", "after"))
    assert before.shape == after.shape == (256,)
    assert 0.05 < before.mean() < 0.95, before.mean()  # a warm start with room to gain
    d = after - before
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert d.mean() > 3 * se, (seed, d.mean(), se)
