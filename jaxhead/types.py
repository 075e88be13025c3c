"""Result type of the head."""

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
