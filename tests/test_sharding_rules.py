"""Placement rules, host bucket choice, and the vocab-parallel combination of statistics
(checked in this process: ``jax.vmap`` with an axis name stands in for the vocab axis)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import head_inputs
from flax import nnx
from jax.sharding import PartitionSpec as P
from multidevice import abstract_mesh

import jaxhead
from jaxhead import vocab_parallel, xla
from models import Transformer, get_config, init_sharded, state_shardings
from models.sharding import logical_to_mesh


def test_default_rules():
    mesh = abstract_mesh(data=2, fsdp=2, expert=2, tensor=2)
    assert logical_to_mesh(("expert", "embed", "mlp"), mesh) == P("expert", "fsdp", "tensor")
    assert logical_to_mesh(("embed", "heads", "head_dim"), mesh) == P("fsdp", "tensor", None)
    assert logical_to_mesh(("vocab", "embed"), mesh) == P("tensor", "fsdp")
    rules = (("embed", "fsdp"), ("mlp", ("fsdp", "tensor")), ("vocab", "model"))
    # an axis used by an earlier dimension is dropped; an axis the mesh lacks too
    assert logical_to_mesh(("embed", "mlp", "vocab"), mesh, rules) == P("fsdp", "tensor", None)
    with pytest.raises(ValueError, match=r"q_proj of shape \(64, 3, 16\): dimension 1 "
                                         r"\(heads\) of size 3 is not divisible by the 2"):
        logical_to_mesh(("embed", "heads", "head_dim"), mesh, shape=(64, 3, 16), what="q_proj")


def test_state_shardings_and_init_sharded():
    cfg = get_config("tiny-moe", num_hidden_layers=1)
    mesh = jaxhead.make_mesh()  # every device on "data" (one here)
    model = init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    specs = {"/".join(map(str, p)): v.get_value().spec
             for p, v in nnx.to_flat_state(state_shardings(nnx.state(model), mesh))}
    assert specs["layers/0/mlp/gate_proj"] == P("expert", "fsdp", "tensor")
    assert specs["layers/0/mlp/router"] == P("fsdp", "expert")
    assert specs["layers/0/self_attn/q_proj"] == P("fsdp", "tensor", None)
    assert specs["embed_tokens/embedding"] == P("tensor", "fsdp")
    assert specs["lm_head/kernel"] == P("fsdp", "tensor")
    placed = model.layers[0].mlp.down_proj[...]
    assert placed.sharding.spec == P("expert", "tensor", "fsdp")
    plain = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(0))))()
    chex.assert_trees_all_equal(nnx.state(model), plain)


def test_bucket_for_shards_on_the_host():
    keep = np.zeros((8, 100), bool)
    keep[5, :70] = True  # shard 2 of 4 (rows 4-5) holds 70 of its 200 tokens
    keep[0, :10] = True
    assert jaxhead.bucket_for_shards(keep, 4) == jaxhead.bucket_size(70, 200) == 128
    assert jaxhead.bucket_for_shards(keep, abstract_mesh(data=2, expert=2)) == 128
    assert jaxhead.bucket_for_shards(keep, 8, multiple=16) == 80  # shard 5: 70 of 100
    with pytest.raises(ValueError, match="8 rows on this process, not divisible by its 3"):
        jaxhead.bucket_for_shards(keep, 3)


def test_vocab_parallel_combination_equals_one_pass():
    """Statistics of 4 vocab shards combined with pmax/psum equal one scan of the whole
    vocabulary: logZ, log-probs and entropy. Rows 0-3 have their max logit tied across
    two shards; rows 8-15 are scaled up so that some are peaked to entropies ~1e-6."""
    n, h, v, shards = 16, 32, 512, 4
    hidden, weight, labels = head_inputs(3, n, h, v, exact_dot=True)
    u = hidden[0]  # rows 0-3: the max logit ~12 at columns 5 and 389 (shards 0 and 3)
    col = jnp.round(12.0 * u / jnp.sum(u * u) * 1024) / 1024
    hidden = hidden.at[:4].set(u).at[8:].multiply(6.0)
    weight = weight.at[:, 5].set(col).at[:, 389].set(col)
    labels = labels.at[:2].set(389)
    cfg, _ = xla.make_config(n, h, v // shards, jnp.float32, softcap=None, with_entropy=True,
                             token_chunk=8, vocab_chunk=48)
    inv_temp = jnp.full((n,), 1.0 / 0.9)
    w_shards = weight.reshape(h, shards, v // shards).transpose(1, 0, 2)
    offsets = jnp.arange(shards) * (v // shards)

    def per_shard(w_local, off):
        stats = xla.partial_stats(cfg, hidden, w_local, labels - off, inv_temp)
        return xla.finish(vocab_parallel.combine(stats, "v", True), True)

    got = jax.jit(jax.vmap(per_shard, axis_name="v"))(w_shards, offsets)
    full_cfg, _ = xla.make_config(n, h, v, jnp.float32, softcap=None, with_entropy=True,
                                  token_chunk=8, vocab_chunk=48)
    ref = jax.jit(lambda w: xla.finish(
        xla.partial_stats(full_cfg, hidden, w, labels, inv_temp), True))(weight)
    for g, want in zip(got, ref, strict=True):
        for k in range(shards):  # every shard returns the combined values
            np.testing.assert_allclose(g[k], want, rtol=2e-6, atol=2e-6)
    z = hidden[:4] @ weight
    assert bool(jnp.all(jnp.argmax(z, axis=1) == 5)) and bool(jnp.all(z[:, 5] == z[:, 389]))
    assert float(jnp.min(jnp.abs(ref[2][8:]))) < 1e-5  # near-zero entropies are exercised
