"""The NNX LMHead: owned and tied weights, gradients reach the owning parameter."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxhead

CONFIG = jaxhead.XlaConfig(vocab_chunk=64)


def _data(n=24, h=16):
    hidden = jax.random.normal(jax.random.key(0), (n, h))
    labels = jax.random.randint(jax.random.key(1), (n,), 0, 200)
    keep = jnp.arange(n) % 3 != 0
    return hidden, labels, keep


def test_owned_kernel_matches_function_and_gets_gradient():
    head = jaxhead.LMHead(16, 200, rngs=nnx.Rngs(0), config=CONFIG)
    hidden, labels, keep = _data()
    out = head(hidden, labels, keep)
    ref = jaxhead.token_logprobs(hidden, head.kernel[...], labels, keep, config=CONFIG)
    chex.assert_trees_all_close(out, ref, atol=0, rtol=0)
    assert nnx.get_partition_spec(nnx.state(head)).kernel.get_value() == jax.sharding.PartitionSpec(
        "embed", "vocab")

    def loss(head):
        return head(hidden, labels, keep).logprobs.sum()

    grads = nnx.grad(loss)(head)
    assert float(jnp.abs(grads.kernel[...]).sum()) > 0


def test_tied_head_reads_and_trains_the_embedding_table():
    embed = nnx.Embed(200, 16, rngs=nnx.Rngs(1))
    head = jaxhead.LMHead(16, 200, tied_embedding=embed, softcap=30.0, config=CONFIG)
    hidden, labels, keep = _data()
    out = head(hidden, labels, keep)
    ref = jaxhead.reference_token_logprobs(hidden, embed.embedding[...].T, labels, keep,
                                           softcap=30.0)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=2e-6)

    class Model(nnx.Module):
        def __init__(self):
            self.embed, self.head = embed, head

    model = Model()
    grads = nnx.grad(lambda m: m.head(hidden, labels, keep).logprobs.sum())(model)
    assert float(jnp.abs(grads.embed.embedding[...]).sum()) > 0
    logits = head.logits(hidden)
    chex.assert_shape(logits, (24, 200))


def test_tied_shape_mismatch_and_missing_rngs():
    with pytest.raises(ValueError, match=r"tied embedding has shape \(200, 16\), expected"):
        jaxhead.LMHead(16, 100, tied_embedding=nnx.Embed(200, 16, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="needs rngs"):
        jaxhead.LMHead(16, 100)
