"""Next-token labels and the keep mask, both aware of packed rows (``segment_ids``).

Conventions (as in MaxText and Tunix packing):

* arrays are ``[..., S]`` with the sequence on the last axis;
* position ``i`` predicts token ``i + 1``: labels and the head's outputs are aligned with the
  position that produces the logits ("predictions"). A mask aligned with the tokens
  themselves (``completion_mask[i]``: token ``i`` is a completion token, the usual layout in
  JAX and PyTorch RL stacks) is given to ``keep_mask`` with ``aligned_to="tokens"`` and
  shifted there, within segments;
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


ALIGNMENTS = ("predictions", "tokens")


def shift_to_predictions(mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """A token-aligned mask (``mask[..., i]``: token ``i``) as the prediction-aligned one
    (``out[..., i]``: the position that predicts token ``i + 1``, in the same segment).

    Args:
      mask: ``[..., S]`` bool or number, aligned with the tokens.
      segment_ids: optional int ``[..., S]``, ``0`` = padding.

    Returns:
      ``[..., S]`` of ``mask``'s dtype: ``mask[..., i + 1]`` where position ``i`` has a next
      token in its own segment (``has_next_token``), else 0.
    """
    mask = jnp.asarray(mask)
    shape = _check_same_shape({"mask": mask, "segment_ids": segment_ids})
    shifted = jnp.concatenate([mask[..., 1:], jnp.zeros_like(mask[..., :1])], axis=-1)
    return jnp.where(has_next_token(shape, segment_ids), shifted, jnp.zeros((), mask.dtype))


def keep_mask(
    *,
    loss_mask: jax.Array | None = None,
    ce_weights: jax.Array | None = None,
    kl_weights: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    aligned_to: str,
) -> jax.Array:
    """Which positions any loss component reads: the positions the head must compute.

    ``keep = (loss_mask != 0 | ce_weights != 0 | kl_weights != 0) & has_next_token``, on
    prediction-aligned masks (position ``i`` scores token ``i + 1``). The last position of
    each packed segment and of each row, and padding (segment id 0), are never kept: they
    have no label.

    Args:
      loss_mask: ``[..., S]`` bool or number: the policy-gradient (RL) loss reads it.
      ce_weights: ``[..., S]`` number: SFT / cross-entropy weights.
      kl_weights: ``[..., S]`` number: reference-KL weights.
      segment_ids: optional int ``[..., S]``, ``0`` = padding.
      aligned_to: what the given masks index, required so that neither layout is taken for
        the other silently: ``"tokens"`` (``mask[i]``: token ``i`` is read, e.g. a
        completion mask; shifted here with ``shift_to_predictions``) or ``"predictions"``
        (``mask[i]``: the prediction of token ``i + 1`` is read, already shifted).

    Returns:
      bool ``[..., S]``, aligned with the predictions (and with ``next_token_labels``).

    Raises:
      ValueError: no mask given, shapes that differ (both shapes named), or an unknown
        ``aligned_to``.
    """
    if aligned_to not in ALIGNMENTS:
        raise ValueError(f"aligned_to must be one of {ALIGNMENTS}, got {aligned_to!r}")
    masks = {"loss_mask": loss_mask, "ce_weights": ce_weights, "kl_weights": kl_weights}
    if all(m is None for m in masks.values()):
        raise ValueError("keep_mask needs at least one of loss_mask, ce_weights, kl_weights")
    shape = _check_same_shape({**masks, "segment_ids": segment_ids})
    keep = jnp.zeros(shape, bool)
    for m in masks.values():
        if m is not None:
            keep = keep | (jnp.asarray(m) != 0)
    if aligned_to == "tokens":
        return shift_to_predictions(keep, segment_ids)
    return keep & has_next_token(shape, segment_ids)
