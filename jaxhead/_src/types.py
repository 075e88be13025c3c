"""Result types of the head and the sampler."""

from __future__ import annotations

from typing import NamedTuple

import jax


class HeadOutput(NamedTuple):
    """Per-token results of the LM head.

    Attributes:
      logprobs: float32 ``[...]``: ``log p(label)`` under ``softmax(z / temperature)``;
        exactly 0 at positions that are not kept.
      entropy: float32 ``[...]`` in nats, exactly 0 at positions not kept; None when
        ``with_entropy=False``.
    """

    logprobs: jax.Array
    entropy: jax.Array | None


class Sample(NamedTuple):
    """Result of a sampling call.

    Attributes:
      tokens: int32 ``[B]`` sampled ids, each ``< num_valid``.
      logprobs: float32 ``[B]`` ``log p(token)`` under ``softmax(z / tau)`` over all V
        columns (``tau = 1`` for greedy), as ``jaxhead.token_logprobs`` computes it.
    """

    tokens: jax.Array
    logprobs: jax.Array
