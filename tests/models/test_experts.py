"""The grouped expert SwiGLU gives the same rows and gradients whether the rows go through
``ragged_dot`` in one call or in chunks (each chunk with the group sizes of its rows)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from models.moe.experts import expert_ffn, rows_per_chunk


def test_row_chunks_equal_one_call():
    k = jax.random.split(jax.random.key(0), 5)
    rows, h, i, e = 1000, 16, 8, 6
    xs = jax.random.normal(k[0], (rows, h))
    weights = (jax.random.normal(k[1], (e, h, i)) / 4, jax.random.normal(k[2], (e, h, i)) / 4,
               jax.random.normal(k[3], (e, i, h)) / 3)
    sizes = jnp.array([100, 0, 333, 250, 7, 200], jnp.int32)  # 890 rows; the rest: none
    cotangent = jax.random.normal(k[4], (rows, h))

    def vjp(chunk):
        def f(xs, *w):
            return expert_ffn(xs, sizes, *w, chunk=chunk)

        out, pullback = jax.vjp(f, xs, *weights)
        return out, pullback(cotangent)

    one, grads_one = jax.jit(lambda: vjp(4096))()
    chunked, grads_chunked = jax.jit(lambda: vjp(96))()  # 11 chunks, groups cut across them
    np.testing.assert_allclose(chunked, one, rtol=0, atol=1e-6)
    assert float(jnp.max(jnp.abs(one[890:]))) == 0.0 and float(jnp.max(jnp.abs(one[:890]))) > 0
    for a, b in zip(grads_chunked, grads_one, strict=True):
        chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-5)
    assert rows_per_chunk(8) == 16384 and rows_per_chunk(128) == 1024
