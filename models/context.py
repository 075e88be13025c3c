"""Context parallelism: each sequence's tokens split over the ``context`` mesh axis (the
layout; the attention is ``models.attention.context``).

With ``C > 1`` devices on ``models.mesh.CONTEXT_AXIS``, a packed batch ``[B, S]`` is held
as ``B`` rows over the batch axes and, within a row, ``S / C`` tokens per device:

* **Causal load balance** (``balance`` / ``unbalance``). Under a causal mask the last
  tokens of a row read the most keys, so contiguous shards would give the last device
  the most work (the blockwise attention skips tiles whose mask is empty). Each row is
  cut into ``2C`` chunks and device ``c`` holds chunks ``c`` and ``2C - 1 - c``, one early
  and one late (the order of MaxText's ``context_parallel_load_balance`` and of
  Megatron-LM's context parallelism). ``models.Transformer.token_logprobs`` reorders the
  token ids, positions and segment ids (ints) before the decoder and puts the head's
  float32 outputs back after it; hidden states are never moved. Nothing else reads the
  order: attention masks by position and segment id, not by index, and every other layer
  is per token.
* **Attention** gathers each layer's keys and values over ``context``
  (``models.attention.context``).
* **Token-major order** (``to_token_major`` / ``from_token_major``): the MoE dispatch and
  the head run in ``shard_map`` over a flat token axis, so a device's tokens must be
  contiguous there: ``[B, S]`` is viewed as ``[B, C, S/C]`` and transposed to
  ``[C, B, S/C]`` (local: each device holds one ``c``), whose leading ``C * B`` rows split
  over ``token_axes(mesh)`` = ``("context", *batch axes)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models.mesh import BATCH_AXES, CONTEXT_AXIS, axis_size, present


def context_size(mesh) -> int:
    """Devices on the ``context`` axis of ``mesh`` (1: none, or no mesh)."""
    return 1 if mesh is None or mesh.empty else axis_size(mesh, CONTEXT_AXIS)


def token_axes(mesh) -> tuple[str, ...]:
    """The mesh axes a token-major flat token axis splits over: ``("context", *batch
    axes)`` with context parallelism, else the batch axes present."""
    rows = present(mesh, BATCH_AXES)
    return (CONTEXT_AXIS, *rows) if context_size(mesh) > 1 else rows


def balance_order(length: int, context: int) -> np.ndarray:
    """int ``[length]``: the token indices of a row in load-balanced order (see the module
    docstring): ``2 * context`` chunks, device ``c`` holding chunks ``c`` and
    ``2 * context - 1 - c``.

    Raises:
      ValueError: ``length`` not a multiple of ``2 * context`` (both named).
    """
    parts = 2 * context
    if length % parts:
        raise ValueError(f"a row of {length} tokens does not split into the {parts} chunks "
                         f"of context={context} (2 per device); use a row length that is a "
                         f"multiple of {parts}")
    chunks = np.arange(length).reshape(parts, length // parts)
    order = [chunks[i] for c in range(context) for i in (c, parts - 1 - c)]
    return np.concatenate(order)


def balance(x, context: int):
    """``x [B, S, ...]`` with each row's tokens in ``balance_order`` (``context = 1``:
    ``x`` itself)."""
    if context == 1:
        return x
    return jnp.take(x, jnp.asarray(balance_order(x.shape[1], context)), axis=1)


def unbalance(x, context: int):
    """The inverse of ``balance``: ``x [B, S, ...]`` back in token order."""
    if context == 1:
        return x
    return jnp.take(x, jnp.asarray(np.argsort(balance_order(x.shape[1], context))), axis=1)


def to_token_major(x, context: int):
    """``x [B, S, ...]`` as ``[C * B, S / C, ...]`` (row ``c * B + b`` holds row ``b``'s
    ``c``-th shard of tokens); ``context = 1``: ``x`` itself."""
    if context == 1:
        return x
    b, s = x.shape[:2]
    x = x.reshape(b, context, s // context, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(context * b, s // context, *x.shape[3:])


def from_token_major(x, context: int):
    """The inverse of ``to_token_major``: ``[C * B, S / C, ...]`` back to ``[B, S, ...]``."""
    if context == 1:
        return x
    cb, t = x.shape[:2]
    x = x.reshape(context, cb // context, t, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(cb // context, context * t, *x.shape[3:])


def constrain_tokens(x, mesh):
    """``x [B, S, ...]`` constrained to rows over the batch axes and tokens over
    ``context`` (under a context-parallel mesh; unchanged otherwise)."""
    if context_size(mesh) == 1:
        return x
    spec = P(present(mesh, BATCH_AXES) or None, CONTEXT_AXIS)
    return jax.lax.with_sharding_constraint(x, spec)
