"""The shipped GRPO configs learn as shipped: each, shrunk to a tiny model of its family
(dense, or MoE for the 30B preset; vocabulary 512, random prompts) with every training
setting kept (parameter and compute dtypes, optimizer, learning rate and schedule, updates
per batch, mini- and micro-batches, remat, loss), runs three GRPO steps through the
trainer's own ``GRPOIteration`` on the same rollouts (drawn once, with rewards that vary
within every group). Its parameter updates match the same steps with float32 parameters
and compute, tensor by tensor, and >= 98% of the entries those steps move do move.

The reported case: the 30B preset shipped bfloat16 parameters at lr 1e-6; the updates
rounded away (0% of the entries moved here, 0.39% in six steps). The bound on the
relative update error is set from seeds: 0.5 against a largest measured 0.36 (seeds 0-2,
both presets; always a norm scale, whose updates at lr 1e-6 are one or two float32
spacings at 1.0, which bf16 compute flips for some entries; bfloat16 parameters: 1.0). The
share of entries moved, over three rollout keys (100, 200, 300 + step): 98.6-99.2% for the
MoE preset (bf16 routing sends some tokens to other experts than float32 does, so a few
expert rows the reference reaches get no gradient) and 99.3-99.4% for the dense one; the
bound is 98%."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import ROOT
from train.config.cli import load_config
from train.data.tasks import Problem
from train.rl import rollout
from train.rl.placement import Placement
from train.rl.rollout_settings import RolloutSettings
from train.rl.state import ModelDef
from train.run import grpo_stage, setup
from train.run.loop import Loop
from train.run.metrics import MetricsWriter

STEPS, P_PER_MINI, G, VOCAB = 3, 2, 4, 512
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16}
#: config file -> the tiny model of its family
CONFIGS = {"grpo_qwen3_0p6b": ("tiny", SMALL),
           "grpo_qwen3_30b_a3b": ("tiny-moe", {**SMALL, "num_experts": 4,
                                               "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 32}),
           "grpo_tiny": ("tiny", SMALL), "grpo_micro": ("tiny", SMALL)}
#: float32 configs: one run each, nothing to compare (-m slow)
FLOAT32 = ("grpo_tiny", "grpo_micro")
BOUND = 0.5


def shrunk(name: str, *, float32: bool = False):
    """The config ``name`` with a tiny model, small batches and one device; every setting
    of the training kept (``float32``: parameters and compute in float32)."""
    cfg = load_config(str(ROOT / "configs" / f"{name}.py"))
    cfg.model.hf_checkpoint, (cfg.model.preset, cfg.model.overrides) = "", CONFIGS[name]
    if float32:
        cfg.model.dtype = cfg.model.param_dtype = "float32"
    cfg.rollout.prompts_per_step = P_PER_MINI * cfg.train.mini_batches
    cfg.rollout.group_size, cfg.rollout.max_new_tokens = G, 6
    cfg.train.row_len, cfg.train.row_multiple = 128, 2
    for axis in ("fsdp", "expert", "context", "tensor"):
        cfg.mesh[axis] = 1
    cfg.mesh.data = -1
    return cfg


def _setup(cfg, workdir) -> setup.Setup:
    """What ``GRPOIteration`` reads of a run's setup: the model and its placement."""
    model = setup.model_config(cfg)
    mdef = ModelDef.of(model.replace(remat=True) if cfg.model.remat else model)
    return setup.Setup(Path(workdir), None, None, [], set(), mdef, None,
                       Placement.from_config(cfg, mdef),
                       MetricsWriter(Path(workdir) / "m.jsonl", enabled=False),
                       RolloutSettings.from_config(cfg))


@functools.cache
def _rollouts(name: str):
    """``(params0, problems, rollouts, rewards)`` of the config's family: the float32 model's
    initial parameters and its rollouts of random prompts, one per step."""
    cfg = shrunk(name, float32=True)
    s = _setup(cfg, "/nonexistent")
    params0 = s.placement.init_params(0)
    rng = np.random.default_rng(0)
    problems = [Problem("chain_sum", {"question": "", "answer": ""},
                        tuple(rng.integers(10, VOCAB, 12).tolist()))
                for _ in range(cfg.rollout.prompts_per_step)]
    gen = rollout.Generator(s.mdef, max_new_tokens=cfg.rollout.max_new_tokens, stop_ids=(),
                            num_valid=VOCAB, truncation=RolloutSettings.from_config(cfg).truncation,
                            placement=s.placement)
    prompts = [p.prompt for p in problems for _ in range(G)]
    rollouts = [gen(params0, prompts, jax.random.key(100 + k),
                    temperature=cfg.rollout.temperature) for k in range(STEPS)]
    rewards = []
    for _ in range(STEPS):  # 0 / 1 in every group, shuffled
        r = np.stack([rng.permutation([0.0, 1.0] * (G // 2)) for _ in problems])
        rewards.append((r, np.zeros_like(r)))
    return params0, problems, rollouts, rewards


def train_steps(cfg, workdir, params0, problems, rollouts, rewards):
    """``(start, end)``: the parameters (float64 host arrays) before and after ``STEPS``
    GRPO steps from ``params0`` (in the config's parameter dtype) on the given rollouts and
    rewards."""
    s = _setup(cfg, workdir)
    dtypes = {k: a.dtype for k, a in s.mdef.abstract_params().items()}
    params0 = {k: v.astype(dtypes[k]) for k, v in params0.items()}
    start = {k: np.asarray(v, np.float64) for k, v in params0.items()}
    loop = Loop(cfg, s, grpo_stage.stage(cfg))
    drawn, scores = iter(rollouts), iter(rewards)
    it = grpo_stage.GRPOIteration(cfg, s, loop, lambda *args, **kwargs: next(drawn),
                                  params0 if cfg.loss.beta > 0 else None)
    params = jax.tree.map(jnp.copy, params0)
    opt_state = s.placement.init_opt(loop.tx, params)
    real_score, grpo_stage.score = grpo_stage.score, lambda *args: next(scores)
    try:
        for step in range(1, STEPS + 1):
            params, opt_state, _ = it(params, opt_state, problems, jax.random.key(step), step)
    finally:
        grpo_stage.score = real_score
    return start, {k: np.asarray(v, np.float64) for k, v in params.items()}


# slow: the float32 configs, and grpo_qwen3_0p6b, whose settings (dtypes, remat, optimizer,
# rate, schedule) grpo_qwen3_30b_a3b starts from and keeps: its case runs them by default
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in FLOAT32 or n == "grpo_qwen3_0p6b" else n
                                  for n in CONFIGS])
def test_a_shipped_config_learns_as_shipped(name, tmp_path):
    cfg, ref_cfg = shrunk(name), shrunk(name, float32=True)
    params0, problems, rollouts, rewards = _rollouts(name)
    start, want = train_steps(ref_cfg, tmp_path / "f32", params0, problems, rollouts, rewards)
    got_start, got = start, want
    if cfg.model.to_dict() != ref_cfg.model.to_dict():  # else: the same run
        got_start, got = train_steps(cfg, tmp_path / "cfg", params0, problems, rollouts,
                                     rewards)
    reached = moved = total = 0
    worst = (0.0, "")
    for k in start:
        d_want, d_got = want[k] - start[k], got[k] - got_start[k]
        total += d_want.size
        reached += np.count_nonzero(d_want)
        moved += np.count_nonzero(d_got[d_want != 0])
        if np.any(d_want):
            worst = max(worst, (np.linalg.norm(d_got - d_want) / np.linalg.norm(d_want), k))
    assert reached >= 0.5 * total, (name, reached, total)  # a test of something
    assert moved >= 0.98 * reached, f"{name}: {moved / reached:.2%} of the entries moved"
    assert worst[0] <= BOUND, f"{name}: relative update error {worst[0]:.3g} in {worst[1]}"
