"""Optimiser options: frozen parameters and per-prefix learning-rate multipliers."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from train.config import base_config
from train.optim import frozen_prefixes, lr_multipliers, make_optimizer


def test_frozen_and_lr_multipliers():
    c = base_config().train.optim
    c.warmup_steps, c.decay = 0, "constant"
    c.frozen, c.lr_multipliers = ("embed_tokens",), (("norm", 30),)
    tx, _ = make_optimizer(c, 10)
    params = {"embed_tokens.embedding": jnp.ones(4), "norm.scale": jnp.ones(4),
              "layers.0.norm.scale": jnp.ones(4), "normal.w": jnp.ones(4)}
    state = tx.init(params)
    updates, _ = tx.update({k: jnp.full(4, 0.01) for k in params}, state, params)
    step = {k: float(-v[0]) for k, v in updates.items()}
    assert step["embed_tokens.embedding"] == 0.0
    assert step["norm.scale"] == pytest.approx(30 * c.lr, rel=1e-3)
    # prefixes match whole dotted components only
    assert step["layers.0.norm.scale"] == pytest.approx(c.lr, rel=1e-3)
    assert step["normal.w"] == pytest.approx(c.lr, rel=1e-3)


def test_bad_lr_multipliers_raise():
    c = base_config().train.optim
    c.lr_multipliers = ("norm",)
    with pytest.raises(ValueError, match=r"optim.lr_multipliers = \('norm',\): must be a tuple of \(parameter-name prefix, multiplier > 0\) pairs"):
        lr_multipliers(c)
    c.lr_multipliers = (("norm", "x"),)
    with pytest.raises(ValueError, match="pairs"):
        lr_multipliers(c)
    assert lr_multipliers(base_config().train.optim) == ()


def test_bad_frozen_raises():
    c = base_config().train.optim
    c.frozen = ("",)
    with pytest.raises(ValueError, match=r"optim.frozen = \('',\): must be a tuple of names \(parameter-name prefixes\)"):
        frozen_prefixes(c)
    c.frozen = ("embed_tokens", "layers.0")
    assert frozen_prefixes(c) == ("embed_tokens", "layers.0")


def test_prefix_matching_no_parameter_raises():
    """e.g. a per-layer prefix on a scan_layers model, whose layers are 'layers.<name>'."""
    c = base_config().train.optim
    c.lr_multipliers = (("layers.0", 2.0),)
    tx, _ = make_optimizer(c, 10)
    with pytest.raises(ValueError, match=r"'layers.0' matches no parameter .* scan_layers"):
        tx.init({"layers.self_attn.q_proj": jnp.ones((3, 4)), "norm.scale": jnp.ones(4)})


def test_the_schedule_counts_grpo_steps_not_optimizer_updates(tmp_path):
    """The reported case (verl #399, SkyRL #872): mu = 2 epochs x M = 2 mini-batches, 40
    steps, the default warm-up of 10 steps and cosine decay. Every one of the 160 updates
    applies the documented rate of its step, the one the loop logs (before: warm-up ended
    after 2.5 steps and the floor was reached at step 11)."""
    import math
    import types

    import jax
    import numpy as np

    from train import grpo
    from train.loop import Loop

    cfg = base_config()
    cfg.train.steps, cfg.train.updates_per_batch, cfg.train.mini_batches = 40, 2, 2
    cfg.rollout.prompts_per_step = 4
    o = cfg.train.optim
    loop = Loop(cfg, types.SimpleNamespace(workdir=tmp_path), grpo.stage(cfg))

    def documented(step: int) -> float:  # linear warm-up from 0, then cosine to the floor
        k = step - 1
        if k < o.warmup_steps:
            return o.lr * k / o.warmup_steps
        t = (k - o.warmup_steps) / (cfg.train.steps - o.warmup_steps)
        return o.lr * (o.end_lr_ratio + (1 - o.end_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    # a constant gradient (clipped to norm 1, still constant): Adam's bias-corrected step is
    # then the rate times 1 / (1 + eps), so the parameter's change is the rate applied
    params = {"w": jnp.zeros(3)}
    state = loop.tx.init(params)
    update = jax.jit(loop.tx.update)
    applied, logged = [], []
    for step in range(1, cfg.train.steps + 1):
        logged.append(float(loop.schedule(step - 1)))
        for _ in range(4):
            u, state = update({"w": jnp.ones(3)}, state, params)
            applied.append((step, -float(u["w"][0])))
    want = np.array([documented(s) for s, _ in applied])
    np.testing.assert_allclose([a for _, a in applied], want, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(logged, [documented(s) for s in range(1, 41)], rtol=1e-6)
    assert documented(11) == pytest.approx(o.lr) and logged[10] == pytest.approx(o.lr)
