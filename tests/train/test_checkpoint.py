"""``train.run.checkpoint``: opening a directory leaves nothing running behind it, a writer
removes unfinished temporaries before it returns, and a read-only view changes nothing.

The reported case: ``python -m train.grpo`` on a finished params-only stage asked for more
steps exits with a one-line error, but orbax's background cleanup of the stage directory
(started by opening it) was still running at the interpreter's shutdown and printed a
``RuntimeError: cannot schedule new futures after interpreter shutdown`` traceback.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from tests.support import ROOT
from train.run.checkpoint import Checkpointer, check_resumable, require_checkpoint

TMP = "3.orbax-checkpoint-tmp-1796531869"  # a step orbax began and never renamed


def _write(directory, steps, with_opt_state=False):
    ckpt = Checkpointer(directory, every=1, keep=10)
    for step in steps:
        items = {"params": {"w": jnp.arange(4.0) + step}}
        if with_opt_state:
            items["opt_state"] = {"m": jnp.zeros(4)}
        ckpt.save(step, items, {"step": step})
    ckpt.close()


def test_a_writer_removes_unfinished_steps_before_returning(tmp_path):
    _write(tmp_path, [1, 2])
    (tmp_path / TMP / "params").mkdir(parents=True)
    assert ocp.path.step.tmp_checkpoints(tmp_path) == [TMP]  # orbax's own name for one
    ckpt = Checkpointer(tmp_path, every=1, keep=10)
    assert not (tmp_path / TMP).exists()  # already gone: nothing left to a thread
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()


def test_a_read_only_view_changes_nothing_and_cannot_save(tmp_path):
    _write(tmp_path, [1, 2])
    (tmp_path / TMP).mkdir()
    view = require_checkpoint(tmp_path)
    assert view.latest_step() == 2 and (tmp_path / TMP).is_dir()
    assert float(view.restore({"params": {"w": jnp.zeros(4)}})[0]["params"]["w"][0]) == 2.0
    with pytest.raises(ValueError, match="open read-only: cannot save step 3"):
        view.save(3, {"params": {"w": jnp.zeros(4)}}, {})
    view.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", TMP]
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        require_checkpoint(tmp_path / TMP)


@pytest.mark.parametrize("opener", ["check_resumable", "require_checkpoint", "writer"])
def test_a_process_that_exits_right_after_opening_prints_nothing(tmp_path, opener):
    """Every way the trainer opens a directory, then exits at once (the error paths): no
    traceback from a thread left running at shutdown, whatever temporaries it held."""
    _write(tmp_path, [2])
    for i in range(20):
        (tmp_path / f"{10 + i}.orbax-checkpoint-tmp-{1000 + i}").mkdir()
    calls = {"check_resumable": f"check_resumable({str(tmp_path)!r}, 5)",
             "require_checkpoint": f"require_checkpoint({str(tmp_path)!r}).close()",
             "writer": f"Checkpointer({str(tmp_path)!r}, 1, 2).close()"}
    script = textwrap.dedent(f"""
        from train.run.checkpoint import Checkpointer, check_resumable, require_checkpoint
        {calls[opener]}
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == (1 if opener == "check_resumable" else 0), out.stderr[-2000:]
    assert "Traceback" not in out.stderr or opener == "check_resumable", out.stderr[-2000:]
    if opener == "check_resumable":  # the stage's own error, and nothing after it
        assert out.stderr.count("Traceback") == 1 and out.stderr.rstrip().endswith(
            "use another workdir (or start from those parameters with "
            f"init.sft_checkpoint={str(tmp_path)!r})"), out.stderr[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name)
    assert left == ([] if opener == "writer" else sorted(
        f"{10 + i}.orbax-checkpoint-tmp-{1000 + i}" for i in range(20)))


def test_check_resumable_names_the_directory_and_the_way_out(tmp_path):
    _write(tmp_path, [2])
    with pytest.raises(ValueError, match="finished at step 2 and kept its final parameters"):
        check_resumable(tmp_path, 5)
    check_resumable(tmp_path, 2)  # finished: nothing to resume
    check_resumable(tmp_path / "absent", 5)
    assert not (tmp_path / "absent").exists()
