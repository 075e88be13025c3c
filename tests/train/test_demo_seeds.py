"""The main job's GRPO stage teaches: held-out greedy accuracy rises well beyond the warm
start's on every seed tried (slow: excluded from the default suite; run with
``pytest -m slow tests/train/test_demo_seeds.py``, about 10 minutes a seed on 2 cores and
20 for the one-thread case: about an hour).

It runs ``configs/grpo_tiny.py`` as the README's first command does (the same task split,
model, vocabulary, SFT warm start on 2 to 4 terms, 200 GRPO steps on 4 terms, the same
2,048 held-out problems, so the same training data), shortened where it does not change
the training: one sample per held-out problem instead of 4 and no greedy curve during
GRPO. The measure is greedy accuracy, which no logit scale moves: the config trains every
parameter at one rate. Besides the three seeds, seed 0 runs again with XLA:CPU's matmuls on
one thread of one core, so that they sum in another order: another machine's rounding,
imitated (its warm start and its samples differ from the first step).

"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow

#: the greedy-accuracy gain each run must reach: the issue's bar for every run, below what
#: every run tried reached (docs/training.md, "Seeds and machines")
MARGIN = 0.08
#: XLA:CPU's matmuls on one thread, the process on one core
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


@pytest.mark.parametrize("seed, one_thread", [(0, False), (1, False), (2, False), (0, True)],
                         ids=["seed0", "seed1", "seed2", "seed0-one-thread"])
def test_grpo_raises_held_out_greedy_accuracy(tmp_path, seed, one_thread):
    """Issue 44: the main job's greedy accuracy rose by +0.001 ± 0.005 (its warm start
    already answered 97% of the held-out problems), and then, with a warm start on easier
    sums, by +0.012 on seed 2; GRPO must teach what the warm start does not know, on every
    seed and on another machine's rounding, with room left above the warm start."""
    work = tmp_path / f"seed{seed}"
    cmd = [sys.executable, "-m", "train.grpo", f"--config={ROOT / 'configs' / 'grpo_tiny.py'}",
           f"--config.workdir={work}", f"--config.seed={seed}",
           "--config.eval.samples=1", "--config.eval.curve_every=0"]
    # the flags of the documented runs, whatever the caller's environment sets
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=ONE_THREAD if one_thread else "")
    if one_thread:
        taskset = shutil.which("taskset")
        if taskset is None or not hasattr(os, "sched_getaffinity"):
            pytest.skip("pinning the run to one core needs taskset (util-linux)")
        cmd = [taskset, "-c", str(min(os.sched_getaffinity(0))), *cmd]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=3600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = (np.asarray(json.loads((work / f"eval_{n}.json").read_text())
                                ["greedy_correct"]) for n in ("before", "after"))
    assert before.shape == after.shape == (2048,)
    assert before.mean() < 0.8, before.mean()  # a warm start with room to gain
    d = after - before
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert d.mean() > MARGIN and d.mean() > 2 * se, (seed, d.mean(), se)
