"""The GRPO step on a random tiny decoder: skipping unkept tokens changes cost, never
results; sampler and trainer log-probs agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import get_config
from tests.support.models import random_model
from train.rl import packing, rl_loss, rollout, steps
from train.rl.placement import place_batch
from train.rl.state import ModelDef, params_of

STOP = 7


@pytest.fixture(scope="module")
def policy():
    cfg = get_config("tiny", dtype="float32")
    mdef = ModelDef.of(cfg)
    return mdef, params_of(random_model(cfg, seed=4))


@pytest.fixture(scope="module")
def rollout_batch(policy):
    mdef, params = policy
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, rng.integers(3, 12)).tolist() for _ in range(8)]
    generate = rollout.Generator(mdef, max_new_tokens=10, stop_ids=(STOP,), num_valid=500)
    ro = generate(params, prompts, jax.random.key(3), temperature=1.0)
    comps = [ro.completion(i) for i in range(8)]
    adv = rng.normal(size=8).astype(np.float32)
    packed = packing.pack(
        prompts, comps, 32, row_multiple=2,
        values={"old_logp": [ro.logprobs[i, :len(c)] for i, c in enumerate(comps)],
                "advantages": [np.full(len(c), adv[i]) for i, c in enumerate(comps)]})
    return ro, packed


def test_sampler_and_trainer_logprobs_agree(policy, rollout_batch):
    mdef, params = policy
    ro, packed = rollout_batch
    assert int(ro.tokens.max()) < 500 and ro.lengths.min() >= 1
    b = place_batch(packed.arrays("old_logp", "advantages"))
    loss_fn = steps.grpo_loss_fn(mdef, rl_loss.LossConfig(), 1.0, skip=True)
    _, (_, logp) = loss_fn(params, b, None, packed.num_seqs, packed.bucket())
    mask = packed.loss_mask > 0
    gap = np.abs(np.asarray(logp) - packed.values["old_logp"])[mask]
    assert gap.max() <= 1e-4, gap.max()
    assert np.all(np.asarray(logp)[~mask] == 0)


def test_skipping_changes_nothing_but_cost(policy, rollout_batch):
    mdef, params = policy
    _, packed = rollout_batch
    b = place_batch(packed.arrays("old_logp", "advantages"))
    rng = np.random.default_rng(1)
    # a ratio away from 1 so that clipping is active on some tokens
    b["old_logp"] = b["old_logp"] + jnp.asarray(rng.normal(size=b["old_logp"].shape) * 0.3,
                                                jnp.float32)
    ref = b["old_logp"] - 0.2
    cfg = rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3",
                             entropy_coef=0.01, aggregation="seq-mean-token-mean",
                             max_completion_len=10)
    out = {}
    for skip in (True, False):
        fn = steps.grpo_loss_fn(mdef, cfg, 1.0, skip)
        grad_fn = jax.jit(jax.value_and_grad(fn, has_aux=True), static_argnums=(3, 4))
        (loss, (metrics, _)), grads = grad_fn(params, b, ref, packed.num_seqs,
                                              packed.bucket())
        out[skip] = (float(loss), grads, metrics)
    (l_on, g_on, m_on), (l_off, g_off, _) = out[True], out[False]
    assert float(m_on["clip_fraction"]) > 0
    assert abs(l_on - l_off) <= 1e-5 * abs(l_off), (l_on, l_off)
    for name in g_off:
        a, b_ = np.asarray(g_on[name]), np.asarray(g_off[name])
        scale = np.abs(b_).max()
        assert scale > 0, name
        assert np.abs(a - b_).max() <= 1e-5 * scale, (name, np.abs(a - b_).max() / scale)


def test_frozen_parameters_stay_fixed(policy, rollout_batch):
    from ml_collections import ConfigDict

    from train.rl.optim import frozen_prefixes, make_optimizer
    from train.run.schema import base_config

    mdef, params = policy
    _, packed = rollout_batch
    ocfg = ConfigDict(base_config().train.optim.to_dict())
    ocfg.frozen = ("embed_tokens",)
    ocfg.warmup_steps = 0
    tx, _ = make_optimizer(ocfg, 10)
    frozen = frozen_prefixes(ocfg)
    assert frozen == ("embed_tokens",)
    step = steps.grpo_step(mdef, tx, rl_loss.LossConfig(), temperature=1.0, skip=True,
                           frozen=frozen)
    start = jax.tree.map(jnp.copy, params)
    new, _, m = step(jax.tree.map(jnp.copy, params), tx.init(params),
                     (place_batch(packed.arrays("old_logp", "advantages")),), None,
                     packed.num_seqs, packed.bucket())
    assert float(m["grad_norm"]) > 0
    for name in params:
        same = bool(jnp.all(new[name] == start[name]))
        assert same == name.startswith("embed_tokens."), name


TRUNCATION_GRID = [(t, rollout.Truncation(k, p, m)) for t in (1.0, 0.6) for p in (1.0, 0.9, 0.8)
                   for k in (0, 50) for m in (0.0, 0.05)]


def _scored(mdef, params, ro, prompts, temperature, *, values, min_logit: bool):
    """``(trainer logp [R, L], metrics, packed)`` of the rollout on fixed shapes (8 rows of
    32, bucket 64: one compile per temperature), with ``ratio_mean`` etc. of an unchanged
    policy."""
    comps = [ro.completion(i) for i in range(len(prompts))]
    per_token = {k: [v[i, : len(c)] for i, c in enumerate(comps)] for k, v in values.items()}
    per_token["advantages"] = [np.ones(len(c), np.float32) for c in comps]
    packed = packing.pack(prompts, comps, 32, num_rows=8, values=per_token)
    names = ("old_logp", "advantages") + (("min_logit",) if min_logit else ())
    b = place_batch(packed.arrays(*names))
    loss_fn = _loss_fns.setdefault((mdef, temperature, min_logit), jax.jit(
        steps.grpo_loss_fn(mdef, rl_loss.LossConfig(), temperature, skip=True),
        static_argnums=(3, 4)))
    _, (metrics, logp) = loss_fn(params, b, None, len(prompts), 64)
    return np.asarray(logp), metrics, packed


_loss_fns: dict = {}


def test_truncated_rollouts_are_scored_on_the_support_they_were_drawn_from(policy):
    """Issue 11's acceptance grid: for T in {1, 0.6}, top_p in {1, 0.9, 0.8}, top_k in
    {0, 50}, min_p in {0, 0.05} (float32), the sampler's recorded log-probs and the
    trainer's on the sampler's support agree to 1e-4 and the PPO ratio of the unchanged
    policy is 1 +- 1e-4; every sampled token lies in its support; the truncated mass is
    reported. ``"full"`` support: the trainer's full-softmax log-probs equal the sampler's
    ``logprobs + logmass``."""
    mdef, params = policy
    rng = np.random.default_rng(7)
    prompts = [rng.integers(10, 500, rng.integers(3, 12)).tolist() for _ in range(8)]
    generate = rollout.Generator(mdef, max_new_tokens=8, stop_ids=(STOP,), num_valid=500)
    truncated_seen = 0
    for i, (t, trunc) in enumerate(TRUNCATION_GRID):
        ro = generate(params, prompts, jax.random.key(100 + i), temperature=t,
                      truncation=trunc)
        assert ro.path == (rollout.PATH_TRUNCATED if trunc.active else rollout.PATH_GUMBEL)
        live = np.arange(8)[None, :] < ro.lengths[:, None]
        assert np.all(ro.logmass[live] <= 0) and np.all(ro.logprobs[live] <= 0)
        if not trunc.active:
            assert np.all(ro.min_logit == -np.inf) and np.all(ro.logmass == 0)
        else:
            truncated_seen += int(np.any(ro.logmass[live] < -1e-3))
        logp, metrics, packed = _scored(
            mdef, params, ro, prompts, t, min_logit=trunc.active,
            values={"old_logp": ro.logprobs, "min_logit": ro.min_logit})
        mask = packed.loss_mask > 0
        gap = np.abs(logp - packed.values["old_logp"])[mask]
        assert gap.max() <= 1e-4, (t, trunc, gap.max())
        assert abs(float(metrics["ratio_mean"]) - 1.0) <= 1e-4, (t, trunc, metrics)
        if trunc.active and t == 1.0 and trunc.top_p == 0.8:
            logp_full, m_full, full = _scored(mdef, params, ro, prompts, t, min_logit=False,
                                              values={"old_logp": ro.logprobs + ro.logmass})
            gap_full = np.abs(logp_full - full.values["old_logp"])[mask]
            assert gap_full.max() <= 1e-4 and abs(float(m_full["ratio_mean"]) - 1) <= 1e-4
            # the bias the sampler's support removes: full-softmax vs nucleus log-probs
            assert np.abs(logp_full - logp)[mask].max() > 1e-2
    assert truncated_seen >= 10  # the grid really truncated
