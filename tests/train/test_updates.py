"""Several updates per rollout batch (``train.updates_per_batch``, ``train.mini_batches``,
``train.micro_batches``, ``loss.old_logprobs``) on the micro config's model: one update is
the plain GRPO step, written out here from its parts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxhead
from configs import grpo_micro
from train import grpo, packing, rl_loss, setup
from train.loop import Loop
from train.placement import place_batch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = grpo_micro.get_config()
    cfg.workdir = str(tmp_path_factory.mktemp("updates"))
    cfg.metrics.tensorboard = False
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 4, 4
    cfg.loss.beta, cfg.loss.entropy_coef = 0.04, 0.01
    cfg.train.optim.warmup_steps = 0
    s = setup.build(cfg)
    params = s.placement.init_params(0)
    stream = s.tasks.train_stream(1, s.exclude)
    problems = [next(stream)[1] for _ in range(cfg.rollout.prompts_per_step)]
    return cfg, s, params, problems


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _plain_grpo_step(cfg, s, tx, params, opt_state, problems, key):
    """The GRPO step with one clipped-surrogate update, from its parts: rollout, rewards,
    advantages, one packed batch, the reference's log-probs, one gradient, one Adam step."""
    mdef, t = s.mdef, cfg.rollout.temperature
    gen = grpo.generator(cfg, s, grpo.truncation(cfg))
    g = cfg.rollout.group_size
    ro = gen(params, [p.prompt for p in problems for _ in range(g)], key, temperature=t)
    rewards, _ = grpo.score(cfg, s, problems, ro)
    adv = rl_loss.group_advantages(rewards, cfg.loss.advantage,
                                   negative_weight=cfg.loss.negative_weight).reshape(-1)
    comps = [ro.completion(i) for i in range(len(adv))]
    packed = packing.pack(
        [problems[i // g].prompt for i in range(len(adv))], comps, cfg.train.row_len,
        row_multiple=cfg.train.row_multiple,
        values={"old_logp": [ro.logprobs[i, :len(c)] for i, c in enumerate(comps)],
                "advantages": [np.full(len(c), adv[i], np.float32)
                               for i, c in enumerate(comps)]})
    b = place_batch(packed.arrays("old_logp", "advantages"))
    bucket = packed.bucket(cfg.train.bucket_multiple)
    keep = jaxhead.keep_mask(loss_mask=b["loss_mask"], segment_ids=b["segment_ids"],
                             aligned_to="predictions")
    lcfg = grpo.loss_config(cfg)

    def head(p):
        return mdef.merge(p).token_logprobs(
            b["tokens"], b["positions"], b["segment_ids"], labels=b["labels"], keep=keep,
            bucket=bucket, temperature=t, with_entropy=True)

    ref = jax.jit(lambda p: head(p)[0].logprobs * b["loss_mask"])(params)

    def loss(p):
        out, _ = head(p)
        value, _ = rl_loss.grpo_loss(lcfg, out.logprobs, b["old_logp"], b["advantages"],
                                     b["loss_mask"], b["seq_index"], packed.num_seqs,
                                     ref_logp=ref, entropy=out.entropy)
        return value

    @jax.jit
    def step(p, o):
        grads = jax.grad(loss)(p)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o

    return step(params, opt_state)


def test_one_update_per_batch_is_the_plain_grpo_step(run):
    """``updates_per_batch=1``, one mini-batch (the defaults): the trainer's step gives the
    parameters of the plain step bit for bit (<= 1e-7 where XLA fuses differently)."""
    cfg, s, params, problems = run
    loop = Loop(cfg, s, grpo.stage(cfg))
    key = jax.random.key(5)
    want, want_opt = _plain_grpo_step(cfg, s, loop.tx, _copy(params),
                                      loop.tx.init(params), problems, key)
    it = grpo.GRPOIteration(cfg, s, loop, grpo.generator(cfg, s, grpo.truncation(cfg)),
                            ref_params=params)
    got, got_opt, metrics = it(_copy(params), loop.tx.init(params), problems, key, 1)
    assert metrics()["grad_norm"] > 0
    for name in want:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        assert np.abs(a - b).max() <= 1e-7, name
        assert not np.array_equal(a, np.asarray(params[name])), name  # the step moved it
    for a, b in zip(jax.tree.leaves(got_opt), jax.tree.leaves(want_opt), strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-7
