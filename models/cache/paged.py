"""``PagedKVCache``: keys and values in a pool of pages for one-token decode steps, and
what the pool's layout needs: its writes, its split over the mesh's batch axes
(``per_shard``, ``along_pages``). The decode attention over it is
``models.attention.paged``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.mesh import BATCH_AXES, free_axes


class PagedKVCache(NamedTuple):
    """A paged KV cache for one-token decode steps (a pytree; pass it through ``jit``).

    Keys and values live in a pool of pages of ``S`` slots; row ``r``'s slot ``s`` is slot
    ``s % S`` of page ``block_tables[r, s // S]``. Slot ``s`` holds the token at position
    ``s`` (prompts start at slot 0), so rows may share the pages of a common prompt and hold
    only the pages they have written (``models.generate.compact``). Under a mesh the pool
    is split along its page axis over the batch axes and each row's page ids are local to
    its shard (``models.attention.paged``).

    Attributes:
      keys, values: one ``[P, K, S, D]`` array per layer, compute dtype, post-RoPE keys (a
        page's slots of one head contiguous: the layout the block gathers of the attention
        read, which the decode step's write keeps, so the compiler updates the pool in
        place).
      block_tables: int32 ``[R, M]``: the pages of each row's slots ``[0, M S)``.
      slots: int32 ``[R]``: the slot the new token is written at (= its position); the
        token then attends to slots ``[0, slots]``. -1: the row writes and reads nothing
        (finished or padding).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    block_tables: jax.Array
    slots: jax.Array

    def begin(self, positions: jax.Array, segment_ids: jax.Array
              ) -> tuple[PagedKVCache, None]:
        """``(cache, None)`` before a forward of the new tokens ``[R, 1]`` (their slots
        are ``slots``; nothing to write before the layers, no overflow to flag).

        Raises:
          ValueError: more than one token per row.
        """
        if positions.shape[1] != 1:
            raise ValueError(f"a paged KV cache decodes one token per row, got "
                             f"{positions.shape[1]}")
        return self, None

    def layer(self, i: int) -> PagedLayerKV:
        """What layer ``i`` reads and writes (``paged_view``)."""
        return paged_view(self, i)

    def end(self, keys: tuple[jax.Array, ...], values: tuple[jax.Array, ...],
            num_new: int) -> PagedKVCache:
        """The cache after the forward: each layer's written pools (the slots are the
        engine's to move)."""
        del num_new
        return self._replace(keys=tuple(keys), values=tuple(values))


class PagedLayerKV(NamedTuple):
    """The view of a ``PagedKVCache`` one attention layer reads and writes."""

    keys: jax.Array
    values: jax.Array
    block_tables: jax.Array
    slots: jax.Array

    def write(self, keys: jax.Array, values: jax.Array) -> PagedLayerKV:
        """The view with each row's new key and value ``[R, K, D]`` written at its slot
        (``write_pages``)."""
        kp, vp = write_pages(self.keys, self.values, self.block_tables, self.slots,
                             keys, values)
        return self._replace(keys=kp, values=vp)

    def attend(self, q, k, v, attention, positions, segment_ids):
        """``(out [R, 1, N, D], view)``: the one new token of each row (``k`` / ``v``
        ``[R, 1, K, D]``) written, then ``attention.over_pages(q [R, N, D], view)`` (a
        row's slot is its position; ``positions`` / ``segment_ids`` are not read)."""
        del positions, segment_ids
        kv = self.write(k[:, 0], v[:, 0])
        return attention.over_pages(q[:, 0], kv)[:, None], kv


def init_pages(cfg: ModelConfig, pages: int, page_size: int, dtype=None
               ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """``(keys, values)``: an empty pool of ``pages`` pages of ``page_size`` slots per layer
    (zeros ``[pages, K, page_size, D]``, ``dtype`` default ``cfg.dtype``)."""
    dtype = cfg.dtype if dtype is None else dtype
    shape = (pages, cfg.num_key_value_heads, page_size, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
    return zeros, zeros


def paged_view(cache: PagedKVCache, layer: int) -> PagedLayerKV:
    """What layer ``layer`` reads: its pages plus the shared block tables and slots."""
    return PagedLayerKV(cache.keys[layer], cache.values[layer], cache.block_tables,
                        cache.slots)


def _split_axes() -> tuple[jax.sharding.AbstractMesh, tuple[str, ...]]:
    """The mesh in context and its batch axes of size > 1 not already manual."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return mesh, ()
    free = free_axes(mesh)
    return mesh, tuple(a for a in BATCH_AXES if free.get(a, 1) > 1)


def per_shard(fn: Callable, pools: tuple, rows: tuple, out_pools: int, out_rows: int):
    """``fn(*pools, *rows)`` with the pools ``[P, K, S, D]`` split along their page axis
    and the row arrays along their leading axis over the mesh's batch axes
    (``jax.shard_map``, manual over those axes only); a plain call without them.
    ``fn`` returns ``out_pools`` pools then ``out_rows`` row arrays (one array: not in a
    tuple).

    Raises:
      ValueError: the pages or rows do not split evenly over those axes (named).
    """
    mesh, axes = _split_axes()
    if not axes:
        return fn(*pools, *rows)
    shards = math.prod(dict(zip(mesh.axis_names, mesh.axis_sizes))[a] for a in axes)
    if pools[0].shape[0] % shards or (rows and rows[0].shape[0] % shards):
        raise ValueError(f"a paged cache of {pools[0].shape[0]} pages and {rows[0].shape[0]}"
                         f" rows does not split over the batch axes {axes} ({shards} shards)")
    pool_spec = row_spec = P(axes)
    out_specs = (pool_spec,) * out_pools + (row_spec,) * out_rows
    return jax.shard_map(lambda *a: fn(*a), mesh=mesh,
                         in_specs=(pool_spec,) * len(pools) + (row_spec,) * len(rows),
                         out_specs=out_specs[0] if len(out_specs) == 1 else out_specs,
                         axis_names=set(axes), check_vma=False)(*pools, *rows)


def write_pages(k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                slots: jax.Array, keys: jax.Array, values: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """The pools with each row's new key and value written at its slot.

    Args:
      k_pages, v_pages: ``[P, K, S, D]``.
      tables: int32 ``[R, M]`` block tables; slots: int32 ``[R]`` (-1: no write).
      keys, values: ``[R, K, D]`` the new token's.

    Returns:
      ``(k_pages, v_pages)`` (rows with ``slots = -1`` write nothing).
    """
    def write(kp, vp, tables, slots, k, v):
        pages, size = kp.shape[0], kp.shape[2]
        row = jnp.arange(tables.shape[0])
        page = tables[row, jnp.clip(slots, 0) // size]
        page = jnp.where(slots >= 0, page, pages)  # out of range: dropped
        off = jnp.clip(slots, 0) % size
        # one D-vector per (row, head): a scatter the pool's [P, K, S, D] layout serves in
        # place (a [K, D] block per row would want the slots outside the heads)
        head = jnp.arange(kp.shape[1])[None, :]
        at = (page[:, None], head, off[:, None])
        return (kp.at[at].set(k.astype(kp.dtype), mode="drop"),
                vp.at[at].set(v.astype(vp.dtype), mode="drop"))

    return per_shard(write, (k_pages, v_pages), (tables, slots, keys, values), 2, 0)


def along_pages(tree):
    """``tree`` with every ``[P, K, S, D]`` pool constrained to be split along its page
    axis over the mesh's batch axes; unchanged without them."""
    _, axes = _split_axes()
    if not axes:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P(axes)), tree)
