"""Configs are data: every config file loads, list values are tuples, the sharding rules
default to the models' rules, ``configs`` is a package, and tuple overrides parse on the
command line (ml_collections, as ``python -m train.grpo`` parses them)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from ml_collections import ConfigDict

from models import DEFAULT_RULES
from tests.support import ROOT
from train.config.cli import leaf_keys, load_config

MICRO = str(ROOT / "configs" / "grpo_micro.py")
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py")


def _leaves(cfg: ConfigDict):
    for key in leaf_keys(cfg):
        value = cfg
        for part in key.split("."):
            value = value[part]
        yield key, value


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_configs_load_and_hold_tuples(path):
    cfg = load_config(str(path))
    assert isinstance(cfg.data.tasks, tuple) and all(isinstance(t, str) for t in cfg.data.tasks)
    assert cfg.mesh.rules == DEFAULT_RULES
    for section in ("sft", "train"):
        assert isinstance(cfg[section].optim.frozen, tuple)
        assert isinstance(cfg[section].optim.lr_multipliers, tuple)
    lists = [k for k, v in _leaves(cfg) if isinstance(v, list)]
    assert lists == []


def test_configs_is_a_package():
    from configs import grpo_tiny, sft_tiny

    sft, grpo = sft_tiny.get_config(), grpo_tiny.get_config()
    assert sft.workdir == "runs/sft_tiny" and sft.train.steps == 0
    sft.workdir, sft.train.steps = grpo.workdir, grpo.train.steps
    assert sft.to_dict() == grpo.to_dict()


def test_tuple_overrides_parse_on_the_command_line():
    argv = ["prog", f"--config={MICRO}",
            "--config.data.tasks=('chain_sum', 'basic_arithmetic')",
            "--config.train.optim.frozen=('embed_tokens',)",
            "--config.train.optim.lr_multipliers=(('norm', 50.0), ('layers.0', 2.0))",
            "--config.mesh.rules=(('expert', None), ('embed', ('fsdp', 'tensor')))",
            "--config.sft.optim.frozen=embed_tokens"]  # a bare word: a 1-tuple
    code = ("import sys; from train.config import cli; cli.parse_flags(sys.argv); c = cli.config(); "
            "print(repr((c.data.tasks, c.train.optim.frozen, c.sft.optim.frozen, "
            "c.train.optim.lr_multipliers, c.mesh.rules)))")
    out = subprocess.run([sys.executable, "-c", code, *argv[1:]], cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ast.literal_eval(out.stdout.strip().splitlines()[-1]) == (
        ("chain_sum", "basic_arithmetic"), ("embed_tokens",), ("embed_tokens",),
        (("norm", 50.0), ("layers.0", 2.0)), (("expert", None), ("embed", ("fsdp", "tensor"))))
