"""The command line without training: ``--print_config``, the help flags, and one-line
errors for a config file that does not exist and a missing ``--config``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from models import DEFAULT_RULES
from tests.support import ROOT
from train.config.cli import leaf_keys, load_config, resolved

MICRO = "configs/grpo_micro.py"


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=300)


def test_resolved_lists_every_key():
    cfg = load_config(str(ROOT / MICRO))
    lines = resolved(cfg).splitlines()
    assert [line.split(" = ")[0] for line in lines] == leaf_keys(cfg)
    assert "data.tasks = ('chain_sum',)" in lines and "train.optim.frozen = ()" in lines
    assert "model.overrides.vocab_size = 151936" in lines


@pytest.mark.parametrize("module", ["train.grpo", "train.sft"])
def test_print_config_exits_0_with_every_key(module):
    out = _run(module, f"--config={MICRO}", "--config.train.steps=7",
               "--config.data.tasks=('chain_sum', 'basic_arithmetic')", "--print_config")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "train.steps = 7" in lines
    assert "data.tasks = ('chain_sum', 'basic_arithmetic')" in lines
    assert f"mesh.rules = {tuple(DEFAULT_RULES)!r}" in lines  # the rules are config data
    assert "('embed', ('fsdp', 'context'))" in repr(tuple(DEFAULT_RULES))
    keys = leaf_keys(load_config(str(ROOT / MICRO)))
    assert [line.split(" = ")[0] for line in lines] == keys


def test_helpfull_exits_0_and_lists_the_config_keys():
    out = _run("train.grpo", f"--config={MICRO}", "--helpfull")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--[no]print_config" in out.stdout
    assert f"Config keys of {MICRO}" in out.stdout and "loss.beta = 0.0" in out.stdout
    plain = _run("train.sft", "--help")
    assert plain.returncode == 0 and "--print_config" in plain.stdout


def test_missing_config_file_is_one_line():
    out = _run("train.grpo", "--config=configs/no_such.py")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        ("error: config file 'configs/no_such.py' does not exist (--config=PATH, e.g. "
        "--config=configs/grpo_tiny.py)")]
    missing = _run("train.sft")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "error: --config=PATH is required, e.g. --config=configs/grpo_tiny.py"]
