"""``ModelConfig.remat``: the same loss and gradients, and saved activations that no
longer grow with depth (``saved_residuals``: deterministic, not a measurement)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from models import Transformer, get_config
from tests.support.models import causal_inputs, random_model, random_tokens


def loss_and_grads(model, tokens):
    tokens, positions, segment_ids = causal_inputs(tokens)
    labels = jnp.roll(tokens, -1, axis=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        out, dec = m.token_logprobs(tokens, positions, segment_ids, labels)
        return -(out.logprobs.mean() + 0.1 * out.entropy.mean()) + 1e-2 * dec.aux_loss

    return jax.jit(jax.value_and_grad(loss)), params


# by default each policy once (the dense model without scan, the MoE model scanned)
@pytest.mark.parametrize("preset, policy, scan", [
    ("tiny", "nothing_saved", False), ("tiny-moe", "offload", True),
    pytest.param("tiny-moe", "nothing_saved", False, marks=pytest.mark.slow),
    pytest.param("tiny", "offload", True, marks=pytest.mark.slow)])
def test_remat_gives_the_same_loss_and_gradients(preset, policy, scan):
    cfg = get_config(preset, dtype="float32", scan_layers=scan)
    tokens = random_tokens((2, 24), seed=7)
    plain, params = loss_and_grads(random_model(cfg, seed=5), tokens)
    remat_cfg = cfg.replace(remat=True, remat_policy=policy)
    remat, params_r = loss_and_grads(random_model(remat_cfg, seed=5), tokens)
    (l0, g0), (l1, g1) = plain(params), remat(params_r)
    chex.assert_trees_all_close(l0, l1, rtol=1e-6)
    chex.assert_trees_all_close(jax.tree.leaves(g0), jax.tree.leaves(g1), rtol=1e-5,
                                atol=1e-7)


def residuals(layers, **cfg_args):
    """``(aval, why)`` of what the tiny model's head loss saves for its backward
    (4 rows of 256 tokens, hidden 64, float32), arguments left out."""
    cfg = get_config("tiny", dtype="float32", num_hidden_layers=layers, **cfg_args)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens, positions, segment_ids = causal_inputs(np.ones((4, 256), np.int32))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        out, _ = m.token_logprobs(tokens, positions, segment_ids, tokens)
        return out.logprobs.mean()

    return [(a, why) for a, why in saved_residuals(loss, params) if "argument" not in why]


def nbytes(avals) -> int:
    return sum(a.size * a.dtype.itemsize for a in avals)


def test_remat_saved_activations_do_not_grow_with_depth():
    def saved_bytes(layers, remat):
        return nbytes(a for a, _ in residuals(layers, remat=remat))

    plain = saved_bytes(8, False) - saved_bytes(2, False)
    remat = saved_bytes(8, True) - saved_bytes(2, True)
    # per extra layer the plain backward keeps its activations (with the blockwise
    # attention no [T, S] scores: tens of [4, 256, 64]-float32-sized arrays); remat keeps
    # the layer input ([4, 256, 64] float32) and its parameters
    assert plain > 6 * 10 * 4 * 256 * 64 * 4, plain
    assert remat < 0.1 * plain, (remat, plain)


@pytest.mark.parametrize("scan", [False, True])
def test_offload_saves_the_layer_inputs_in_host_memory(scan):
    """``remat_policy="offload"`` saves what ``"nothing_saved"`` saves, the layer inputs
    (``models.scan.LAYER_INPUT``) in host memory: one ``[4, 256, 64]`` per layer (stacked
    ``[L, ...]`` when scanned) on the host, and on the device only what both keep."""
    layers = 4
    device = lambda avals: [a for a in avals if a.memory_space != jax.memory.Space.Host]
    kept = [a for a, _ in residuals(layers, remat=True, scan_layers=scan)]
    offload = [a for a, _ in residuals(layers, remat=True, remat_policy="offload",
                                       scan_layers=scan)]
    host = [a for a in offload if a.memory_space == jax.memory.Space.Host]
    assert nbytes(host) == layers * 4 * 256 * 64 * 4, [a.str_short() for a in offload]
    assert not [a for a in kept if a.memory_space == jax.memory.Space.Host]
    assert nbytes(device(offload)) == nbytes(kept) - nbytes(host), (
        [a.str_short() for a in kept], [a.str_short() for a in offload])
