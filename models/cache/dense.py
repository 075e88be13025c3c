"""``KVCache``: a fixed-size key/value cache for prefill + one-token decode steps.

Each cache slot stores the key and value of one token (per layer) plus the token's
position and segment id. Attention reads every slot and masks by segment id and position
(see ``models.attention.reference.attention_mask``), so rows may hold prompts of different lengths
(right-padded with segment id 0) and slots not yet written (segment id 0) are never read.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.config import ModelConfig


class KVCache(NamedTuple):
    """Decoder KV cache (a pytree; pass it through ``jit``).

    Attributes:
      keys, values: one ``[B, L, K, D]`` array per layer, compute dtype (post-RoPE keys).
      positions: int32 ``[B, L]`` position of the token in each slot.
      segment_ids: int32 ``[B, L]``; 0 for padding and for slots not yet written.
      index: int32 scalar: the next slot to write (slots ``[0, index)`` are written).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    positions: jax.Array
    segment_ids: jax.Array
    index: jax.Array

    def begin(self, positions: jax.Array, segment_ids: jax.Array
              ) -> tuple[KVCache, jax.Array | None]:
        """``(cache, overflow)`` before a forward of the new tokens ``[B, T]``: their
        positions and segment ids written (``write_tokens``), and ``check_room``'s
        traced overflow flag (None when known on the host to fit).

        Raises:
          ValueError: the tokens do not fit, when that is known on the host.
        """
        overflow = check_room(self, positions.shape[1])
        return write_tokens(self, positions, segment_ids), overflow

    def layer(self, i: int) -> LayerKV:
        """What layer ``i`` reads and writes (``layer_view``)."""
        return layer_view(self, i)

    def end(self, keys: tuple[jax.Array, ...], values: tuple[jax.Array, ...],
            num_new: int) -> KVCache:
        """The cache after the forward: each layer's written keys and values, ``index``
        moved past the ``num_new`` tokens."""
        return self._replace(keys=tuple(keys), values=tuple(values),
                             index=self.index + num_new)


class LayerKV(NamedTuple):
    """The view of the cache one attention layer reads and writes.

    ``positions`` / ``segment_ids`` already include the tokens being written at
    ``index``; ``keys`` / ``values`` do not yet (the layer writes them).
    """

    keys: jax.Array
    values: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    index: jax.Array

    def write(self, keys: jax.Array, values: jax.Array) -> LayerKV:
        """The view with ``keys`` / ``values`` ``[B, T, K, D]`` written (``write_kv``)."""
        return write_kv(self, keys, values)

    def attend(self, q, k, v, attention, positions, segment_ids):
        """``(out [B, T, N, D], view)``: ``k`` / ``v`` ``[B, T, K, D]`` written, then
        ``attention.over_cache(q, view, positions, segment_ids)``
        (``models.attention.layer.Attention``: the layer knows the kernels, the view
        which of its reads applies)."""
        kv = self.write(k, v)
        return attention.over_cache(q, kv, positions, segment_ids), kv


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of ``max_len`` slots per row.

    Args:
      cfg: model config (layers, ``num_key_value_heads``, ``head_dim``).
      batch: B.
      max_len: L, the prompt length plus the number of tokens to decode.
      dtype: dtype of keys and values; default ``cfg.dtype``.

    Returns:
      ``KVCache`` of zeros with ``index = 0``.
    """
    dtype = cfg.dtype if dtype is None else dtype
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_hidden_layers))
    ids = jnp.zeros((batch, max_len), jnp.int32)
    return KVCache(zeros, zeros, ids, ids, jnp.zeros((), jnp.int32))


def check_room(cache: KVCache, num_new: int):
    """Whether ``num_new`` tokens overflow the free slots ``[index, L)`` of ``cache``.

    Raises ``ValueError`` naming the numbers when that is known on the host (``num_new >
    L``, or a concrete ``index``); otherwise returns a traced bool scalar that the decoder
    turns into NaN hidden states, since ``dynamic_update_slice`` would clamp the write
    and silently overwrite the last slots.
    """
    slots = cache.positions.shape[1]
    if num_new > slots:
        raise ValueError(f"{num_new} new tokens do not fit in a KV cache of {slots} slots")
    try:
        index = int(cache.index)
    except (jax.errors.ConcretizationTypeError, TypeError):
        return cache.index + num_new > slots
    if index + num_new > slots:
        raise ValueError(
            f"KV cache overflow: {num_new} new tokens at slot {index} need "
            f"{index + num_new} slots, the cache has {slots}; size it for the prompt plus "
            f"every decode step (init_cache max_len)"
        )
    return None


def _write_slots(buf: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """``buf`` ``[B, L, ...]`` with ``new`` ``[B, T, ...]`` at slots ``[index, index +
    T)``; a write that does not fit (``index < 0`` or ``index + T > L``) is dropped whole.

    ``lax.dynamic_update_slice`` clamps its start into range, which would move an
    overflowing write back onto valid slots; here the clamped slots get their own
    contents back instead (the update stays one in-place slice write)."""
    slots, count = buf.shape[1], new.shape[1]
    start = jnp.clip(index, 0, slots - count)
    fits = (index >= 0) & (index + count <= slots)
    old = jax.lax.dynamic_slice_in_dim(buf, start, count, axis=1)
    new = jnp.where(fits, new.astype(buf.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(buf, new, start, axis=1)


def write_tokens(cache: KVCache, positions: jax.Array, segment_ids: jax.Array) -> KVCache:
    """``cache`` with the positions and segment ids ``[B, T]`` of the new tokens written at
    slots ``[index, index + T)``; keys, values and ``index`` unchanged (each layer writes
    its keys and values, see ``write_kv``; the decoder then moves ``index`` by T).

    A write past the cache's ``L`` slots is dropped whole (never clamped onto valid slots);
    the caller checks the room first (``check_room``: an error on the host, NaN hidden
    states under ``jit``).
    """
    return cache._replace(positions=_write_slots(cache.positions, positions, cache.index),
                          segment_ids=_write_slots(cache.segment_ids, segment_ids,
                                                   cache.index))


def layer_view(cache: KVCache, layer: int) -> LayerKV:
    """What layer ``layer`` reads: its keys/values plus the shared positions/segments."""
    return LayerKV(cache.keys[layer], cache.values[layer], cache.positions,
                   cache.segment_ids, cache.index)


def write_kv(kv: LayerKV, keys: jax.Array, values: jax.Array) -> LayerKV:
    """``kv`` with ``keys`` / ``values`` ``[B, T, K, D]`` written at slots
    ``[index, index + T)`` (a write past the last slot is dropped whole, as
    ``write_tokens``')."""
    return kv._replace(keys=_write_slots(kv.keys, keys, kv.index),
                       values=_write_slots(kv.values, values, kv.index))
