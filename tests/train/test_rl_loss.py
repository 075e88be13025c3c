"""train.rl_loss: advantages, KL estimators, aggregation and the clipped surrogate against
direct numpy formulas on random data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import rl_loss


def test_group_advantages():
    rng = np.random.default_rng(0)
    r = rng.random((5, 4))
    r[2] = 0.5  # a group with zero std
    a = rl_loss.group_advantages(r, "grpo")
    mean, std = r.mean(1, keepdims=True), r.std(1, keepdims=True)
    np.testing.assert_allclose(a, (r - mean) / (std + 1e-6), rtol=1e-5)
    assert np.all(a[2] == 0)
    np.testing.assert_allclose(rl_loss.group_advantages(r, "dr_grpo"), r - mean, atol=1e-7)
    with pytest.raises(ValueError, match="grpo"):
        rl_loss.group_advantages(r, "ppo")


def test_kl_estimators():
    rng = np.random.default_rng(1)
    logp, ref = jnp.asarray(-rng.random(20) * 3), jnp.asarray(-rng.random(20) * 3)
    d = np.asarray(ref - logp, np.float64)
    np.testing.assert_allclose(rl_loss.kl_estimate(logp, ref, "k1"), -d, rtol=1e-6)
    np.testing.assert_allclose(rl_loss.kl_estimate(logp, ref, "k2"), d * d / 2, rtol=1e-5)
    np.testing.assert_allclose(rl_loss.kl_estimate(logp, ref, "k3"), np.exp(d) - d - 1,
                               rtol=1e-5, atol=1e-7)
    assert float(rl_loss.kl_estimate(logp, ref, "k3").min()) >= 0


def _random_batch(seed):
    rng = np.random.default_rng(seed)
    seq = np.full((3, 10), -1)
    seq[0, 2:6], seq[0, 7:9], seq[1, 1:9], seq[2, 4:5] = 0, 1, 2, 3
    mask = (seq >= 0).astype(np.float32)
    x = rng.normal(size=(3, 10)).astype(np.float32) * mask + 7.0 * (1 - mask)  # junk off-mask
    return jnp.asarray(x), jnp.asarray(mask), jnp.asarray(seq), seq


@pytest.mark.parametrize("mode", rl_loss.AGGREGATIONS)
def test_aggregation(mode):
    x, mask, seq_j, seq = _random_batch(2)
    xn, m = np.asarray(x, np.float64), np.asarray(mask)
    if mode == "token-mean":
        want = (xn * m).sum() / m.sum()
    elif mode == "seq-mean-token-sum-norm":
        want = (xn * m).sum() / (4 * 12)
    else:
        want = np.mean([xn[seq == k].mean() for k in range(4)])
    got = rl_loss.aggregate(x, mask, seq_j, 4, mode, max_completion_len=12)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_clipped_surrogate_values_and_gradient():
    _, mask, seq_j, seq = _random_batch(3)
    rng = np.random.default_rng(3)
    old = jnp.asarray(-rng.random((3, 10)).astype(np.float32))
    logp = old + jnp.asarray(rng.normal(size=(3, 10)).astype(np.float32) * 0.4)
    adv = jnp.asarray(rng.normal(size=(3, 10)).astype(np.float32))
    ref = old - 0.1
    cfg = rl_loss.LossConfig(eps_low=0.2, eps_high=0.3, beta=0.05, kl_estimator="k3",
                             aggregation="token-mean", max_completion_len=10)
    loss, metrics = rl_loss.grpo_loss(cfg, logp, old, adv, mask, seq_j, 4, ref_logp=ref)
    r = np.exp(np.asarray(logp - old, np.float64))
    a, m = np.asarray(adv, np.float64), np.asarray(mask)
    pg = -np.minimum(r * a, np.clip(r, 0.8, 1.3) * a)
    d = np.asarray(ref - logp, np.float64)
    kl = np.exp(d) - d - 1
    want = ((pg + 0.05 * kl) * m).sum() / m.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    clipped = (np.clip(r, 0.8, 1.3) * a < r * a) & (m > 0)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), clipped.sum() / m.sum(),
                               rtol=1e-6)
    # the gradient of a clipped token's surrogate is zero (only the KL term remains)
    grad = jax.grad(lambda lp: rl_loss.grpo_loss(cfg, lp, old, adv, mask, seq_j, 4,
                                                 ref_logp=ref)[0])(logp)
    g_kl = 0.05 * (1 - np.exp(d)) / m.sum()
    np.testing.assert_allclose(np.asarray(grad)[clipped], g_kl[clipped], rtol=1e-4, atol=1e-7)
    unclipped = ~clipped & (m > 0)
    g_pg = -r * a / m.sum()
    np.testing.assert_allclose(np.asarray(grad)[unclipped], (g_pg + g_kl)[unclipped],
                               rtol=1e-4, atol=1e-7)
    assert np.all(np.asarray(grad)[m == 0] == 0)


def test_missing_inputs_raise():
    _, mask, seq_j, _ = _random_batch(4)
    z = jnp.zeros_like(mask)
    with pytest.raises(ValueError, match="ref_logp"):
        rl_loss.grpo_loss(rl_loss.LossConfig(beta=0.1), z, z, z, mask, seq_j, 4)
    with pytest.raises(ValueError, match="entropy"):
        rl_loss.grpo_loss(rl_loss.LossConfig(entropy_coef=0.1), z, z, z, mask, seq_j, 4)
    with pytest.raises(ValueError, match="aggregation"):
        rl_loss.aggregate(z, mask, seq_j, 4, "sum", 1)
