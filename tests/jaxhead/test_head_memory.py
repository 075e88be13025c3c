"""Memory bounds from XLA's compiled memory analysis and from the saved residuals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals

import jaxhead

H, V = 4096, 151936
GiB = 2**30


def _loss(head):
    def loss(hidden, weight, labels):
        out = head(hidden, weight, labels)
        return jnp.sum(out.logprobs) + 0.01 * jnp.sum(out.entropy)

    return loss


def _temp_bytes(head, n):
    args = (
        jax.ShapeDtypeStruct((n, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((H, V), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    compiled = jax.jit(jax.grad(_loss(head), (0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_forward_backward_temporaries_bounded_at_seed_scale():
    n = 16384
    temp = _temp_bytes(jaxhead.token_logprobs, n)
    temp_4x = _temp_bytes(jaxhead.token_logprobs, 4 * n)
    plain = _temp_bytes(jaxhead.reference_token_logprobs, n)
    assert temp <= 1 * GiB, temp / GiB
    assert temp_4x <= temp, (temp_4x / GiB, temp / GiB)
    assert plain > 10 * temp  # the contrast the head exists for (plain JAX: ~22 GB)


def test_saved_residuals_hold_nothing_vocab_sized_but_the_weight():
    n, h, v = 64, 32, 1000
    res = saved_residuals(
        _loss(jaxhead.token_logprobs),
        jax.ShapeDtypeStruct((n, h), jnp.float32),
        jax.ShapeDtypeStruct((h, v), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    vocab_sized = [(aval, why) for aval, why in res if v in aval.shape]
    assert [aval.shape for aval, _ in vocab_sized] == [(h, v)], vocab_sized
    assert "argument" in vocab_sized[0][1]
    # and the plain head does save [n, v] arrays (so the check can fail)
    plain = saved_residuals(
        _loss(jaxhead.reference_token_logprobs),
        jax.ShapeDtypeStruct((n, h), jnp.float32),
        jax.ShapeDtypeStruct((h, v), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    assert any(aval.shape == (n, v) for aval, _ in plain)
