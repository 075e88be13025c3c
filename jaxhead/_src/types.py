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
    """Result of a sampling call (``jaxhead.sample``), ``[B]`` each.

    Attributes:
      tokens: int32 sampled ids, each ``< num_valid``.
      logprobs: float32 ``log p(token)`` under the distribution the token was drawn from:
        ``softmax(z / tau)`` (``tau = 1`` for greedy) renormalised over the support
        ``{v : l_v >= min_logit}``, as ``jaxhead.token_logprobs(..., min_logit=...)``
        computes it.
      min_logit: float32 threshold ``tau`` of the support on the tempered logits
        ``l = z / tau`` (ties included); ``-inf`` when the draw was not truncated.
      logmass: float32 ``log`` of the untruncated distribution's mass on the support
        (``<= 0``; 0 when untruncated): ``logprobs + logmass`` is the token's log-prob
        under the whole softmax.
    """

    tokens: jax.Array
    logprobs: jax.Array
    min_logit: jax.Array
    logmass: jax.Array
