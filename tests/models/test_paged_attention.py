"""Paged decode attention (``models.attention.paged``) against a float64 NumPy reference on
random pools, block tables and row lengths (rows of 0 slots, a partial last page, the
whole table), grouped-query heads; the page write; bad input; and the paged decode step
of the model against the dense KV cache's."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import get_config
from models.attention.paged import REGISTRY, paged_attention, xla_paged
from models.cache import PagedKVCache, init_pages
from models.cache.paged import write_pages
from tests.support.models import random_model

K, N, D, S, P, R, M = 2, 6, 8, 4, 48, 5, 7
SCALE = D ** -0.5
LENGTHS = np.array([0, 1, 7, 28, 13])  # slots read per row (0: a finished row)


def _inputs(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(R, N, D))
    kp, vp = rng.normal(size=(2, P, K, S, D))
    tables = rng.permutation(P)[:R * M].reshape(R, M)  # rows own distinct pages
    tables[1, 0] = tables[2, 0]  # two rows share a page (a prompt's)
    return q, kp, vp, tables, (jnp.asarray(x, dtype) for x in (q, kp, vp))


def reference(q, kp, vp, tables, lengths):
    """float64: row r's query over slots [0, lengths[r]) of its pages, heads grouped."""
    out = np.zeros(q.shape)
    for r, n in enumerate(lengths):
        slots = np.arange(n)
        keys = kp[tables[r, slots // S], :, slots % S].swapaxes(0, 1)  # [K, n, D]
        values = vp[tables[r, slots // S], :, slots % S].swapaxes(0, 1)
        for h in range(N):
            g = h // (N // K)
            s = keys[g] @ q[r, h] * SCALE
            if n:
                p = np.exp(s - s.max())
                out[r, h] = p / p.sum() @ values[g]
    return out


@pytest.mark.parametrize("impl", REGISTRY.names)
def test_matches_the_float64_reference(impl):
    q64, kp64, vp64, tables, (q, kp, vp) = _inputs()
    want = reference(q64, kp64, vp64, tables, LENGTHS)
    got = jax.jit(lambda *a: paged_attention(*a, scale=SCALE, impl=impl))(
        q, kp, vp, jnp.asarray(tables), jnp.asarray(LENGTHS - 1))
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, atol=2e-6, rtol=0)
    assert np.all(np.asarray(got)[0] == 0)  # a row of 0 slots reads nothing


@pytest.mark.parametrize("block", [1, 3, 8])
def test_blocks_of_pages_do_not_change_the_result(block):
    q64, kp64, vp64, tables, (q, kp, vp) = _inputs(seed=1)
    want = reference(q64, kp64, vp64, tables, LENGTHS)
    got = xla_paged(q, kp, vp, jnp.asarray(tables), jnp.asarray(LENGTHS), SCALE, block)
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, atol=2e-6, rtol=0)


def test_xla_reads_only_blocks_up_to_the_longest_row():
    """Pages past the longest row's blocks hold NaN: the loop never reads them."""
    q64, kp64, vp64, tables, (q, kp, vp) = _inputs(seed=2)
    lengths = np.array([0, 1, 7, 8, 5])  # blocks of 2 pages = 8 slots: one block
    unread = np.unique(tables[:, 2:])
    kp, vp = (x.at[unread].set(jnp.nan) for x in (kp, vp))
    got = xla_paged(q, kp, vp, jnp.asarray(tables), jnp.asarray(lengths), SCALE, 2)
    want = reference(q64, kp64, vp64, tables, lengths)
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, atol=2e-6, rtol=0)


def test_write_sets_each_rows_slot_and_nothing_else():
    _, _, _, tables, (_, kp, vp) = _inputs(seed=3)
    rng = np.random.default_rng(3)
    keys, values = (jnp.asarray(rng.normal(size=(R, K, D)), jnp.float32) for _ in range(2))
    slots = np.array([-1, 0, 6, 27, 12])
    kp2, vp2 = write_pages(kp, vp, jnp.asarray(tables), jnp.asarray(slots), keys, values)
    want_k, want_v = np.array(kp), np.array(vp)
    for r, s in enumerate(slots):
        if s >= 0:
            want_k[tables[r, s // S], :, s % S] = keys[r]
            want_v[tables[r, s // S], :, s % S] = values[r]
    np.testing.assert_array_equal(np.asarray(kp2), want_k)
    np.testing.assert_array_equal(np.asarray(vp2), want_v)


def test_unknown_impl_raises():
    _, _, _, tables, (q, kp, vp) = _inputs()
    with pytest.raises(ValueError, match="must be 'auto' or one of .*got 'splash'"):
        paged_attention(q, kp, vp, jnp.asarray(tables), jnp.asarray(LENGTHS - 1),
                        scale=SCALE, impl="splash")


def test_paged_decode_step_matches_the_dense_cache():
    """A prompt prefilled with the dense cache, its KV copied to scattered pages, then one
    decode step with each cache: the same hidden states (the model's own paths)."""
    model = random_model(get_config("tiny", dtype="float32", num_hidden_layers=2), seed=1)
    rng = np.random.default_rng(5)
    lens = np.array([5, 11])
    width, size = 16, 4
    prompts = jnp.asarray(rng.integers(1, 500, (2, width)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (2, width))
    seg = (pos < lens[:, None]).astype(jnp.int32)
    out = model(prompts, pos, seg, model.init_cache(2, width + 1))
    new = jnp.asarray([[7], [9]], jnp.int32)
    step_pos = jnp.asarray(lens[:, None], jnp.int32)
    # the dense cache: slot `width` holds the new token (after the padded prompt)
    dense = model(new, step_pos, jnp.ones_like(step_pos), out.cache).hidden
    # pages: each row's slots [0, width) in shuffled pages, the new token at slot lens[r]
    tables = rng.permutation(12)[:2 * (width // size)].reshape(2, -1)
    keys, values = init_pages(model.cfg, 12, size)

    def paged(pool, cached):  # [P, K, S, D] <- [B, W + 1, K, D]
        return pool.at[tables].set(jnp.swapaxes(
            cached[:, :width].reshape(2, width // size, size, *cached.shape[2:]), 2, 3))

    keys = tuple(map(paged, keys, out.cache.keys))
    values = tuple(map(paged, values, out.cache.values))
    cache = PagedKVCache(keys, values, jnp.asarray(tables), jnp.asarray(lens, jnp.int32))
    got = model(new, step_pos, jnp.ones_like(step_pos), cache).hidden
    chex.assert_trees_all_close(got, dense, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="one token per row, got 2"):
        model(jnp.zeros((2, 2), jnp.int32), pos[:, :2], seg[:, :2], cache)
