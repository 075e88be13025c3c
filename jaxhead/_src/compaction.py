"""Compaction of kept tokens into a static padded bucket, and expansion back
(docs/design.md, steps 2 and 5).

``idx [B]`` lists the kept positions in order, then ``N`` (out of range) for padding
slots; ``pos [N]`` is its inverse: the slot of each kept token, or ``B`` (out of range)
for skipped tokens and for kept tokens that do not fit. Both directions are *gathers*
with a zero fill, and so are their gradients (compaction's gradient is an expansion and
vice versa): no scatter-add is ever emitted, skipped positions get exactly zero
gradient, and padding slots read zero rows, finite whatever the skipped tokens hold.
(Gathers also keep bf16 as bf16 on XLA's CPU backend, which widens scatters to float32.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kept_indices(keep: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """``(idx, pos)`` for a bool ``keep [N]`` and a bucket of ``size`` slots.

    Returns:
      ``idx`` int32 ``[size]``: positions of the first ``size`` kept tokens in order, then
      ``N``. ``pos`` int32 ``[N]``: slot of each kept token (``< size``), else ``size``.
    """
    n = keep.shape[0]
    (idx,) = jnp.nonzero(keep, size=size, fill_value=n)
    rank = jnp.cumsum(keep, dtype=jnp.int32) - 1
    pos = jnp.where(keep & (rank < size), rank, size)
    return idx.astype(jnp.int32), pos.astype(jnp.int32)


def gather_rows(x: jax.Array, idx: jax.Array, fill=0) -> jax.Array:
    """``x[idx]`` along axis 0, with ``fill`` where ``idx`` is out of range (no gradient
    rule needed: used for labels and temperatures)."""
    return jnp.asarray(x).at[idx].get(mode="fill", fill_value=fill)


@jax.custom_vjp
def compact(x: jax.Array, idx: jax.Array, pos: jax.Array) -> jax.Array:
    """Rows ``x[idx]`` (``[B, ...]``), zero rows at padding slots. Differentiable in ``x``."""
    return gather_rows(x, idx)


def _compact_fwd(x, idx, pos):
    return compact(x, idx, pos), (idx, pos)


def _compact_bwd(res, ct):
    _idx, pos = res
    return gather_rows(ct, pos), None, None


compact.defvjp(_compact_fwd, _compact_bwd)


@jax.custom_vjp
def expand(values: jax.Array, idx: jax.Array, pos: jax.Array) -> jax.Array:
    """Inverse of ``compact``: ``[N, ...]`` with ``values[pos[n]]`` at kept positions and 0
    elsewhere. Differentiable in ``values``."""
    return gather_rows(values, pos)


def _expand_fwd(values, idx, pos):
    return expand(values, idx, pos), (idx, pos)


def _expand_bwd(res, ct):
    idx, _pos = res
    return gather_rows(ct, idx), None, None


expand.defvjp(_expand_fwd, _expand_bwd)


def overflow_mask(keep: jax.Array, capacity: int) -> jax.Array:
    """bool ``[N]``: kept positions that do not fit in the first ``capacity`` slots."""
    return keep & (jnp.cumsum(keep, dtype=jnp.int32) > capacity)
