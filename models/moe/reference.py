"""Dropless experts on one device: the MoE block's path without a mesh, and the reference
the expert-parallel paths (``models.moe.api``) are tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.moe.experts import combine, expert_ffn, route_valid, token_chunks


def dropless_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array,
                     up: jax.Array, down: jax.Array, token_mask: jax.Array | None = None,
                     token_chunk: int | None = None) -> jax.Array:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for every real token, no drops.

    The ``T * k`` (token, expert) pairs are sorted by expert id; each SwiGLU projection is
    a ``ragged_dot`` whose groups are the experts' contiguous runs; results are unsorted
    and combined in float32. The pairs of padding tokens (``token_mask`` false) sort
    after every group: ``ragged_dot`` gives them zeros (a grouped implementation, as on
    TPU / GPU, skips them; XLA:CPU's dense lowering multiplies and masks them), so a
    padding token's output is exactly 0 and its rows get no gradient. (All experts on
    this device; ``models.moe.api.routed_experts`` spreads them over a mesh.)

    Args:
      x: ``[T, H]`` compute dtype.
      experts: int32 ``[T, k]`` expert ids in ``[0, E)``.
      weights: float32 ``[T, k]`` combine weights.
      gate, up: ``[E, H, I]``; down: ``[E, I, H]``; same dtype as ``x``.
      token_mask: bool ``[T]``: the tokens to compute (False: padding, output 0); None:
        all.
      token_chunk: None (all tokens at once) or tokens per chunk
        (``ModelConfig.moe_token_chunk``): the chunks run one after another, each
        rematerialised in the backward (``models.moe.experts.token_chunks``), so the sort,
        the ``[t * k, H]`` rows and the expert activations are one chunk's; same result.

    Returns:
      ``[T, H]`` in the dtype of ``x``.
    """
    if token_chunk is not None:
        mask = jnp.ones(x.shape[:1], bool) if token_mask is None else token_mask
        return token_chunks(lambda *a: dropless_experts(*a[:3], gate, up, down, a[3]),
                            token_chunk, x, experts, weights, mask)
    num_tokens, top_k = experts.shape
    flat, valid = route_valid(experts, token_mask, gate.shape[0])
    flat = flat.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    out = expert_ffn(x[order // top_k], group_sizes, gate, up, down)
    out = out[jnp.argsort(order)].reshape(num_tokens, top_k, -1)
    return combine(out, jnp.where(valid, weights, 0.0), x.dtype).astype(x.dtype)
