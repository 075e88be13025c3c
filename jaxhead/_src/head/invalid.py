"""Invalid kept tokens poison the gradients as well as the value.

Under ``jit`` the head cannot raise on a kept token whose label is outside ``[0, V)`` or
that does not fit in the bucket; its log-prob is NaN instead. A NaN value alone is half a
signal: the gradients of ``hidden`` and ``weight`` would stay finite (and be those of some
other computation, e.g. one that dropped the token), so a guard that checks the gradient,
such as ``optax.apply_if_finite``, would apply the update. ``nan_gradients_if`` makes both
gradients NaN whenever a call has such a token, in every implementation alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def invalid_kept(labels: jax.Array, keep: jax.Array | None, vocab_size: int, slots: int,
                 shards: int = 1) -> jax.Array:
    """bool scalar: some kept token has a label outside ``[0, vocab_size)``, or some of the
    ``shards`` equal row blocks keeps more tokens than its ``slots``.

    Args:
      labels: int ``[N]`` (or any shape whose leading axis splits into ``shards``).
      keep: bool, the labels' shape, or None (every token kept, no compaction).
      vocab_size: V. slots: the compacted rows of one shard (overflow beyond them).
      shards: token shards the leading axis is split into (the sharded head).
    """
    labels = jnp.asarray(labels)
    bad = (labels < 0) | (labels >= vocab_size)
    if keep is None:
        return jnp.any(bad)
    keep = jnp.asarray(keep)
    counts = keep.reshape(shards, -1).sum(axis=1)
    return jnp.any(bad & keep) | jnp.any(counts > slots)


@jax.custom_vjp
def _poison(x: jax.Array, bad: jax.Array) -> jax.Array:
    return x


def _poison_fwd(x, bad):
    return x, bad


def _poison_bwd(bad, g):
    return jnp.where(bad, jnp.asarray(jnp.nan, g.dtype), g), None


_poison.defvjp(_poison_fwd, _poison_bwd)


def nan_gradients_if(bad: jax.Array, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """``xs`` unchanged in value; in the backward pass each one's gradient is NaN where
    ``bad`` (a bool scalar, no gradient) is true, as is, elsewhere."""
    bad = jax.lax.stop_gradient(jnp.asarray(bad, bool))
    return tuple(_poison(x, bad) for x in xs)
