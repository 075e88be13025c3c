"""Routing replay (R3, issue #41: "the engine records each token's chosen experts and the
trainer uses them"; Ma et al. 2025, arXiv:2510.11370):

* both rollout engines record, for every token they run (the prompt's included), the
  experts of every MoE layer, and in float32 those are the trainer's own top-k of the
  same tokens packed as the trainer packs them (G > 1, uneven prompts, continuous
  batching);
* a forward given recorded experts uses exactly those (a disagreement forced by routes
  drawn from a perturbed router) with the gate values of its own router, checked against
  a float64 reference MoE written here, and the router's gradient flows through them;
* bad routes are refused with their shape named.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import get_config
from models.moe.layer import MoE, replay_route, route
from tests.support.models import random_model
from train.rl import packing, rollout, state

T, G, PAGE = 8, 3, 4
STOPS = tuple(range(0, 500, 16))
ENGINES = {"reference": {"engine": "reference"},
           "compact": {"engine": "compact", "page_size": PAGE, "max_decode_rows": 4}}


def _prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of uneven lengths (2 to 13 tokens: across page edges)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(20, 500, int(k)).tolist() for k in rng.integers(2, 14, n)]


@pytest.fixture(scope="module")
def moe_policy():
    cfg = get_config("tiny-moe", dtype="float32")
    model = random_model(cfg, seed=3)
    return model, state.ModelDef.of(model.cfg), state.params_of(model)


def _rollout(mdef, params, prompts, engine: str) -> rollout.Rollout:
    gen = rollout.Generator(mdef, max_new_tokens=T, stop_ids=STOPS, num_valid=500,
                            decode_chunk=3, rung_multiple=4, record_routes=True,
                            **ENGINES[engine])
    return gen(params, prompts, jax.random.key(11), temperature=1.0, group_size=G)


def test_recorded_routes_are_the_trainers_top_k(moe_policy):
    """Float32, both engines, G = 3 samples of 5 uneven prompts: each token's recorded
    experts (prompt and completion, all layers) equal, in order, those the trainer's
    packed forward of the same sequences takes; the engines record the same routes; a
    completion's last token (drawn, never run) and the packing's padding hold -1."""
    model, mdef, params = moe_policy
    prompts = _prompts(5, 0)
    runs = {engine: _rollout(mdef, params, prompts, engine) for engine in ENGINES}
    ref, comp = runs["reference"], runs["compact"]
    np.testing.assert_array_equal(ref.tokens, comp.tokens)
    np.testing.assert_array_equal(ref.routes, comp.routes)
    layers, k = 2, model.cfg.num_experts_per_tok
    assert ref.routes.shape == (len(prompts) * G, T, layers, k)
    assert ref.routes.dtype == np.int32
    rows = range(len(prompts) * G)
    seqs = [(prompts[i // G], ref.completion(i)) for i in rows]
    routes = [ref.sequence_routes(i, len(prompts[i // G])) for i in rows]
    for r in routes:
        assert (r[:-1] >= 0).all() and (r[-1] == -1).all(), r[:, 0, 0]
    assert sorted({int(n) for n in ref.lengths}) != [T]  # some stopped early
    packed = packing.pack([p for p, _ in seqs], [c for _, c in seqs], 64, routes=routes)
    out = nnx.jit(lambda m, *a: m(*a))(model, *(jnp.asarray(x) for x in (
        packed.tokens, packed.positions, packed.segment_ids)))
    known = packed.routes >= 0
    assert known.sum() == sum(len(r) - 1 for r in routes) * layers * k
    np.testing.assert_array_equal(np.where(known, np.asarray(out.routes), -1),
                                  packed.routes)


def _reference_moe(x, router, gate, up, down, experts, norm_topk_prob):
    """float64 numpy MoE on tokens ``x [N, H]`` routed to ``experts [N, k]``: weights
    are the softmax of ``x @ router`` over all experts gathered at them (renormalised
    with ``norm_topk_prob``); expert ``e`` is ``(silu(x W_g) * x W_u) W_d``."""
    x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up,
                                                                     down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    w = np.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(experts[n]):
            a = x[n] @ gate[e]
            out[n] += w[n, j] * (((a / (1 + np.exp(-a))) * (x[n] @ up[e])) @ down[e])
    return out


def _layer_and_routes(norm_topk_prob: bool):
    """An MoE layer, inputs ``x [2, 12, H]`` and the routes a perturbed copy of its
    router chose (-1 for the first two tokens of row 1: no route recorded)."""
    cfg = get_config("tiny-moe", dtype="float32", num_experts_per_tok=3,
                     norm_topk_prob=norm_topk_prob)
    moe = random_model(cfg, seed=5).layers[0].mlp
    assert isinstance(moe, MoE)
    x = jax.random.normal(jax.random.key(1), (2, 12, cfg.hidden_size))
    other = moe.router[...] + 0.1 * jax.random.normal(jax.random.key(2), moe.router.shape)
    _, recorded = jax.lax.top_k(jax.nn.softmax(x @ other), 3)
    recorded = np.array(recorded, np.int32)
    recorded[1, :2] = -1
    return moe, x, recorded


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replay_uses_the_recorded_experts(norm_topk_prob):
    """Routes from a perturbed router (most tokens' top-k differ from the layer's own):
    the replayed forward takes exactly them, and its output is the float64 reference MoE
    routed to them with the layer's own router weights (the unrecorded tokens: to their
    own top-k)."""
    moe, x, recorded = _layer_and_routes(norm_topk_prob)
    mask = jnp.ones(x.shape[:2], bool)
    y_own, _, own = moe(x, mask, with_experts=True)
    y, _, used = moe(x, mask, replay=jnp.asarray(recorded), with_experts=True)
    own, used = np.asarray(own), np.asarray(used)
    given = recorded[..., 0] >= 0
    differ = ~np.all(np.sort(own, -1) == np.sort(recorded, -1), axis=-1) & given
    assert differ.sum() >= 8, differ  # a real disagreement to replay
    np.testing.assert_array_equal(used[given], recorded[given])
    np.testing.assert_array_equal(used[~given], own[~given])
    params = [np.asarray(p[...]) for p in (moe.router, moe.gate_proj, moe.up_proj,
                                           moe.down_proj)]
    h = x.shape[-1]
    want = _reference_moe(np.asarray(x).reshape(-1, h), *params, used.reshape(-1, 3),
                          norm_topk_prob).reshape(x.shape)
    chex.assert_trees_all_close(np.asarray(y, np.float64), want, rtol=2e-5, atol=2e-6)
    # and not the layer's own routing
    assert np.abs(np.asarray(y) - np.asarray(y_own))[differ].max() > 1e-3


def test_replay_gradients_reach_the_router():
    """With replayed experts the output is a smooth function of the router (the top-k is
    fixed): the router's gradient is nonzero and its directional derivative equals a
    float64 central difference of the reference MoE."""
    moe, x, recorded = _layer_and_routes(True)
    mask = jnp.ones(x.shape[:2], bool)
    cot = jax.random.normal(jax.random.key(3), x.shape)

    def f(m):
        y, _ = m(x, mask, replay=jnp.asarray(recorded))
        return jnp.sum(y * cot)

    router = moe.router[...]
    grad = jax.tree.leaves(nnx.grad(f)(moe)["router"])[0]
    assert grad.shape == router.shape
    assert float(jnp.abs(grad).max()) > 0
    direction = np.asarray(jax.random.normal(jax.random.key(4), router.shape), np.float64)
    _, _, used = moe(x, mask, replay=jnp.asarray(recorded), with_experts=True)
    used = np.asarray(used).reshape(-1, 3)
    params = [np.asarray(p[...]) for p in (moe.gate_proj, moe.up_proj, moe.down_proj)]
    flat, c = np.asarray(x).reshape(-1, x.shape[-1]), np.asarray(cot, np.float64)

    def g(r):
        return np.sum(_reference_moe(flat, r, *params, used, True).reshape(c.shape) * c)

    eps, r64 = 1e-4, np.asarray(router, np.float64)
    numeric = (g(r64 + eps * direction) - g(r64 - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(grad, direction)), numeric, rtol=1e-3)


def test_replay_route_is_route_on_its_own_experts():
    """Replaying a token's own top-k gives ``route``'s weights bit for bit: replay off
    and replay of the same routes compute the same MoE."""
    logits = jax.random.normal(jax.random.key(0), (40, 8)) * 3
    for norm in (True, False):
        probs, weights, experts = route(logits, 2, norm)
        p2, w2, e2 = replay_route(logits, experts, 2, norm)
        for a, b in ((probs, p2), (weights, w2), (experts, e2)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_transformer_replays_routes_at_every_layer(scan):
    """``Transformer(..., routes=)`` (layers unrolled or scanned): every MoE layer takes
    the given experts, the ``-1`` tokens their own."""
    cfg = get_config("tiny-moe", dtype="float32", scan_layers=scan)
    model = random_model(cfg, seed=2)
    tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, 500)
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
    seg = jnp.ones_like(tokens)
    own = np.asarray(model(tokens, pos, seg).routes)
    given = np.array(jax.random.randint(jax.random.key(1), own.shape, 0, 8), np.int32)
    given[..., 1] = (given[..., 0] + 1 + given[..., 1] % 7) % 8  # two distinct experts
    given[0, 3] = -1
    used = np.asarray(model(tokens, pos, seg, routes=jnp.asarray(given)).routes)
    np.testing.assert_array_equal(np.delete(used[0], 3, 0), np.delete(given[0], 3, 0))
    np.testing.assert_array_equal(used[1], given[1])
    np.testing.assert_array_equal(used[0, 3], own[0, 3])


def test_bad_routes_are_refused(moe_policy):
    model = moe_policy[0]
    tokens = jnp.zeros((1, 4), jnp.int32)
    pos = jnp.arange(4)[None]
    with pytest.raises(ValueError, match=r"\[1, 4, 2, 2\], got int32 \[1, 4, 2, 3\]"):
        model(tokens, pos, jnp.ones_like(tokens), routes=jnp.zeros((1, 4, 2, 3), jnp.int32))
    dense = random_model(get_config("tiny", dtype="float32"), seed=0)
    with pytest.raises(ValueError, match="dense"):
        dense(tokens, pos, jnp.ones_like(tokens), routes=jnp.zeros((1, 4, 2, 2), jnp.int32))
    with pytest.raises(ValueError, match="record_routes=True needs an MoE model"):
        rollout.Generator(state.ModelDef.of(dense.cfg), max_new_tokens=T, stop_ids=STOPS,
                          num_valid=500, record_routes=True)
