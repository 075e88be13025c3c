"""``python -m train.grpo`` on two CPU processes x 2 devices joined by ``jax.distributed``
on localhost (data=2 x expert=2, the micro config on the tiny MoE) logs the same
losses as one process with 4 devices; only process 0 writes metrics; the checkpoint the
two processes wrote together restores in this (one-device) pytest process.

The three trainer processes run at the same time; they share a persistent XLA
compilation cache with the other end-to-end tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from tests.support import ROOT
from tests.support.multidevice import device_env, free_port

MICRO = str(ROOT / "configs" / "grpo_micro.py")
ARGS = ("--config.model.preset=tiny-moe", "--config.mesh.data=2", "--config.mesh.expert=2",
        "--config.sft.steps=0", "--config.eval.before_after=False",
        "--config.loss.beta=0.01", "--config.loss.entropy_coef=0.01",
        "--config.train.optim.warmup_steps=0", "--config.metrics.tensorboard=False")
COMPARED = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "approx_kl_old",
            "logprob_diff_mean", "reward_mean", "completion_length_mean")


def _train(workdir, devices: int, cache, *extra: str, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "train.grpo", f"--config={MICRO}",
           f"--config.workdir={workdir}", *ARGS, *extra]
    env = device_env(devices, JAX_COMPILATION_CACHE_DIR=str(cache),
                     JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait(procs: dict[str, subprocess.Popen], timeout: float = 900) -> dict[str, tuple]:
    outs = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"{name} failed:\n{stderr[-5000:]}"
            outs[name] = (stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def _train_records(workdir) -> list[dict]:
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def _restore(workdir, step: int):
    """Params and optimiser state of ``<workdir>/grpo`` at ``step`` restored on this
    process's one device (the target shardings of a default mesh)."""
    from train.config.cli import load_config
    from train.rl import state
    from train.rl.optim import make_optimizer
    from train.rl.placement import Placement
    from train.run import setup
    from train.run.checkpoint import Checkpointer

    cfg = load_config(MICRO)
    cfg.model.preset = "tiny-moe"
    mdef = state.ModelDef.of(setup.model_config(cfg))
    placement = Placement.from_config(cfg, mdef)
    tx, _ = make_optimizer(cfg.train.optim, cfg.train.steps)
    ckpt = Checkpointer(Path(workdir) / "grpo", every=1, keep=10)
    try:
        items, meta = ckpt.restore(placement.abstract_state(tx), step)
    finally:
        ckpt.close()
    assert meta["step"] == step
    return items, placement


def test_two_processes_train_like_one_process(tmp_path, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp().parent / "jax_compilation_cache"
    one, two = tmp_path / "one", tmp_path / "two"
    address = f"127.0.0.1:{free_port()}"
    procs = {
        "one process x 4 devices": _train(one, 4, cache),
        # process 0 from flags, process 1 from the environment: both ways of joining
        "process 0": _train(two, 2, cache, f"--config.distributed.coordinator_address={address}",
                            "--config.distributed.num_processes=2",
                            "--config.distributed.process_id=0"),
        "process 1": _train(two, 2, cache, JAX_COORDINATOR_ADDRESS=address,
                            JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1"),
    }
    outs = _wait(procs)

    ref, got = _train_records(one), _train_records(two)
    assert [r["step"] for r in ref] == [r["step"] for r in got] == [1, 2]  # written once
    for r, g in zip(ref, got, strict=True):
        for key in COMPARED:
            assert abs(g[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (r["step"], key)
    assert got[1]["kl"] > 0 and got[0]["grad_norm"] > 0  # the first step moved the policy
    assert "grpo:" in outs["process 0"][1] and "grpo:" not in outs["process 1"][1]  # tqdm

    two_items, placement = _restore(two, 2)
    one_items, _ = _restore(one, 2)
    assert placement.mesh.size == 1
    for name in ("params", "opt_state"):
        leaves = list(zip(jax.tree.leaves(two_items[name]), jax.tree.leaves(one_items[name]),
                          strict=True))
        assert leaves
        for a, b in leaves:
            assert len(a.sharding.device_set) == 1
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert os.path.isdir(two / "grpo" / "2")
