"""Next-token labels and the keep mask, both aware of packed rows (``segment_ids``).

Conventions (as in MaxText and Tunix packing):

* arrays are ``[..., S]`` with the sequence on the last axis;
* position ``i`` predicts token ``i + 1``: labels and every per-token mask or weight given to
  these functions are already *after* that shift (aligned with the position that produces
  the logits);
* ``segment_ids`` give each packed sequence its own positive id; ``0`` marks padding;
* the last position of a segment (and of a row) has no next token inside its segment, so it
  has no label and is never kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_same_shape(named: dict[str, jax.Array]) -> tuple[int, ...]:
    shapes = {name: tuple(jnp.shape(x)) for name, x in named.items() if x is not None}
    if not shapes:
        raise ValueError("at least one array is required")
    first_name, first_shape = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first_shape:
            raise ValueError(
                f"shape mismatch: {first_name} has shape {first_shape} but {name} has shape {shape}"
            )
    if len(first_shape) == 0:
        raise ValueError(f"{first_name} must have a sequence axis, got a scalar")
    return first_shape


def has_next_token(shape: tuple[int, ...], segment_ids: jax.Array | None = None) -> jax.Array:
    """Whether position ``i`` has a next token in its own segment.

    Args:
      shape: ``[..., S]``.
      segment_ids: optional int ``[..., S]``; ``0`` is padding.

    Returns:
      bool ``[..., S]``: false at the last position of every segment and row, and on padding.
    """
    seq_len = shape[-1]
    not_last = jnp.arange(seq_len) < seq_len - 1
    out = jnp.broadcast_to(not_last, shape)
    if segment_ids is not None:
        seg = jnp.asarray(segment_ids)
        nxt = jnp.concatenate([seg[..., 1:], jnp.zeros_like(seg[..., :1])], axis=-1)
        out = out & (seg == nxt) & (seg != 0)
    return out


def next_token_labels(
    tokens: jax.Array, segment_ids: jax.Array | None = None, ignore_index: int = -100
) -> tuple[jax.Array, jax.Array]:
    """Shift-left labels that never cross a segment boundary.

    Args:
      tokens: int ``[..., S]`` token ids.
      segment_ids: optional int ``[..., S]``, ``0`` = padding (packed rows).
      ignore_index: the label written where there is no next token in the same segment.

    Returns:
      ``(labels, valid)``: ``labels`` int ``[..., S]`` (dtype of ``tokens``) with
      ``labels[..., i] = tokens[..., i + 1]`` where ``valid[..., i]``, else
      ``ignore_index``; ``valid`` bool ``[..., S]``.

    Raises:
      ValueError: ``segment_ids`` shape differs from ``tokens``; ``tokens`` not integer.
    """
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer, got dtype {tokens.dtype}")
    shape = _check_same_shape({"tokens": tokens, "segment_ids": segment_ids})
    valid = has_next_token(shape, segment_ids)
    shifted = jnp.concatenate([tokens[..., 1:], tokens[..., :1]], axis=-1)
    labels = jnp.where(valid, shifted, jnp.asarray(ignore_index, tokens.dtype))
    return labels, valid


def keep_mask(
    *,
    loss_mask: jax.Array | None = None,
    ce_weights: jax.Array | None = None,
    kl_weights: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Which positions any loss component reads: the tokens the head must compute.

    ``keep = (loss_mask != 0 | ce_weights != 0 | kl_weights != 0) & has_next_token``, all
    taken after the next-token shift (position ``i`` scores token ``i + 1``). The last
    position of each packed segment and of each row, and padding (segment id 0), are never
    kept, whatever the masks say: they have no label.

    Args:
      loss_mask: ``[..., S]`` bool or number: the policy-gradient (RL) loss reads it.
      ce_weights: ``[..., S]`` number: SFT / cross-entropy weights.
      kl_weights: ``[..., S]`` number: reference-KL weights.
      segment_ids: optional int ``[..., S]``, ``0`` = padding.

    Returns:
      bool ``[..., S]``.

    Raises:
      ValueError: no mask given, or shapes differ (both shapes named).
    """
    masks = {"loss_mask": loss_mask, "ce_weights": ce_weights, "kl_weights": kl_weights}
    if all(m is None for m in masks.values()):
        raise ValueError("keep_mask needs at least one of loss_mask, ce_weights, kl_weights")
    shape = _check_same_shape({**masks, "segment_ids": segment_ids})
    keep = jnp.zeros(shape, bool)
    for m in masks.values():
        if m is not None:
            keep = keep | (jnp.asarray(m) != 0)
    return keep & has_next_token(shape, segment_ids)
