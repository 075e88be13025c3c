"""Attention under context parallelism (``models.context``): a row's tokens split over the
``context`` mesh axis, in any order.

Inside ``jax.shard_map``, each device all-gathers the keys, values, positions and segment
ids of its rows over ``context`` and runs the blockwise XLA attention
(``models.attention.xla.chunked_attention``, which skips tiles whose mask is empty) of its
own queries against the whole row. Why gather and not a ring: the gathered ``[B, S, K, D]``
keys and values of one layer are ``2 S K D`` elements per row; with grouped-query attention
(Qwen3-30B-A3B: ``K D = 512`` against a hidden size of 2048) that is a quarter of the row's
hidden-state bytes, live for one layer at a time (with remat, recomputed in the backward).
A ring (``C - 1`` ``ppermute`` rounds per layer, each overlapping a block of work) would
keep ``2 / C`` of it at the price of a hand-written backward and ``C - 1`` dependent
rounds. All-gather is MaxText's choice for its ``context`` axis; its backward is a
reduce-scatter (JAX's transpose of ``all_gather``).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxhead.dispatch import KernelUnsupported
from models.attention.xla import chunked_attention
from models.mesh import BATCH_AXES, CONTEXT_AXIS, axis_size, free_axes


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                      segment_ids: jax.Array, *, scale: float) -> jax.Array:
    """Causal grouped-query attention of packed rows whose tokens are split over
    ``context`` (the mesh in context), as ``models.attention.api.self_attention``.

    Args:
      q: ``[B, S, N, D]``; k, v: ``[B, S, K, D]``; positions, segment_ids: int ``[B, S]``;
        all in any token order (the mask is by position and segment id).
      scale: logit scale.

    Returns:
      ``[B, S, N, D]`` in the dtype of ``v``, split like ``q``.

    Raises:
      KernelUnsupported: the rows, the tokens or the KV heads do not split over the mesh
        (rows over the batch axes, tokens over ``context``, KV heads over ``tensor``).
    """
    mesh = jax.sharding.get_abstract_mesh()
    free = free_axes(mesh)
    rows = tuple(a for a in BATCH_AXES if free.get(a, 1) > 1) or None
    heads = "tensor" if free.get("tensor", 1) > 1 else None
    row_shards = axis_size(mesh, rows or ())
    context, head_shards = free[CONTEXT_AXIS], free.get("tensor", 1)
    if q.shape[0] % row_shards or q.shape[1] % context or k.shape[2] % head_shards:
        raise KernelUnsupported(
            f"rows ({q.shape[0]}), tokens ({q.shape[1]}) and KV heads ({k.shape[2]}) must "
            f"split over rows {rows}, {CONTEXT_AXIS}={context} and heads {heads}")

    def body(q, k, v, pos, seg):
        gather = jax.lax.all_gather
        k, v, kv_pos, kv_seg = (gather(x, CONTEXT_AXIS, axis=1, tiled=True)
                                for x in (k, v, pos, seg))
        return chunked_attention(q, k, v, pos, seg, kv_pos, kv_seg, scale=scale)

    heads_spec, tokens_spec = P(rows, CONTEXT_AXIS, heads, None), P(rows, CONTEXT_AXIS)
    run = jax.shard_map(body, mesh=mesh,
                        in_specs=(heads_spec,) * 3 + (tokens_spec,) * 2,
                        out_specs=heads_spec, axis_names=set(free), check_vma=False)
    return run(q, k, v, positions, segment_ids)
