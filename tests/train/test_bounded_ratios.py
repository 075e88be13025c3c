"""Ratios never overflow: at log-ratios of +-100 and +-1e4 every loss variant (token,
GSPO's sequence ratio, dual-clip, TIS, IcePop's ratio mask) has a finite loss and a finite
gradient equal to the float64 limit (``rl_loss.bounded_exp``). Before the bound, ``exp``
overflowed at a log-ratio of 88.7 and the clipped branch's backward gave ``0 * inf = NaN``
with a finite loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.rl import rl_loss

VARIANTS = {
    "token": rl_loss.LossConfig(eps_low=0.2, eps_high=0.28),
    "gspo": rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, ratio_level="sequence"),
    "dual-clip": rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0),
    "tis": rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, tis_cap=2.0),
    "icepop": rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, mask_ratio_low=0.5,
                                 mask_ratio_high=5.0),
}
N, SEQS, K = 64, 4, 5  # tokens, completions of 16 tokens, the far-off-policy token


def _batch(gap: float, sign: float, dtype):
    rng = np.random.default_rng(0)
    sampler = -rng.uniform(0.5, 4.0, (1, N))
    logp = sampler + rng.normal(0, 0.1, (1, N))
    logp[0, K] = sampler[0, K] + gap
    adv = np.repeat(rng.choice([-1.0, 1.0], SEQS), N // SEQS)[None]
    adv[0, : N // SEQS] = sign  # the far-off token's completion
    seq = np.repeat(np.arange(SEQS), N // SEQS)[None].astype(np.int32)
    return [jnp.asarray(x, dtype) for x in (logp, sampler, adv)] + [
        jnp.ones((1, N), dtype), jnp.asarray(seq)]


def _value_and_grad(cfg, gap, sign, dtype):
    logp, sampler, adv, mask, seq = _batch(gap, sign, dtype)
    return jax.value_and_grad(lambda lp: rl_loss.grpo_loss(cfg, lp, sampler, adv, mask, seq,
                                                           SEQS)[0])(logp)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["A>0", "A<0"])
@pytest.mark.parametrize("gap", [100.0, -100.0, 1e4, -1e4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_far_off_policy_tokens_give_the_float64_limit(variant, gap, sign, monkeypatch):
    cfg = VARIANTS[variant]
    loss, grad = jax.jit(_value_and_grad, static_argnums=(0, 1, 2, 3))(cfg, gap, sign,
                                                                    jnp.float32)
    grad = np.asarray(grad, np.float64)
    assert np.isfinite(float(loss)) and np.isfinite(grad).all()
    # float64 with the plain exp at a log-ratio of +-100 (GSPO: a completion's mean of
    # +-100): at +-1e4 float64 overflows too, and its limit is reached there already (the
    # clipped branches' gradients are exactly 0)
    monkeypatch.setattr(rl_loss, "bounded_exp", jnp.exp)
    bound = 100.0 * (N // SEQS if cfg.ratio_level == "sequence" else 1)
    with jax.enable_x64(True):
        want_loss, want = _value_and_grad(cfg, float(np.clip(gap, -bound, bound)), sign,
                                          jnp.float64)
        want_loss, want = float(want_loss), np.asarray(want)
    # where the float64 gradient itself is beyond float32 (A < 0, the ratio above the
    # clip range, no dual-clip: -rho A grows without bound) the bounded one keeps its sign
    huge = np.abs(want) > 1e30
    assert np.array_equal(np.sign(grad[huge]), np.sign(want[huge]))
    assert not huge.any() or (sign < 0 < gap and variant in ("token", "gspo"))
    scale = np.abs(want[~huge]).max()
    np.testing.assert_allclose(grad[~huge], want[~huge], rtol=1e-5, atol=1e-7 * scale)
    if not huge.any():
        assert abs(float(loss) - want_loss) <= 1e-5 * max(abs(want_loss), 1.0)


def test_bounded_exp_holds_the_log_ratio_at_20_and_keeps_nan():
    x = jnp.array([-1e4, -100.0, -20.0, 0.5, 20.0, 100.0, 1e4, jnp.nan, jnp.inf])
    y, dy = jax.jvp(rl_loss.bounded_exp, (x,), (jnp.ones_like(x),))
    want = np.exp(np.clip(np.asarray(x), -20, 20))
    np.testing.assert_allclose(np.asarray(y)[:7], want[:7], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dy)[:7], want[:7], rtol=1e-6)
    assert np.isnan(y[7]) and float(y[8]) == pytest.approx(np.exp(20.0), rel=1e-6)
