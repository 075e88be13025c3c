"""The ``"invariant"`` attention (``models.attention.invariant``) on a mesh: each device
computes its own queries with the one-device code, so a query's result is the one-device
result (``ModelConfig.numerics = "invariant"``, ``models.invariant.on_shards``).

* Rows split over the batch axes (``data`` / ``fsdp`` / ``expert``): attention is per
  row, so each device runs the one-device attention on its rows, with no communication.
* A row's tokens split over ``context`` (the trainer's packed forward, tokens in
  ``models.context``'s load-balanced order): as ``models.attention.context``, each device
  all-gathers the row's keys, values, positions and segment ids over ``context`` and
  attends its own queries against the whole row, here with the invariant blockwise
  attention: the key at position ``x`` of a query's sequence is found through the row's
  tokens sorted by (segment id, position), which is the packed layout (each sequence's
  positions ``0, 1, ...`` contiguous) whatever order the tokens sit in, so every query reads
  the same key blocks at the same absolute positions, combined in the same order, as on
  one device. The backward pass is ``"xla_chunked"``'s on the gathered keys and values (as
  one device's); the all-gather's transpose reduce-scatters their gradients.

Memory (context): per layer, a device holds its rows' whole keys and values, ``2 S K D``
elements per row of ``S`` tokens (``K`` KV heads of ``D``), and two int32 ``[S]`` tables
(the sorted order and its inverse), live for one layer (recomputed in the backward
under remat): what ``models.attention.context`` holds, plus ``8 S`` bytes per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from models.attention import invariant
from models.attention.xla import chunked_attention
from models.invariant import on_shards, shard_axes
from models.mesh import CONTEXT_AXIS, free_axes


def self_attention(q, k, v, positions, segment_ids, *, scale: float) -> jax.Array:
    """``models.attention.invariant.self_attention`` of packed rows under the mesh in
    context (rows over the batch axes, a row's tokens over ``context``; any token order
    under ``context``), the same bits per query as on one device.

    Args:
      q: ``[B, S, N, D]``; k, v: ``[B, S, K, D]``; positions, segment_ids: int ``[B, S]``
        (each non-zero segment's positions ``0, 1, ...``, once each).
      scale: logit scale.

    Returns:
      ``[B, S, N, D]`` in ``v``'s dtype (0 on padding queries).

    Raises:
      ValueError: (``jax.shard_map``) rows or tokens that do not split over the mesh.
    """
    axes = shard_axes(split_tokens=True)
    if axes is None or axes[1] is None:
        return on_shards(functools.partial(invariant.self_attention, scale=scale),
                         q, k, v, positions, segment_ids)
    mesh = jax.sharding.get_abstract_mesh()
    names = set(free_axes(mesh))

    def body(q, k, v, pos, seg):
        gather = functools.partial(lax.all_gather, axis_name=CONTEXT_AXIS, axis=1,
                                   tiled=True)
        index = lax.axis_index(CONTEXT_AXIS) * q.shape[1] + jnp.arange(q.shape[1])
        return _gathered(q, gather(k), gather(v), pos, seg, gather(pos), gather(seg),
                         index.astype(jnp.int32), float(scale))

    heads, tokens = P(axes[0], CONTEXT_AXIS, None, None), P(axes[0], CONTEXT_AXIS)
    return jax.shard_map(body, mesh=mesh, in_specs=(heads,) * 3 + (tokens,) * 2,
                         out_specs=heads, axis_names=names, check_vma=False)(
        q, k, v, positions, segment_ids)


def cache_attention(q, k, v, positions, segment_ids, kv_positions, kv_segment_ids, *,
                    scale: float) -> jax.Array:
    """``models.attention.invariant.cache_attention`` with each device on its own rows (the
    dense ``KVCache`` is split along the batch): the same arguments and result."""
    return on_shards(functools.partial(invariant.cache_attention, scale=scale),
                     q, k, v, positions, segment_ids, kv_positions, kv_segment_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _gathered(q, k, v, positions, segment_ids, kv_positions, kv_segment_ids, index, scale):
    """The local queries ``q`` ``[B, T, N, D]`` (at ``index`` int32 ``[T]`` of the gathered
    row) against the whole gathered row ``k``, ``v`` ``[B, S, K, D]``."""
    return _gathered_forward(q, k, v, positions, segment_ids, kv_positions, kv_segment_ids,
                             index, scale)


def _gathered_forward(q, k, v, positions, segment_ids, kv_positions, kv_segment_ids, index,
                      scale):
    b, t, n, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    # the row's tokens sorted by (segment, position), padding last: a sequence's key at
    # position x sits at sorted index (its first token's) + x
    segment = jnp.where(kv_segment_ids > 0, kv_segment_ids, jnp.iinfo(jnp.int32).max)
    order = jnp.lexsort((kv_positions, segment), axis=-1).astype(jnp.int32)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    rank = jnp.zeros((b, s), jnp.int32).at[rows, order].set(
        jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))
    start = rank[:, index] - positions.astype(jnp.int32)  # [B, T] sorted index of slot 0
    flat_k, flat_v = k.reshape(b * s, kv_heads, d), v.reshape(b * s, kv_heads, d)
    row_of = jnp.broadcast_to(rows, (b, t)).reshape(-1)

    def fetch(ctx, x):
        row_t, start_t = ctx
        slot = order[row_t[:, None], jnp.clip(start_t[:, None] + x, 0, s - 1)]
        idx = row_t[:, None] * s + slot
        return jnp.take(flat_k, idx, axis=0), jnp.take(flat_v, idx, axis=0)

    out = invariant._attend(invariant._grouped(q, kv_heads), positions.reshape(-1),
                            segment_ids.reshape(-1) != 0, (row_of, start.reshape(-1)),
                            fetch, invariant._blocks(s), scale, v.dtype)
    return out.reshape(b, t, n, d)


def _gathered_fwd(q, k, v, positions, segment_ids, kv_positions, kv_segment_ids, index,
                  scale):
    out = _gathered_forward(q, k, v, positions, segment_ids, kv_positions, kv_segment_ids,
                            index, scale)
    return out, (q, k, v, positions, segment_ids, kv_positions, kv_segment_ids)


def _gathered_bwd(scale, res, dout):
    q, k, v, positions, segment_ids, kv_positions, kv_segment_ids = res

    def chunked(q, k, v):
        return chunked_attention(q, k, v, positions, segment_ids, kv_positions,
                                 kv_segment_ids, scale=scale)

    _, vjp = jax.vjp(chunked, q, k, v)
    return (*vjp(dout), None, None, None, None, None)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
