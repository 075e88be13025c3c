"""Compaction of kept tokens into a static padded bucket, and expansion back (DESIGN.md 2, 5).

Indices of the kept rows come from ``jnp.nonzero(keep, size=bucket, fill_value=N)``: the
padding slots point one past the end, so gathering them yields the fill value (zero
hidden rows, which are finite whatever the skipped tokens hold) and scattering them back
drops them. Gradients follow the same rule: the gather's transpose is a scatter-add that
drops the padding slots, so skipped positions receive exactly zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kept_indices(keep: jax.Array, size: int) -> jax.Array:
    """int32 ``[size]``: positions of the first ``size`` true entries of ``keep [N]``,
    in order, then ``N`` (out of range) for the unused slots."""
    n = keep.shape[0]
    (idx,) = jnp.nonzero(keep, size=size, fill_value=n)
    return idx.astype(jnp.int32)


def gather_rows(x: jax.Array, idx: jax.Array, fill) -> jax.Array:
    """``x[idx]`` along axis 0, with ``fill`` where ``idx`` is out of range."""
    return x.at[idx].get(mode="fill", fill_value=fill)


def scatter_rows(values: jax.Array, idx: jax.Array, num_rows: int) -> jax.Array:
    """Inverse of ``gather_rows``: a zero ``[num_rows, ...]`` array with ``values`` written at
    ``idx``; out-of-range slots are dropped."""
    out = jnp.zeros((num_rows,) + values.shape[1:], values.dtype)
    return out.at[idx].set(values, mode="drop")


def overflow_mask(keep: jax.Array, capacity: int) -> jax.Array:
    """bool ``[N]``: kept positions that do not fit in the first ``capacity`` slots."""
    return keep & (jnp.cumsum(keep, dtype=jnp.int32) > capacity)
