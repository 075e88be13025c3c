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
    with pytest.raises(ValueError, match=r"\(prefix, multiplier\) pairs, .* got 'norm'"):
        lr_multipliers(c)
    c.lr_multipliers = (("norm", "x"),)
    with pytest.raises(ValueError, match="pairs"):
        lr_multipliers(c)
    assert lr_multipliers(base_config().train.optim) == ()


def test_bad_frozen_raises():
    c = base_config().train.optim
    c.frozen = ("",)
    with pytest.raises(ValueError, match="tuple of parameter-name prefixes"):
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
