"""The GRPO command run as a user runs it, in a subprocess, on a config file the test
writes: its ``metrics.jsonl`` records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def train_records(tmp_path: Path, name: str, config_text: str) -> list[dict]:
    """``python -m train.grpo`` on ``config_text`` (written to ``tmp_path/<name>.py``, the
    run's workdir ``tmp_path/<name>``, CPU): its ``"train"`` records in step order.

    The runs of a test session share JAX's persistent compilation cache (beside the
    session's temporary directories, as ``tests/train/test_e2e.py``'s): runs of configs
    that differ in one setting compile the rest once.

    Raises:
      AssertionError: the command failed (its stderr's tail shown).
    """
    config = tmp_path / f"{name}.py"
    config.write_text(config_text)
    work = tmp_path / name
    cache = tmp_path.parent.parent / "jax_compilation_cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    out = subprocess.run([sys.executable, "-m", "train.grpo", f"--config={config}",
                          f"--config.workdir={work}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]
