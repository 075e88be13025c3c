"""Decode attention over a paged KV cache (``models.cache.PagedKVCache``): one new token
per row reads only the slots its row has written.

Implementations (``REGISTRY``, ``"auto"`` picks ``"xla"``):

* ``"xla"``: a ``while_loop`` over blocks of ``pages_per_block`` pages up to the longest
  row of the batch (a dynamic trip count: slots past it are never read), gathering each
  block's pages through the block table, with an online softmax in float32.
* ``"invariant"``: ``models.attention.invariant.paged_attention`` (keys in blocks at
  fixed positions, rows in fixed tiles: ``ModelConfig.numerics = "invariant"``).
* ``"dense"``: every page of every row's table gathered at once, masked by the row's
  length: the test reference.

A row with ``slots = -1`` (finished, or padding) reads nothing and returns zeros; its
write is dropped.

Isolation: a row reads only the slots it wrote. Block-table entries outside the pool
(unused ones) gather zeros, and the slots past a row's length are **selected** away
(``where``) in both the scores and the values, never multiplied by a zero weight: a
page's stale contents, or another request's NaN, cannot reach the row (0 x NaN is NaN).

Under a mesh the pool is split along its page axis over the batch axes present and the
rows along theirs, a row's page ids being local to its shard: the write and the
attention run inside ``jax.shard_map`` (manual over those axes only, so the heads stay
split as the compiler chooses), and no device reads another's pages.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxhead import dispatch
from models.attention import invariant
from models.cache.paged import per_shard

#: Pages read per iteration of the ``"xla"`` loop (fewer when the table is narrower).
PAGES_PER_BLOCK = 8


def _scores(q: jax.Array, keys: jax.Array, scale: float) -> jax.Array:
    """float32 ``[R, K, G, L]`` of ``q`` ``[R, K, G, D]`` and ``keys`` ``[R, K, L, D]``."""
    return jnp.einsum("rkgd,rkld->rkgl", q, keys,
                      preferred_element_type=jnp.float32) * scale


def _gather(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """``[R, K, n S, D]``: the pages ``tables`` ``[R, n]`` of ``pages`` ``[P, K, S, D]``
    (an id outside ``[0, P)`` reads zeros)."""
    _, k, s, d = pages.shape
    r, n = tables.shape
    got = jnp.take(pages, tables, axis=0, mode="fill", fill_value=0)
    return jnp.swapaxes(got, 1, 2).reshape(r, k, n * s, d)


def _weighted(p: jax.Array, values: jax.Array, valid: jax.Array) -> jax.Array:
    """float32 ``sum_l p[..., l] values[..., l, :]`` over the ``valid`` ``[R, L]`` slots
    only: the others' values are selected away, not multiplied by ``p = 0``."""
    values = jnp.where(valid[:, None, :, None], values.astype(jnp.float32), 0.0)
    return jnp.einsum("rkgl,rkld->rkgd", p, values)


def _grouped(q: jax.Array, heads: int) -> jax.Array:
    r, n, d = q.shape
    return q.reshape(r, heads, n // heads, d)


def dense_paged(q, k_pages, v_pages, tables, lengths, scale):
    """``"dense"``: the whole table of every row at once (see the module docstring)."""
    keys, values = _gather(k_pages, tables), _gather(v_pages, tables)
    s = _scores(_grouped(q, k_pages.shape[1]), keys, scale)
    valid = jnp.arange(keys.shape[2]) < lengths[:, None]
    mask = valid[:, None, None, :]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    p = jnp.where(mask, p, 0.0)
    out = _weighted(p, values, valid)
    return out.reshape(q.shape).astype(v_pages.dtype)


def xla_paged(q, k_pages, v_pages, tables, lengths, scale,
              pages_per_block: int = PAGES_PER_BLOCK):
    """``"xla"``: blocks of pages up to the longest row (see the module docstring)."""
    _, heads, size, _ = k_pages.shape
    width = tables.shape[1]
    block = min(pages_per_block, width)
    tables = jnp.pad(tables, ((0, 0), (0, -width % block)))
    qg = _grouped(q, heads)
    span = block * size
    trips = (jnp.max(lengths, initial=0) + span - 1) // span

    def body(j, carry):
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, j * block, block, axis=1)
        keys, values = _gather(k_pages, ids), _gather(v_pages, ids)
        s = _scores(qg, keys, scale)
        valid = j * span + jnp.arange(span) < lengths[:, None]
        mask = valid[:, None, None, :]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - safe[..., None]), 0.0)
        corr = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
        acc = acc * corr[..., None] + _weighted(p, values, valid)
        return m_new, l * corr + p.sum(-1), acc

    shape = qg.shape[:-1]
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(qg.shape, jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, trips, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(q.shape).astype(v_pages.dtype)


#: ``paged_attention``'s implementations, in ``"auto"``'s order.
REGISTRY: dispatch.Registry[Callable] = dispatch.Registry("paged_attention_impl", [
    dispatch.Entry("xla", lambda plan, *args: xla_paged(*args)),
    dispatch.Entry("invariant", lambda plan, *args: invariant.paged_attention(*args),
                   auto=False),
    dispatch.Entry("dense", lambda plan, *args: dense_paged(*args), auto=False),
])


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    tables: jax.Array, slots: jax.Array, *, scale: float,
                    impl: str = "auto") -> jax.Array:
    """One new token per row attending to its row's written slots ``[0, slots]``.

    Args:
      q: ``[R, N, D]`` the new tokens' queries (``N % K == 0``, grouped-query).
      k_pages, v_pages: ``[P, K, S, D]`` the pool, the new tokens already written
        (``write_pages``).
      tables: int32 ``[R, M]`` block tables; slots: int32 ``[R]`` (-1: read nothing).
      scale: logit scale (``D ** -0.5``).
      impl: ``"auto"`` or one of ``REGISTRY.names``.

    Returns:
      ``[R, N, D]`` in the dtype of ``v_pages`` (zeros for rows with ``slots = -1``).

    Raises:
      ValueError: unknown ``impl``; pages or rows that do not split over the mesh.
    """
    run = REGISTRY.resolve(impl)

    def attend(kp, vp, q, tables, slots):
        return run(q, kp, vp, tables, slots + 1, scale)

    return per_shard(attend, (k_pages, v_pages), (q, tables, slots), 0, 1)
