"""``"invariant"``: attention whose result for a query does not depend on the batch, the
row, the page layout or the call (prefill, decode step, training forward) it is in
(``ModelConfig.numerics = "invariant"``, ``models.invariant``).

A query at position ``p`` reads its own sequence's keys in blocks of ``KEY_BLOCK``
positions aligned at ``0, KEY_BLOCK, 2 KEY_BLOCK, ...``, gathered by position, and
combines them with an online softmax (FlashAttention's, Dao et al. 2022,
arXiv:2205.14135) in block order. Keys after ``p`` are selected away (scores to
``-inf``, keys and values to 0), never multiplied by a zero weight. A block with no key
at or before ``p`` leaves the running max, sum and accumulator bitwise unchanged (the
rescale factor is exactly 1, the added terms exactly 0), so a query gives the same bits
whether the call runs more blocks (a longer cache, a longer packed row) or fewer. The
queries go in tiles of ``models.invariant.ROW_TILE`` and every block is one batched dot
of one shape (``[tile, K, G, D] x [tile, KEY_BLOCK, K, D]``) in float32: bf16 queries,
keys and values are upcast (their products are exact in float32; XLA:CPU runs float32
batched dots about 3x faster than bf16 ones) and the probabilities stay float32.

Three front ends gather the keys of the same positions from where each caller keeps
them: packed training rows (a sequence's positions ``0, 1, ...`` contiguous from its
segment's start, as ``train.rl.packing`` and prefill lay them out: ``self_attention``),
the dense ``KVCache`` whose decode slots follow the right-padded prompt
(``cache_attention``), and the paged pool (``paged_attention``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from models.attention.xla import _tie, chunked_attention
from models.invariant import ROW_TILE, map_tiles, pad_rows

#: Key positions per block.
KEY_BLOCK = 64


def _attend(q: jax.Array, positions: jax.Array, live: jax.Array, ctx, fetch: Callable,
            num_blocks: int, scale: float, out_dtype) -> jax.Array:
    """The blockwise attention of queries ``q`` ``[Q, K, G, D]`` at ``positions`` int32
    ``[Q]`` (``live`` bool ``[Q]``: a real query; the others return 0).

    ``fetch(ctx_tile, x)`` returns the keys and values ``[tile, KEY_BLOCK, K, D]`` of
    each query of a tile at its sequence's positions ``x`` int32 ``[tile, KEY_BLOCK]``
    (any finite or non-finite value where ``x`` is after the query: selected away);
    ``ctx`` is a pytree of per-query ``[Q, ...]`` arrays it reads, tiled with ``q``.
    ``num_blocks`` static: blocks ``0 .. num_blocks - 1`` (a block past every query of a
    tile is skipped). Returns ``[Q, K, G, D]`` in ``out_dtype``.
    """
    tile = ROW_TILE
    count = q.shape[0]
    padded = -(-count // tile) * tile

    def tiles(x):
        return pad_rows(x, padded).reshape(padded // tile, tile, *x.shape[1:])

    offsets = jnp.arange(KEY_BLOCK, dtype=jnp.int32)

    def one_tile(args):
        q_t, pos_t, live_t, ctx_t = args
        # the positions, the context and (below) the block index tied to the queries: the
        # same under remat in a layer scan as xla_chunked's tiles (``_tie``), else JAX's
        # partial evaluation saves every tile's and block's masks and key indices at once
        pos_t, live_t, ctx_t = _tie(q_t, pos_t, live_t, ctx_t)
        _, kh, g, d = q_t.shape
        init = (jnp.full((tile, kh, g), -jnp.inf, jnp.float32),
                jnp.zeros((tile, kh, g), jnp.float32),
                jnp.zeros((tile, kh, g, d), jnp.float32))

        def block(j, carry):
            (j,) = _tie(q_t, j)
            x = jnp.broadcast_to(j * KEY_BLOCK + offsets, (tile, KEY_BLOCK))
            valid = live_t[:, None] & (x <= pos_t[:, None])

            def update(carry):
                m, l, acc = carry
                sel = valid[:, :, None, None]
                k, v = (jnp.where(sel, y.astype(jnp.float32), 0.0) for y in fetch(ctx_t, x))
                s = jnp.einsum("qkgd,qlkd->qkgl", q_t, k) * scale
                mask = valid[:, None, None, :]
                s = jnp.where(mask, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.where(mask, jnp.exp(s - safe[..., None]), 0.0)
                # exactly 1 where the max did not move: a block with nothing for a query
                # leaves its (m, l, acc) bitwise as they were
                corr = jnp.where(m_new == m, 1.0,
                                 jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0))
                pv = jnp.einsum("qkgl,qlkd->qkgd", p, v)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

            return lax.cond(valid.any(), update, lambda c: c, carry)

        _, l, acc = lax.fori_loop(0, num_blocks, block, init)
        return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(out_dtype)

    xs = (tiles(q.astype(jnp.float32)), tiles(positions.astype(jnp.int32)), tiles(live),
          jax.tree.map(tiles, ctx))
    out = map_tiles(one_tile, xs)
    return out.reshape(padded, *out.shape[2:])[:count]


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """``[..., N, D]`` -> ``[prod(...), K, N / K, D]``."""
    n, d = q.shape[-2:]
    return q.reshape(-1, kv_heads, n // kv_heads, d)


def _blocks(length: int) -> int:
    return -(-length // KEY_BLOCK)


def self_attention(q, k, v, positions, segment_ids, *, scale: float) -> jax.Array:
    """Causal attention of packed rows: ``q`` ``[B, T, N, D]``, ``k``, ``v`` ``[B, T, K,
    D]``, ``positions`` / ``segment_ids`` int ``[B, T]``. Each non-zero segment's tokens
    are contiguous in their row with positions ``0, 1, ...`` from its first token (the
    trainer's packing and prefill; under ``jit`` the caller's precondition): a query at
    index ``t`` and position ``p`` reads the keys at indices ``t - p .. t``. Padding
    queries (segment 0) return 0. Returns ``[B, T, N, D]`` in ``v``'s dtype.

    The backward pass is ``"xla_chunked"``'s (``models.attention.xla``: the same
    attention's FlashAttention-2 backward, recomputing its tiles): the gradient of the
    same function, to float rounding; only the forward values need to be the sampler's.
    Differentiating the gathers instead would scatter-add into the whole key buffer for
    every query tile and block."""
    return _trained(q, k, v, positions, segment_ids, float(scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _trained(q, k, v, positions, segment_ids, scale):
    return _packed_forward(q, k, v, positions, segment_ids, scale)


def _trained_fwd(q, k, v, positions, segment_ids, scale):
    out = _packed_forward(q, k, v, positions, segment_ids, scale)
    return out, (q, k, v, positions, segment_ids)


def _trained_bwd(scale, res, dout):
    q, k, v, positions, segment_ids = res

    def chunked(q, k, v):
        return chunked_attention(q, k, v, positions, segment_ids, positions, segment_ids,
                                 scale=scale)

    _, vjp = jax.vjp(chunked, q, k, v)
    return (*vjp(dout), None, None)


_trained.defvjp(_trained_fwd, _trained_bwd)


def _packed_forward(q, k, v, positions, segment_ids, scale):
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    flat_k, flat_v = (y.reshape(b * t, kv_heads, d).astype(jnp.float32) for y in (k, v))
    index = jnp.arange(b * t, dtype=jnp.int32)
    start = index - positions.reshape(-1).astype(jnp.int32)  # the sequence's first slot

    def fetch(start_t, x):
        idx = jnp.clip(start_t[:, None] + x, 0, b * t - 1)
        return jnp.take(flat_k, idx, axis=0), jnp.take(flat_v, idx, axis=0)

    out = _attend(_grouped(q, kv_heads), positions.reshape(-1), segment_ids.reshape(-1) != 0,
                  start, fetch, _blocks(t), scale, v.dtype)
    return out.reshape(b, t, n, d)


def cache_attention(q, k, v, positions, segment_ids, kv_positions, kv_segment_ids, *,
                    scale: float) -> jax.Array:
    """Attention of ``T`` new tokens over a dense ``KVCache`` row holding one sequence
    (prompt slots, then decode slots: the reference engine's and the compact engine's
    prefill layout): ``q`` ``[B, T, N, D]``, ``k``, ``v`` ``[B, L, K, D]``, int ``[B, T]``
    / ``[B, L]`` positions and segment ids (0: empty slot or padding). The key at position
    ``x`` is the row's written slot holding ``x``. Returns ``[B, T, N, D]`` in ``v``'s
    dtype."""
    b, t, n, d = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    written = jnp.where(kv_segment_ids != 0, kv_positions, length)  # past the end: dropped
    slot_of = jnp.zeros((b, length), jnp.int32).at[rows, written].set(
        jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length)), mode="drop")
    flat_k, flat_v = k.reshape(b * length, kv_heads, d), v.reshape(b * length, kv_heads, d)
    row_of = jnp.broadcast_to(rows, (b, t)).reshape(-1)

    def fetch(row_t, x):
        slot = slot_of[row_t[:, None], jnp.clip(x, 0, length - 1)]
        idx = row_t[:, None] * length + slot
        return jnp.take(flat_k, idx, axis=0), jnp.take(flat_v, idx, axis=0)

    out = _attend(_grouped(q, kv_heads), positions.reshape(-1), segment_ids.reshape(-1) != 0,
                  row_of, fetch, _blocks(length), scale, v.dtype)
    return out.reshape(b, t, n, d)


def paged_attention(q, k_pages, v_pages, tables, lengths, scale) -> jax.Array:
    """One token per row over a paged pool (``models.attention.paged``'s ``"invariant"``
    entry): ``q`` ``[R, N, D]``, pools ``[P, K, S, D]``, ``tables`` int32 ``[R, M]``,
    ``lengths`` int32 ``[R]`` (the query sits at position ``lengths - 1``; 0: no row,
    zeros out). Returns ``[R, N, D]`` in the pool's dtype."""
    r, n, d = q.shape
    _, kv_heads, size, _ = k_pages.shape
    width = tables.shape[1]

    def fetch(table_t, x):
        page = jnp.take_along_axis(table_t, jnp.clip(x // size, 0, width - 1), axis=1)
        off = x % size
        get = {"mode": "fill", "fill_value": 0}
        return (k_pages.at[page, :, off, :].get(**get),
                v_pages.at[page, :, off, :].get(**get))

    out = _attend(_grouped(q, kv_heads), lengths - 1, lengths > 0, tables, fetch,
                  _blocks(width * size), scale, v_pages.dtype)
    return out.reshape(r, n, d)
