"""``"dense"``: attention from a materialised mask and scores (the test reference, and
the one-token decode step).

The mask is data, per token: a query reads a key iff both are in the same non-zero
segment and the key's position is not after the query's. ``dense_attention`` builds that
mask and the scores as whole ``[T, S]`` arrays (with ``T = 1`` when decoding one token,
``[1, S]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(q_positions: jax.Array, q_segment_ids: jax.Array, kv_positions: jax.Array,
                   kv_segment_ids: jax.Array) -> jax.Array:
    """bool ``[B, T, S]``: query ``t`` may read key ``s``.

    True iff ``q_segment_ids[t] == kv_segment_ids[s] != 0`` and
    ``kv_positions[s] <= q_positions[t]`` (causal within the segment; positions must
    increase within a segment). Segment id 0 (padding, empty cache slots) reads and is
    read by nothing.

    Args:
      q_positions, q_segment_ids: int ``[B, T]``.
      kv_positions, kv_segment_ids: int ``[B, S]``.
    """
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    return same & causal & (q_segment_ids[:, :, None] != 0)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                    q_segment_ids: jax.Array, kv_positions: jax.Array,
                    kv_segment_ids: jax.Array, *, scale: float) -> jax.Array:
    """Softmax attention with grouped KV heads from a materialised ``[B, T, S]`` mask and
    float32 ``[B, K, G, T, S]`` scores (memory quadratic in the length: the reference).

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]`` with ``N % K == 0`` (query head ``n``
        reads KV head ``n // (N // K)``); all in the compute dtype.
      q_positions, q_segment_ids: int ``[B, T]``; kv_positions, kv_segment_ids: int
        ``[B, S]`` (see ``attention_mask``).
      scale: multiplies the logits (``D ** -0.5``).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``. A query with no readable key (padding) gets
      0, decided by the mask; a query that reads a NaN key or value gets NaN.
    """
    mask = attention_mask(q_positions, q_segment_ids, kv_positions, kv_segment_ids)
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, None, None], logits * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    seen = mask.any(-1)[:, :, None, None]
    return jnp.where(seen, out.reshape(b, t, n, d), 0.0).astype(v.dtype)
