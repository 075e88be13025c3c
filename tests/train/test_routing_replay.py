"""``loss.routing_replay`` (issue #41: "the engine records each token's chosen experts and
the trainer uses them (R3)"; Ma et al. 2025, arXiv:2510.11370): the sampler's routes are
packed beside the tokens, the GRPO step's forwards take them, and ``expert_disagreement``
(the fraction of the sampler's (token, MoE layer, slot) routes the trainer's forward did
not take) says how far the two routed apart.

In-process on a float32 ``tiny-moe`` whose sampler's router is perturbed (a forced
disagreement), and as the GRPO loop on the micro config in bf16 compute (the issue's
``tiny-moe`` report: ``logprob_diff_max`` up to 0.225, "a routing flip is the likely
cause").
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import get_config
from tests.support import ROOT
from tests.support.models import random_model
from tests.support.multidevice import run_case
from tests.support.trainer import train_records
from train.config.cli import load_config
from train.rl import packing, rl_loss, rollout, steps, updates
from train.rl.placement import place_batch
from train.rl.state import ModelDef, params_of
from train.run import schema as config

P, G, T, STOP = 4, 2, 8, 7


def test_pack_places_each_sequences_routes_at_its_tokens():
    """Sequence k's routes (prompt then completion) sit at its tokens; padding is -1;
    ``rows`` slices them with the other arrays."""
    routes = [np.arange(5 * 2 * 3).reshape(5, 2, 3), 100 + np.arange(4 * 2 * 3).reshape(4, 2, 3)]
    b = packing.pack([[1, 2], [3]], [[4, 5, 6], [7, 8, 9]], 6, routes=routes)
    assert b.routes.shape == (2, 6, 2, 3) and b.routes.dtype == np.int32
    for k, r in enumerate(routes):
        where = np.argwhere((b.segment_ids > 0) & (
            b.tokens == np.array([[1], [3]])[k][0]))[0]  # the sequence's first token
        row, start = where
        np.testing.assert_array_equal(b.routes[row, start:start + len(r)], r)
    assert (b.routes[b.segment_ids == 0] == -1).all()
    np.testing.assert_array_equal(b.rows(1, 2).routes, b.routes[1:2])
    assert "routes" in b.arrays()
    with pytest.raises(ValueError, match=r"routes\[1\] has shape \(3, 2, 3\)"):
        packing.pack([[1, 2], [3]], [[4, 5, 6], [7, 8, 9]], 6, routes=[routes[0], routes[1][:3]])


def test_config_check_refuses_routing_replay_without_a_router():
    """A dense preset has no routes to replay; the invariant mode routes alike by
    construction; an MoE preset checks clean."""
    cfg = load_config(str(ROOT / "configs" / "grpo_micro.py"))
    cfg.loss.routing_replay = True
    problems = config.check(cfg)
    assert len(problems) == 1 and problems[0].startswith("loss.routing_replay = True: needs "
                                                         "an MoE model"), problems
    cfg.model.preset = "tiny-moe"
    assert config.check(cfg) == []
    cfg.model.overrides = {**cfg.model.overrides.to_dict(), "numerics": "invariant"}
    assert any(p.startswith("loss.routing_replay = True: unnecessary") for p in
               config.check(cfg))


@pytest.fixture(scope="module")
def moe_run():
    """A float32 ``tiny-moe`` trainer policy and a rollout of ``P`` uneven prompts x ``G``
    drawn by a copy whose routers are perturbed (so sampler and trainer route apart),
    its routes recorded: ``(mdef, trainer params, Sequences)``."""
    cfg = get_config("tiny-moe", dtype="float32")
    mdef, params = ModelDef.of(cfg), params_of(random_model(cfg, seed=4))
    sampler = {k: v + 0.05 * jax.random.normal(jax.random.key(i), v.shape)
               if k.endswith("router") else v for i, (k, v) in enumerate(params.items())}
    assert sum(k.endswith("router") for k in params) == cfg.num_hidden_layers
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, rng.integers(3, 14)).tolist() for _ in range(P)]
    gen = rollout.Generator(mdef, max_new_tokens=T, stop_ids=(STOP,), num_valid=500,
                            engine="compact", page_size=4, record_routes=True)
    ro = gen(sampler, prompts, jax.random.key(3), temperature=1.0, group_size=G)
    n = P * G
    comps = [ro.completion(i) for i in range(n)]
    adv = rl_loss.group_advantages(rng.random((P, G))).reshape(-1)
    values = {"old_logp": [ro.logprobs[i, :len(c)] for i, c in enumerate(comps)],
              "advantages": [np.full(len(c), adv[i], np.float32) for i, c in enumerate(comps)]}
    seq_prompts = [prompts[i // G] for i in range(n)]
    routes = [ro.sequence_routes(i, len(p)) for i, p in enumerate(seq_prompts)]
    return mdef, params, updates.Sequences(seq_prompts, comps, values, G, routes)


def _gradient_as_state():
    """An optax transformation that applies no update and keeps the gradient as its state."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, state, params=None: (jax.tree.map(jnp.zeros_like, g), g))


def _step(mdef, params, seqs, replay: bool):
    """One GRPO step over two micro-batches: ``(gradient, metrics, log-probs)``."""
    packed = seqs.pack(np.arange(P * G), 64, 4)
    lcfg = rl_loss.LossConfig(max_completion_len=T)
    step = steps.grpo_step(mdef, _gradient_as_state(), lcfg, temperature=1.0,
                           return_logp=True, routing_replay=replay)
    norm = rl_loss.LossNorm.of(packed.loss_mask, packed.seq_index, packed.num_seqs,
                               packed.segment_ids)
    parts = [packed.rows(0, 2), packed.rows(2, 4)]
    batches = tuple(place_batch(x.arrays(*x.values)) for x in parts)
    bucket = max(x.bucket(16) for x in parts)
    copy = jax.tree.map(jnp.copy, params)
    _, grads, metrics, logps = step(copy, jax.tree.map(jnp.zeros_like, params), batches,
                                    None, packed.num_seqs, bucket, norm)
    return grads, metrics, np.concatenate([np.asarray(x) for x in logps])


def test_step_replays_the_samplers_routes(moe_run):
    """Without replay the trainer's forward routes part of the tokens elsewhere than the
    perturbed sampler did (``expert_disagreement`` > 0); with ``routing_replay`` it takes
    every recorded route (exactly 0), its log-probs move, and the routers still get a
    gradient (the gate values are the trainer's router's)."""
    mdef, params, seqs = moe_run
    _, m_off, logp_off = _step(mdef, params, seqs, replay=False)
    g_on, m_on, logp_on = _step(mdef, params, seqs, replay=True)
    assert float(m_off["expert_disagreement"]) > 0.01, m_off["expert_disagreement"]
    assert float(m_on["expert_disagreement"]) == 0.0
    assert np.abs(logp_on - logp_off).max() > 1e-4
    for key in (k for k in params if k.endswith("router")):
        assert float(jnp.abs(g_on[key]).max()) > 0, key


def test_replay_without_recorded_routes_is_refused(moe_run):
    mdef, params, seqs = moe_run
    bare = updates.Sequences(seqs.prompts, seqs.completions, seqs.values, G)
    with pytest.raises(ValueError, match="routing replay needs the batch's routes"):
        _step(mdef, params, bare, replay=True)


def test_sharded_rollouts_record_and_the_sharded_step_replays():
    """On 4 devices (fsdp x expert; ``routing_replay_cases.py``): both engines record the
    routes one device records, and the sharded step replays them (a perturbed sampler's
    router: ``expert_disagreement`` > 0 without replay, exactly 0 with it)."""
    r = run_case("tests.train.routing_replay_cases:sharded_replay_case", 4)
    for engine in ("reference", "compact"):
        assert r[engine] == {"tokens": True, "routes": True, "prompt_routes": True}, r
    assert r["disagreement_replay_False"] > 0.01, r
    assert r["disagreement_replay_True"] == 0.0, r


LOOP = """
from configs.grpo_micro import get_config as micro


def get_config():
    c = micro()
    c.model.preset = "tiny-moe"
    c.model.overrides = {{**c.model.overrides.to_dict(), "num_hidden_layers": 2}}
    c.model.dtype = "bfloat16"
    c.sft.steps = 0
    c.eval.before_after = False
    c.train.steps = 1
    c.train.micro_batches = 2
    c.train.updates_per_batch = 2
    c.rollout.prompts_per_step = 4
    c.rollout.max_new_tokens = 16
    c.rollout.max_decode_rows = 3
    c.rollout.page_size = 4
    c.loss.routing_replay = {replay}
    return c
"""


def _metrics(tmp_path: Path, replay: bool) -> dict:
    (train,) = train_records(tmp_path, f"replay_{replay}", LOOP.format(replay=replay))
    return train


@pytest.mark.slow  # two trainer runs, minutes on 2 cores; the step's replay runs above
def test_grpo_loop_in_bf16_replays_to_zero_disagreement(tmp_path):
    """The GRPO loop on ``tiny-moe`` (2 layers, bf16 compute, compact engine under
    continuous batching, two micro-batches, two epochs): without replay the trainer's
    bf16 forward routes some of the sampler's (token, layer, slot) routes elsewhere
    (before the first update by rounding alone, after it also by the update: 0.013 of
    them over the step on a 2-core AMD EPYC); with ``loss.routing_replay`` it takes every
    one, at every update."""
    off = _metrics(tmp_path, False)
    assert off["expert_disagreement"] > 0, off
    on = _metrics(tmp_path, True)
    keys = [k for k in on if k.startswith("expert_disagreement")]
    assert len(keys) == 3 and all(on[k] == 0.0 for k in keys), on
