"""train.rl.rl_loss: advantages, KL estimators, aggregation and the clipped surrogate against
direct numpy formulas on random data."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.rl import rl_loss


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
    weighs ``min(pi / pi_sampler, cap)``; with a ratio band, tokens outside it are dropped
    (from the token-mean's count too); the gradient equals the hand-written weighted policy
    gradient."""
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
        kept = (m & ~masked).sum()
        want = -(weight * np.asarray(adv)).sum() / kept  # ratio 1: pg = -A w
        assert abs(float(value) - want) < 1e-5
        np.testing.assert_allclose(grad, -weight * np.asarray(adv) / kept, atol=1e-6)
        assert abs(float(metrics["ratio_masked_fraction"]) - masked.sum() / m.sum()) < 1e-6
        assert abs(float(metrics["is_ratio_mean"]) - is_ratio[m].mean()) < 1e-5
        if cfg.tis_cap:
            capped = (m & ~masked & (is_ratio > cfg.tis_cap)).sum() / m.sum()
            assert abs(float(metrics["tis_capped_fraction"]) - capped) < 1e-6
        assert 0 < masked.sum() < m.sum() or not cfg.mask_ratio_low  # the band does bite


def _packed_batch(seed, rows=6, row_len=24, seqs_per_row=3):
    """Random per-token inputs of a packed batch: several completions per row (lengths
    1..7, gaps of prompt / padding between them), ratios exp(N(0, 0.5)) around 1."""
    rng = np.random.default_rng(seed)
    seq = np.full((rows, row_len), -1)
    n = 0
    for r in range(rows):
        start = int(rng.integers(0, 3))
        for _ in range(seqs_per_row):
            length = int(rng.integers(1, 8))
            if start + length > row_len:
                break
            seq[r, start:start + length] = n
            n, start = n + 1, start + length + int(rng.integers(1, 4))
    mask = (seq >= 0).astype(np.float32)
    adv_seq = rng.normal(size=n)
    adv = np.where(seq >= 0, adv_seq[np.maximum(seq, 0)], 0.0)
    sampler = -rng.uniform(0.2, 4.0, seq.shape)
    logp = sampler + rng.normal(0.0, 0.5, seq.shape)
    trainer = sampler + rng.normal(0.0, 0.1, seq.shape)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in
           {"logp": logp, "sampler": sampler, "trainer": trainer, "adv": adv,
            "mask": mask}.items()}
    return f32, jnp.asarray(seq, jnp.int32), n


SPLIT_CONFIGS = [
    rl_loss.LossConfig(aggregation=mode, eps_high=0.28, beta=0.04, entropy_coef=0.01,
                       max_completion_len=7, **extra)
    for mode in rl_loss.AGGREGATIONS
    for extra in ({}, {"tis_cap": 1.5, "mask_ratio_high": 4.0, "clip_ratio_c": 3.0},
                  {"ratio_level": "sequence"}, {"mask_ratio_low": 0.92, "mask_ratio_high": 1.08})]


def _split_id(c):
    kind = "tis-dual" if c.tis_cap else "ratio-mask" if c.masks_ratios else c.ratio_level
    return f"{c.aggregation}-{kind}"


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=_split_id)
def test_split_batch_gives_the_whole_batch_loss_and_gradient(cfg):
    """A batch split by rows into 2 or 3 parts of unequal token counts, each normalised by
    the whole batch's counts (``LossNorm``): the parts' losses, gradients and mean metrics
    add up to the whole batch's (max metrics by maximum) to <= 1e-6 in float32, for every
    aggregation, with the mismatch correction, dual-clip and GSPO. The mean of per-part
    means (the fault this replaces) is off by far more."""
    x, seq, n = _packed_batch(11)
    ref, ent = x["sampler"] - 0.3, jnp.abs(x["logp"])

    def loss(lp, rows, norm):  # the part: the rows in ``rows`` (the others masked out)
        mask = x["mask"] * rows[:, None]
        return rl_loss.grpo_loss(cfg, lp, x["sampler"], x["adv"], mask, seq, n, ref_logp=ref,
                                 entropy=ent, trainer_logp=x["trainer"], norm=norm)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (whole, m_whole), g_whole = grad(x["logp"], jnp.ones(6), None)
    norm = rl_loss.LossNorm.of(np.asarray(x["mask"]), np.asarray(seq), n)
    if cfg.masks_ratios:  # the kept counts, from the trainer's log-probs
        norm = norm.with_kept(*rl_loss.kept_counts(cfg, x["logp"], x["sampler"], x["mask"],
                                                   seq, n, trainer_logp=x["trainer"]))
    for cuts in ((0, 2, 6), (0, 1, 3, 6)):
        rows = [jnp.asarray((np.arange(6) >= a) & (np.arange(6) < b), jnp.float32)
                for a, b in itertools.pairwise(cuts)]
        parts = [grad(x["logp"], r, norm) for r in rows]
        total = sum(float(v) for (v, _), _ in parts)
        assert abs(total - float(whole)) <= 1e-6 * abs(float(whole)), (cuts, total, whole)
        g = sum(np.asarray(gp, np.float64) for _, gp in parts)
        scale = np.abs(np.asarray(g_whole)).max()
        assert np.abs(g - np.asarray(g_whole)).max() <= 1e-6 * scale, cuts
        for k, v in m_whole.items():
            got = [float(m[k]) for (_, m), _ in parts]
            got = max(got) if k.endswith("_max") else sum(got)
            assert abs(got - float(v)) <= 1e-6 * max(abs(float(v)), 1e-3), (k, got, v)
        naive = np.mean([float(grad(x["logp"], r, None)[0][0]) for r in rows])
        assert abs(naive - float(whole)) > 1e-3 * abs(float(whole)), (cuts, naive)


def _reference64(x, seq, n, cfg):
    """float64 GRPO policy loss written per sequence from the sources' formulas (GSPO eqs.
    5-7 / 13, the dual-clip bound as verl applies it), differentiable in ``logp``."""

    def loss(lp):
        m, a = x["mask"], x["adv"]
        anchor = x["sampler"] if "trainer" not in x else x["trainer"]
        if cfg.ratio_level == "token":
            log_r = lp - anchor
        else:
            s = jnp.zeros_like(lp)
            for k in range(n):
                on = (seq == k) & (m > 0)
                mean = jnp.sum(jnp.where(on, lp - anchor, 0.0)) / jnp.sum(on)
                s = jnp.where(on, jax.lax.stop_gradient(mean), s)
            log_r = lp - jax.lax.stop_gradient(lp) + s
        r = jnp.exp(log_r)
        pg = -jnp.minimum(r * a, jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
        if cfg.clip_ratio_c:
            pg = jnp.where(a < 0, jnp.minimum(pg, -cfg.clip_ratio_c * a), pg)
        pg = jnp.where(m > 0, pg, 0.0)
        if cfg.aggregation == "token-mean":
            return pg.sum() / m.sum()
        per_seq = [pg[seq == k].sum() / m[seq == k].sum() for k in range(n)]
        return sum(per_seq) / n

    return loss


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("variant", ["dual-clip", "gspo", "gspo-dual-clip-trainer"])
def test_dual_clip_and_gspo_against_float64(aggregation, variant):
    """Loss and gradient of dual-clip and of GSPO's sequence ratio (with dual-clip and the
    trainer's log-probs as the old policy) against the float64 formulas: <= 1e-6; the
    metrics of the clipped regions against their definitions."""
    x, seq, n = _packed_batch(3)
    x = dict(x)
    # ratios spread widely, per token and per completion: some far above the dual-clip bound
    rng = np.random.default_rng(4)
    shift = rng.normal(0, 1.2, n + 1)[np.asarray(seq)] + rng.normal(0, 0.3, seq.shape)
    x["logp"] = x["sampler"] + jnp.asarray(shift, jnp.float32)
    cfg = rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, aggregation=aggregation,
                             clip_ratio_c=0.0 if variant == "gspo" else 3.0,
                             ratio_level="token" if variant == "dual-clip" else "sequence")
    trainer = x.pop("trainer")
    trainer = trainer if variant.endswith("trainer") else None
    (value, metrics), grad = jax.jit(jax.value_and_grad(
        lambda lp: rl_loss.grpo_loss(cfg, lp, x["sampler"], x["adv"], x["mask"], seq, n,
                                     trainer_logp=trainer), has_aux=True))(x["logp"])
    with jax.enable_x64(True):
        x64 = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in x.items()}
        if trainer is not None:
            x64["trainer"] = jnp.asarray(np.asarray(trainer, np.float64))
        want, want_grad = jax.jit(jax.value_and_grad(
            _reference64(x64, np.asarray(seq), n, cfg)))(x64["logp"])
        want, want_grad = float(want), np.asarray(want_grad)
    assert abs(float(value) - want) <= 1e-6 * abs(want), (float(value), want)
    assert np.abs(np.asarray(grad, np.float64) - want_grad).max() <= (
        1e-6 * np.abs(want_grad).max())
    # the clipped regions, from the float64 ratio
    anchor = np.asarray(x["sampler"] if trainer is None else trainer, np.float64)
    lr = np.asarray(x["logp"], np.float64) - anchor
    m, a, s = np.asarray(x["mask"]) > 0, np.asarray(x["adv"]), np.asarray(seq)
    if cfg.ratio_level == "sequence":
        means = {k: lr[s == k].mean() for k in range(n)}
        lr = np.where(m, np.vectorize(lambda k: means.get(k, 0.0))(s), 0.0)
    r = np.exp(lr)
    low, high = m & (a < 0) & (r < 0.8), m & (a > 0) & (r > 1.28)
    assert low.any() and high.any()
    np.testing.assert_allclose(float(metrics["clip_fraction_low"]), low.sum() / m.sum(),
                               rtol=1e-6)
    np.testing.assert_allclose(float(metrics["clip_fraction_high"]), high.sum() / m.sum(),
                               rtol=1e-6)
    np.testing.assert_allclose(float(metrics["ratio_max"]), r[m].max(), rtol=1e-5)
    if cfg.clip_ratio_c:
        dual = m & (a < 0) & (r > 3.0)
        assert dual.any()
        np.testing.assert_allclose(float(metrics["clip_fraction_dual"]),
                                   dual.sum() / m.sum(), rtol=1e-6)
        assert np.all(np.asarray(grad)[dual] == 0)  # bounded: no gradient


def test_dual_clip_bounds_one_far_off_policy_token():
    """verl PR #784's case: one token with ratio 30 and advantage -1 among 256 tokens of
    ratio ~1 and |A| = 1 carries ~10.5% of the gradient (token-mean); dual-clip with c = 3
    (verl's default) takes it to 0 and leaves the other tokens' gradients as they were."""
    rng = np.random.default_rng(0)
    sampler = jnp.asarray(-rng.uniform(1, 3, (1, 256)), jnp.float32)
    logp = sampler + jnp.asarray(rng.normal(0, 0.01, (1, 256)), jnp.float32)
    logp = logp.at[0, 7].set(sampler[0, 7] + np.log(30.0))
    adv = jnp.asarray(rng.choice([-1.0, 1.0], (1, 256)), jnp.float32).at[0, 7].set(-1.0)
    mask, seq = jnp.ones((1, 256)), jnp.zeros((1, 256), jnp.int32)
    shares = {}
    for c in (0.0, 3.0):
        cfg = rl_loss.LossConfig(clip_ratio_c=c)
        g = np.abs(np.asarray(jax.jit(jax.grad(lambda lp, cfg=cfg: rl_loss.grpo_loss(
            cfg, lp, sampler, adv, mask, seq, 1)[0]))(logp)))
        shares[c] = (g[0, 7] / g.sum(), np.delete(g, 7))
    assert 0.10 <= shares[0.0][0] <= 0.11, shares[0.0][0]
    assert shares[3.0][0] == 0 and np.array_equal(shares[3.0][1], shares[0.0][1])


def test_trainer_logprobs_anchor_the_ratio():
    """``trainer_logp``: the PPO ratio is taken against it (with and without a mismatch
    correction, whose weights then come from it); a NaN entry stands for the forward's own
    log-prob (ratio exactly 1 there)."""
    x, seq, n = _packed_batch(8)
    m = np.asarray(x["mask"]) > 0
    r = np.exp(np.asarray(x["logp"], np.float64) - np.asarray(x["trainer"], np.float64))
    for cfg in (rl_loss.LossConfig(), rl_loss.LossConfig(tis_cap=2.0)):
        _, metrics = rl_loss.grpo_loss(cfg, x["logp"], x["sampler"], x["adv"], x["mask"],
                                       seq, n, trainer_logp=x["trainer"])
        np.testing.assert_allclose(float(metrics["ratio_mean"]), r[m].mean(), rtol=1e-6)
    unknown = jnp.where(jnp.arange(24) < 12, jnp.nan, x["trainer"])
    cfg = rl_loss.LossConfig(tis_cap=2.0)
    _, metrics = rl_loss.grpo_loss(cfg, x["logp"], x["sampler"], x["adv"], x["mask"], seq, n,
                                   trainer_logp=unknown)
    want = np.where(np.arange(24) < 12, 1.0, r)[m].mean()
    np.testing.assert_allclose(float(metrics["ratio_mean"]), want, rtol=1e-6)
    is_ratio = np.exp(np.where(np.arange(24) < 12, np.asarray(x["logp"], np.float64),
                               np.asarray(x["trainer"], np.float64))
                      - np.asarray(x["sampler"], np.float64))
    np.testing.assert_allclose(float(metrics["is_ratio_mean"]), is_ratio[m].mean(), rtol=1e-5)


@pytest.mark.parametrize("field, value, message", [
    ("clip_ratio_c", 0.5, "loss.clip_ratio_c = 0.5: must be 0 \\(off\\) or a number > 1"),
    ("clip_ratio_c", 1.0, "loss.clip_ratio_c = 1.0: "),
    ("ratio_level", "seq", "loss.ratio_level = 'seq': must be one of 'token', 'sequence'"),
])
def test_bad_dual_clip_or_ratio_level_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        rl_loss.LossConfig(**{field: value}).check()


def test_k3_gradient_is_the_reverse_kl_gradient():
    """k3's value estimates KL(pi || ref), its expected gradient through log pi is that of
    KL(ref || pi) (DeepSeekMath's GRPO), and k2's is KL(pi || ref)'s: exact expectations
    over a 6-token categorical against float64 formulas."""
    rng = np.random.default_rng(0)
    theta, ref_logits = rng.standard_normal(6), rng.standard_normal(6)
    ref = np.exp(ref_logits - np.logaddexp.reduce(ref_logits))

    def logp(t):
        return t - jax.scipy.special.logsumexp(t)

    def expected_grad(kind):
        pi = np.exp(np.asarray(logp(jnp.asarray(theta, jnp.float32)), np.float64))

        def loss(t):  # E_pi[k], pi held fixed as the sampler's: gradient through log pi
            k = rl_loss.kl_estimate(logp(t), jnp.asarray(np.log(ref), jnp.float32), kind)
            return jnp.sum(jnp.asarray(pi, jnp.float32) * k)

        return np.asarray(jax.grad(loss)(jnp.asarray(theta, jnp.float32)), np.float64)

    pi = np.exp(theta - np.logaddexp.reduce(theta))
    forward = pi * (np.log(pi / ref) - np.sum(pi * np.log(pi / ref)))  # grad KL(pi||ref)
    reverse = pi - ref  # grad KL(ref||pi) w.r.t. the logits
    np.testing.assert_allclose(expected_grad("k3"), reverse, atol=1e-6)
    np.testing.assert_allclose(expected_grad("k2"), forward, atol=1e-6)
    assert np.linalg.norm(reverse - forward) > 0.05  # the two differ on this case


def _masked_reference64(x, seq, n, cfg, kept):
    """float64 loss with ratio masking written from its definition: every term (surrogate,
    KL, entropy bonus) and every count of the aggregation over the ``kept`` tokens only;
    differentiable in ``(logp, entropy)``."""

    def loss(lp, ent):
        a = x["adv"]
        log_r = lp - x["trainer"]
        if cfg.ratio_level == "sequence":  # GSPO-token over the kept tokens
            s = jnp.zeros_like(lp)
            for k in range(n):
                on = (seq == k) & kept
                if on.any():
                    mean = jnp.sum(jnp.where(on, log_r, 0.0)) / on.sum()
                    s = jnp.where(on, jax.lax.stop_gradient(mean), s)
            log_r = lp - jax.lax.stop_gradient(lp) + s
        r = jnp.exp(log_r)
        w = jnp.minimum(jnp.exp(x["trainer"] - x["sampler"]), cfg.tis_cap) if cfg.tis_cap else 1.0
        pg = -jnp.minimum(r * a, jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * a) * w
        d = x["ref"] - lp
        t = pg + cfg.beta * (jnp.exp(d) - d - 1) - cfg.entropy_coef * ent
        t = jnp.where(kept, t, 0.0)
        if cfg.aggregation == "token-mean":
            return t.sum() / kept.sum()
        if cfg.aggregation == "seq-mean-token-sum-norm":
            return t.sum() / (n * cfg.max_completion_len)
        present = [k for k in range(n) if kept[seq == k].any()]
        return sum(t[seq == k].sum() / kept[seq == k].sum() for k in present) / len(present)

    return loss


@pytest.mark.parametrize("aggregation", rl_loss.AGGREGATIONS)
@pytest.mark.parametrize("variant", ["token", "tis", "sequence"])
def test_ratio_masking_leaves_rejected_tokens_out_of_every_term(aggregation, variant):
    """Ratio masking (``loss.mask_ratio_low/high``) as ``LossConfig`` documents it: a
    rejected token is "left out of the loss", in every aggregation: no surrogate, no KL and
    no entropy-bonus gradient at it, and no denominator counts it (token-mean's token
    count, seq-mean's completions: one completion is rejected whole), with TIS, and with
    GSPO's sequence ratio (the geometric mean over the kept tokens). Loss and both
    gradients against the float64 definition (<= 1e-6). Issue 42 item 8, from
    slime PR #657, verl PR #3915 and TRL PR #3744 (on main the KL and entropy terms kept a
    gradient at rejected tokens and the counts included them)."""
    x, seq, n = _packed_batch(21)
    x = dict(x)
    rng = np.random.default_rng(22)
    shift = rng.normal(0.0, 0.25, seq.shape)
    shift[np.asarray(seq) == 0] = 1.0  # completion 0: every token above the band
    x["trainer"] = x["sampler"] + jnp.asarray(shift, jnp.float32)
    x["ref"] = x["sampler"] + jnp.asarray(rng.normal(0.0, 0.3, seq.shape), jnp.float32)
    ent = jnp.asarray(rng.uniform(0.5, 3.0, seq.shape), jnp.float32)
    cfg = rl_loss.LossConfig(eps_high=0.28, beta=0.04, entropy_coef=0.01,
                             aggregation=aggregation, max_completion_len=7,
                             tis_cap=1.5 if variant == "tis" else 0.0, mask_ratio_low=0.8,
                             mask_ratio_high=1.25,
                             ratio_level="sequence" if variant == "sequence" else "token")
    s, m = np.asarray(seq), np.asarray(x["mask"]) > 0
    is_ratio = np.exp(np.asarray(x["trainer"], np.float64) - np.asarray(x["sampler"]))
    kept = m & (is_ratio >= 0.8) & (is_ratio <= 1.25)
    assert 0 < kept.sum() < m.sum() and not kept[s == 0].any()

    def loss(lp, e):
        return rl_loss.grpo_loss(cfg, lp, x["sampler"], x["adv"], x["mask"], seq, n,
                                 ref_logp=x["ref"], entropy=e, trainer_logp=x["trainer"])

    (value, _), (g_lp, g_ent) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1),
                                                           has_aux=True))(x["logp"], ent)
    with jax.enable_x64(True):
        x64 = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in x.items()}
        want, (w_lp, w_ent) = jax.value_and_grad(
            _masked_reference64(x64, s, n, cfg, kept), argnums=(0, 1))(
                x64["logp"], jnp.asarray(np.asarray(ent, np.float64)))
        want, w_lp, w_ent = float(want), np.asarray(w_lp), np.asarray(w_ent)
    # absolute: terms of order 1 cancel to a loss of order 1e-2
    assert abs(float(value) - want) <= 1e-6, (float(value), want)
    for got, ref in ((g_lp, w_lp), (g_ent, w_ent)):
        assert np.abs(np.asarray(got, np.float64) - ref).max() <= 1e-6 * np.abs(ref).max()
        assert np.all(np.asarray(got)[~kept] == 0)  # not one term at a rejected token


def test_the_reported_ratio_mask_case():
    """The report's input (issue 42 item 8; slime PR #657, verl PR #3915, TRL PR #3744):
    9 completion tokens in two completions, 2 kept by the band [0.5, 2]; the first
    completion rejected whole. On main the KL term gave d loss / d logp up to 3e-3 at the
    rejected tokens and the entropy bonus -1e-3 (-0.01 / 9), token-mean divided by 9 and
    seq-mean by 2 completions. Now: no gradient at a rejected token, token-mean divides by
    2, seq-mean by 1 completion."""
    seq = jnp.asarray([[0, 0, 0, 0, 0, 1, 1, 1, 1]], jnp.int32)
    mask = jnp.ones((1, 9), jnp.float32)
    sampler = jnp.full((1, 9), -1.0, jnp.float32)
    gap = jnp.asarray([[3.0, 3.0, 3.0, -3.0, 3.0, 3.0, 0.1, -0.2, 3.0]], jnp.float32)
    trainer = sampler + gap  # is ratio e^gap: e^3 = 20 and e^-3 = 0.05 leave the band
    logp, ref = trainer, trainer - 0.1
    adv = jnp.asarray([[1.0] * 5 + [-0.5] * 4], jnp.float32)
    ent = jnp.full((1, 9), 2.0, jnp.float32)
    for aggregation, count in (("token-mean", 2.0), ("seq-mean-token-mean", 2.0)):
        cfg = rl_loss.LossConfig(beta=0.04, entropy_coef=0.01, aggregation=aggregation,
                                 mask_ratio_low=0.5, mask_ratio_high=2.0)
        (value, _), (g_lp, g_ent) = jax.value_and_grad(
            lambda lp, e, cfg=cfg: rl_loss.grpo_loss(cfg, lp, sampler, adv, mask, seq, 2,
                                                     ref_logp=ref, entropy=e,
                                                     trainer_logp=trainer),
            argnums=(0, 1), has_aux=True)(logp, ent)
        k3 = np.exp(-0.1) + 0.1 - 1  # every kept token: ratio 1, ref 0.1 below
        np.testing.assert_allclose(float(value), 0.5 + 0.04 * k3 - 0.01 * 2.0, rtol=1e-6)
        rejected = np.asarray(gap)[0] ** 2 > 1
        assert np.all(np.asarray(g_lp)[0, rejected] == 0)
        assert np.all(np.asarray(g_ent)[0, rejected] == 0)
        np.testing.assert_allclose(np.asarray(g_ent)[0, ~rejected], -0.01 / count, rtol=1e-6)
