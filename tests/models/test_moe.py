"""Dropless MoE: every routed (token, expert) pair contributes, checked against a dense
per-expert loop in float32, values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Transformer, get_config
from models.moe.layer import MoE, route
from models.moe.reference import dropless_experts
from tests.support.models import random_model


def dense_reference(x, router, gate, up, down, top_k, norm_topk_prob):
    """Loop over experts; each expert runs on every token, weighted by the token's routing
    weight for it (0 when not among its top-k)."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    top = jnp.sort(probs, axis=-1)[:, -top_k][:, None]
    weights = jnp.where(probs >= top, probs, 0.0)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    out = jnp.zeros_like(x)
    for e in range(router.shape[1]):
        y = (jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]
        out = out + weights[:, e:e + 1] * y
    return out


def moe_layer(**overrides):
    cfg = get_config("tiny-moe", dtype="float32", **overrides)
    return random_model(cfg, seed=7).layers[0].mlp


def moe_params(moe):
    return (moe.router[...], moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])


@pytest.mark.parametrize("skewed", [False, True], ids=["random-routing", "all-to-two"])
def test_dropless_moe_matches_dense_loop(skewed):
    moe = moe_layer(num_experts_per_tok=3, norm_topk_prob=not skewed)
    assert isinstance(moe, MoE)
    x = jax.random.normal(jax.random.key(0), (2, 24, 64))
    if skewed:  # every token routes to experts 5, 2 and 0: far above any fair capacity
        x = jnp.abs(x)
        router = jnp.zeros((64, 8)).at[:, 5].set(0.3).at[:, 2].set(0.2).at[:, 0].set(0.1)
        moe.router[...] = router + 0.01 * moe.router[...]
    flat = x.reshape(-1, 64)
    _, experts = jax.lax.top_k(flat @ moe.router[...], 3)
    if skewed:
        assert set(np.unique(np.asarray(experts)).tolist()) == {0, 2, 5}

    def ours(params, x):  # MoE.__call__ as a function of the parameters
        router, gate, up, down = params
        _, weights, experts = route(x @ router, 3, moe.norm_topk_prob)
        return dropless_experts(x, experts, weights, gate, up, down)

    def ref(params, x):
        return dense_reference(x, *params, 3, moe.norm_topk_prob)

    @jax.jit
    def value_and_vjp(params, x, cotangent):
        y_ours, vjp_ours = jax.vjp(ours, params, x)
        y_ref, vjp_ref = jax.vjp(ref, params, x)
        return y_ours, y_ref, vjp_ours(cotangent), vjp_ref(cotangent)

    y, _ = nnx.jit(lambda moe, x: moe(x, jnp.ones(x.shape[:2], bool)))(moe, x)
    cotangent = jax.random.normal(jax.random.key(1), flat.shape)
    y_ours, y_ref, g_ours, g_ref = value_and_vjp(moe_params(moe), flat, cotangent)
    np.testing.assert_allclose(y.reshape(-1, 64), y_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(y_ours, y_ref, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_sparse_layer_pattern():
    cfg = get_config("tiny-moe", num_hidden_layers=6, decoder_sparse_step=2,
                     mlp_only_layers=(3,))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["MLP", "MoE", "MLP", "MLP", "MLP", "MoE"]
    assert cfg.is_moe and not get_config("tiny").is_moe
