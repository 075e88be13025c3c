"""``train.rl.rl_loss`` against Tunix's ``algo_core.grpo_loss_fn`` formulas: the clipped
surrogate, dual-clip (``epsilon_c``) and GSPO-token (``loss_algo="gspo-token"``), on the
same per-token log-probs (Tunix's model forward is replaced by the log-probs themselves,
so the two losses differ in their formulas only).

Runs only where Tunix is installed (``pip install -e '.[train,test,tunix]'``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tunix")

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import algo_core, common
from tunix.rl.grpo import grpo_learner

from train.rl import rl_loss

B, T = 6, 9
AGGREGATIONS = {"token-mean": "token-mean", "seq-mean-token-mean": "sequence-mean-token-mean"}


class _LogProbs(nnx.Module):
    """A "model" whose per-token log-probs are its parameter."""

    def __init__(self, logp):
        self.logp = nnx.Param(logp)


def _as_forward(graphdef, state, *args, **kwargs):
    """Stands in for ``common.compute_per_token_logps``: the module's log-probs, and
    constant logits (Tunix reports an entropy from them; nothing here depends on it)."""
    logp = nnx.merge(graphdef, state).logp[...]
    return logp, jnp.zeros(logp.shape + (2,), jnp.float32)


def _inputs(seed=0):
    """Completions one per row with ``1..T`` tokens, ratios spread per token and per
    completion, the first completion's beyond the dual-clip bound of 3 with ``A < 0``."""
    rng = np.random.default_rng(seed)
    mask = (np.arange(T)[None, :] < rng.integers(1, T + 1, (B, 1))).astype(np.float32)
    old = -rng.uniform(0.2, 4.0, (B, T))
    logp = old + rng.normal(0, 1.0, (B, 1)) + rng.normal(0, 0.4, (B, T))
    adv = rng.normal(size=B)
    adv[0], logp[0] = -1.0, logp[0] + 1.5  # moved towards a bad completion: ratio ~4.5
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in
           {"logp": logp, "old": old, "adv": adv, "mask": mask}.items()}
    return f32


def _tunix(x, algo: str, epsilon_c, agg: str, monkeypatch):
    monkeypatch.setattr(common, "compute_per_token_logps", _as_forward)
    config = grpo_learner.GRPOConfig(num_generations=2, beta=0.0, epsilon=0.2,
                                     loss_algo=algo, loss_agg_mode=AGGREGATIONS[agg])
    config.epsilon_high, config.temperature = 0.28, 1.0
    if epsilon_c is not None:
        config.epsilon_c = epsilon_c
    example = common.TrainExample(
        prompt_ids=jnp.zeros((B, 1), jnp.int32), prompt_mask=jnp.ones((B, 1), jnp.int32),
        completion_ids=jnp.ones((B, T), jnp.int32), completion_mask=x["mask"],
        advantages=x["adv"], ref_per_token_logps=None, old_per_token_logps=x["old"])
    graphdef, state = nnx.split(_LogProbs(x["logp"]))

    def loss(state):
        return algo_core.grpo_loss_fn(nnx.merge(graphdef, state), example, config, 0, 1)

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return value, aux, grads["logp"][...]


def _ours(x, ratio_level, clip_ratio_c, agg):
    cfg = rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, aggregation=agg,
                             clip_ratio_c=clip_ratio_c, ratio_level=ratio_level)
    seq = jnp.where(x["mask"] > 0, jnp.arange(B)[:, None], -1)
    adv = jnp.broadcast_to(x["adv"][:, None], (B, T))

    def loss(lp):
        return rl_loss.grpo_loss(cfg, lp, x["old"], adv, x["mask"], seq, B)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(x["logp"])


@pytest.mark.parametrize("agg", list(AGGREGATIONS))
@pytest.mark.parametrize("algo, epsilon_c", [("grpo", None), ("grpo", 3.0),
                                             ("gspo-token", None), ("gspo-token", 3.0)])
def test_clipped_surrogate_dual_clip_and_gspo_token_equal_tunix(algo, epsilon_c, agg,
                                                               monkeypatch):
    x = _inputs()
    value, aux, grad = _tunix(x, algo, epsilon_c, agg, monkeypatch)
    (ours, metrics), our_grad = _ours(x, "sequence" if algo == "gspo-token" else "token",
                                      epsilon_c or 0.0, agg)
    assert abs(float(ours) - float(value)) <= 1e-6 * abs(float(value)), (ours, value)
    scale = float(jnp.abs(grad).max())
    assert scale > 0 and float(jnp.abs(our_grad - grad).max()) <= 1e-6 * scale
    np.testing.assert_allclose(float(metrics["clip_fraction"]), float(aux["pg_clipfrac"]),
                               rtol=1e-6)
    assert 0 < float(aux["pg_clipfrac"]) < 1
    np.testing.assert_allclose(float(metrics["ratio_mean"]), float(aux["is_ratio/mean"]),
                               rtol=1e-5)
    np.testing.assert_allclose(float(metrics["ratio_max"]), float(aux["is_ratio/max"]),
                               rtol=1e-5)
    if epsilon_c is not None and agg == "token-mean":  # Tunix aggregates it like the loss
        assert float(aux["pg_clipfrac_lower"]) > 0
        np.testing.assert_allclose(float(metrics["clip_fraction_dual"]),
                                   float(aux["pg_clipfrac_lower"]), rtol=1e-6)
