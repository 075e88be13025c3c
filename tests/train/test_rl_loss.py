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
    # negative_weight scales only the below-mean completions' advantages
    w = rl_loss.group_advantages(r, "grpo", negative_weight=0.25)
    np.testing.assert_allclose(w, np.where(a < 0, 0.25 * a, a), rtol=1e-6)
    assert np.array_equal(rl_loss.group_advantages(r, "grpo", negative_weight=0.0),
                          np.maximum(a, 0))
    with pytest.raises(ValueError, match="negative_weight.*1.5"):
        rl_loss.group_advantages(r, "grpo", negative_weight=1.5)


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
    _, mask, seq_j, _seq = _random_batch(3)
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




def test_nan_off_the_mask_never_reaches_the_loss_its_gradient_or_a_metric():
    """The reported case: an advantage of NaN at a position whose mask is 0 made the
    token-mean loss NaN; the right loss is -0.5. Every input, every aggregation, every
    metric, and the gradient."""
    nan, inf = jnp.nan, jnp.inf
    logp = jnp.asarray([[-1.0, 0.0]])
    mask = jnp.asarray([[1.0, 0.0]])
    seq = jnp.asarray([[0, -1]])
    for mode in rl_loss.AGGREGATIONS:
        cfg = rl_loss.LossConfig(beta=0.1, entropy_coef=0.01, aggregation=mode,
                                 max_completion_len=1, tis_cap=2.0, mask_ratio_high=5.0)

        def loss(lp, cfg=cfg):
            return rl_loss.grpo_loss(
                cfg, lp, jnp.asarray([[-1.0, nan]]), jnp.asarray([[0.5, nan]]), mask, seq, 1,
                ref_logp=jnp.asarray([[-1.0, inf]]), entropy=jnp.asarray([[0.3, -inf]]))

        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
        assert abs(float(value) - (-0.5 - 0.01 * 0.3)) < 1e-6, (mode, float(value))
        assert all(np.isfinite(float(v)) for v in metrics.values()), (mode, metrics)
        assert np.all(np.isfinite(np.asarray(grad))) and float(grad[0, 1]) == 0.0


@pytest.mark.parametrize("gap", [1e-9, 1e-7, 1e-5, 1e-3, 0.01, 0.3, 3.0, 30.0])
def test_kl_estimators_as_accurate_as_float32_allows(gap):
    """Against float64 on the same float32 inputs, for tiny and large log-prob gaps of both
    signs: relative error <= 1e-6 (k3 <= 2e-6), and k3 never negative."""
    rng = np.random.default_rng(3)
    scale = min(5.0, gap * 1e5)  # small log-probs keep a 1e-9 gap representable in float32
    logp = (-rng.uniform(0.5, 1.0, 64) * scale).astype(np.float32)
    ref = (logp + gap * rng.choice([-1.0, 1.0], 64) * rng.uniform(0.5, 1.0, 64)).astype(
        np.float32)
    d = ref.astype(np.float64) - logp.astype(np.float64)
    assert np.all(d != 0)
    want = {"k1": -d, "k2": d * d / 2, "k3": np.expm1(d) - d}
    for kind, w in want.items():
        got = np.asarray(rl_loss.kl_estimate(jnp.asarray(logp), jnp.asarray(ref), kind),
                         np.float64)
        tol = 2e-6 if kind == "k3" else 1e-6
        assert np.max(np.abs(got - w) / np.abs(w)) <= tol, (kind, gap)
    assert float(rl_loss.kl_estimate(jnp.asarray(logp), jnp.asarray(ref), "k3").min()) >= 0


def test_truncated_importance_sampling_and_ratio_masking():
    """With ``tis_cap`` the PPO ratio is 1 at the trainer's own log-probs and each token
    weighs ``min(pi / pi_sampler, cap)``; with a ratio band, tokens outside it are dropped;
    the gradient equals the hand-written weighted policy gradient."""
    rng = np.random.default_rng(5)
    logp = jnp.asarray(-rng.random((2, 6)) * 3, jnp.float32)
    sampler = logp + jnp.asarray(rng.normal(0, 0.8, (2, 6)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=(2, 6)), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], jnp.float32)
    seq = jnp.where(mask > 0, jnp.asarray([[0] * 6, [1] * 6]), -1)
    is_ratio = np.exp(np.asarray(logp - sampler, np.float64))
    m = np.asarray(mask) > 0
    for cfg in (rl_loss.LossConfig(tis_cap=2.0),
                rl_loss.LossConfig(mask_ratio_low=0.5, mask_ratio_high=1.5),
                rl_loss.LossConfig(tis_cap=1.2, mask_ratio_low=0.5, mask_ratio_high=1.5)):
        weight = np.where(m, 1.0, 0.0)
        if cfg.mask_ratio_low:
            weight *= (is_ratio >= cfg.mask_ratio_low) & (is_ratio <= cfg.mask_ratio_high)
        masked = m & (weight == 0)
        if cfg.tis_cap:
            weight *= np.minimum(is_ratio, cfg.tis_cap)

        def loss(lp, cfg=cfg):
            return rl_loss.grpo_loss(cfg, lp, sampler, adv, mask, seq, 2)

        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
        want = -(weight * np.asarray(adv)).sum() / m.sum()  # ratio 1: pg = -A w
        assert abs(float(value) - want) < 1e-5
        np.testing.assert_allclose(grad, -weight * np.asarray(adv) / m.sum(), atol=1e-6)
        assert abs(float(metrics["ratio_masked_fraction"]) - masked.sum() / m.sum()) < 1e-6
        assert abs(float(metrics["is_ratio_mean"]) - is_ratio[m].mean()) < 1e-5
        if cfg.tis_cap:
            capped = (m & ~masked & (is_ratio > cfg.tis_cap)).sum() / m.sum()
            assert abs(float(metrics["tis_capped_fraction"]) - capped) < 1e-6
        assert 0 < masked.sum() < m.sum() or not cfg.mask_ratio_low  # the band does bite
