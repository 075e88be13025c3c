"""Dropless expert computation on one device: grouped SwiGLU (``ragged_dot``) and the
weighted combination of each token's top-k expert outputs. Padding tokens (a token
mask) belong to no expert group: they are not computed and their output is 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Rows x groups per ``ragged_dot`` call (see ``rows_per_chunk``).
CHUNK_ROWS_X_GROUPS = 2**17


def rows_per_chunk(num_groups: int) -> int:
    """Rows per ``ragged_dot`` call for ``num_groups`` experts: ``2**17 / num_groups``
    (at least 256), so that a backend which lowers ``ragged_dot`` densely (XLA:CPU
    materialises float32 ``[groups, rows, H]``) keeps that temporary near
    ``2**17 * H * 4`` bytes (1 GiB at H = 2048) whatever the number of rows."""
    return max(256, CHUNK_ROWS_X_GROUPS // max(num_groups, 1))


def _grouped_swiglu(xs, group_sizes, gate, up, down):
    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)

    hidden = jax.nn.silu(grouped(xs, gate).astype(xs.dtype)) * grouped(xs, up).astype(xs.dtype)
    return grouped(hidden, down)


def expert_ffn(xs: jax.Array, group_sizes: jax.Array, gate: jax.Array, up: jax.Array,
               down: jax.Array, chunk: int | None = None) -> jax.Array:
    """SwiGLU of rows already grouped by expert: ``silu(x @ gate_e) * (x @ up_e) @ down_e``.

    Rows are processed ``chunk`` at a time (``lax.map``), each chunk with the group sizes
    of its own row range, so memory does not grow with the number of groups times the
    number of rows on backends without a grouped matmul; rows are independent, so the
    result is the same as one call.

    Args:
      xs: ``[R, H]`` rows sorted by expert; rows past ``sum(group_sizes)`` belong to no
        expert and give zeros.
      group_sizes: int32 ``[E]`` rows per expert, in order.
      gate, up: ``[E, H, I]``; down: ``[E, I, H]``; same dtype as ``xs``.
      chunk: rows per call (default ``rows_per_chunk(E)``).

    Returns:
      float32 ``[R, H]`` (the last projection accumulated in float32, not yet rounded).
    """
    rows = xs.shape[0]
    chunk = rows_per_chunk(gate.shape[0]) if chunk is None else chunk
    if rows <= chunk:
        return _grouped_swiglu(xs, group_sizes, gate, up, down)
    steps = -(-rows // chunk)
    padded = jnp.pad(xs, ((0, steps * chunk - rows), (0, 0)))  # past every group: zeros
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def one(args):
        i, x_c = args
        lo = i * chunk
        sizes = jnp.clip(ends, lo, lo + chunk) - jnp.clip(starts, lo, lo + chunk)
        return _grouped_swiglu(x_c, sizes.astype(group_sizes.dtype), gate, up, down)

    out = jax.lax.map(one, (jnp.arange(steps), padded.reshape(steps, chunk, -1)))
    return out.reshape(steps * chunk, -1)[:rows]


def combine(outputs: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """``sum_j weights[t, j] * outputs[t, j]`` in float32: ``[T, k, H]``, ``[T, k]`` ->
    ``[T, H]`` float32 (cast to ``dtype`` first, as the expert output is)."""
    return jnp.einsum("tkh,tk->th", outputs.astype(dtype).astype(jnp.float32), weights)


def route_valid(experts: jax.Array, token_mask: jax.Array | None, num_experts: int):
    """``experts`` with the pairs of masked-out tokens moved to expert id ``num_experts``
    (past every group: sorted last, counted by no ``bincount(length=num_experts)``, sent
    and computed nowhere), and the bool ``[T, k]`` mask of the real pairs.

    Args:
      experts: int32 ``[T, k]`` expert ids in ``[0, num_experts)``.
      token_mask: bool ``[T]`` real tokens, or None (all).
      num_experts: E (all experts, on every device of the expert axis).
    """
    if token_mask is None:
        return experts, jnp.ones(experts.shape, bool)
    valid = jnp.broadcast_to(token_mask[:, None], experts.shape)
    return jnp.where(valid, experts, num_experts).astype(experts.dtype), valid


def dropless_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array,
                     up: jax.Array, down: jax.Array,
                     token_mask: jax.Array | None = None) -> jax.Array:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for every real token, no drops.

    The ``T * k`` (token, expert) pairs are sorted by expert id; each SwiGLU projection is
    a ``ragged_dot`` whose groups are the experts' contiguous runs; results are unsorted
    and combined in float32. The pairs of padding tokens (``token_mask`` false) sort
    after every group: ``ragged_dot`` gives them zeros (a grouped implementation, as on
    TPU / GPU, skips them; XLA:CPU's dense lowering multiplies and masks them), so a
    padding token's output is exactly 0 and its rows get no gradient. (All experts on
    this device; ``models.expert_parallel`` spreads them over a mesh.)

    Args:
      x: ``[T, H]`` compute dtype.
      experts: int32 ``[T, k]`` expert ids in ``[0, E)``.
      weights: float32 ``[T, k]`` combine weights.
      gate, up: ``[E, H, I]``; down: ``[E, I, H]``; same dtype as ``x``.
      token_mask: bool ``[T]``: the tokens to compute (False: padding, output 0); None:
        all.

    Returns:
      ``[T, H]`` in the dtype of ``x``.
    """
    num_tokens, top_k = experts.shape
    flat, valid = route_valid(experts, token_mask, gate.shape[0])
    flat = flat.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    out = expert_ffn(x[order // top_k], group_sizes, gate, up, down)
    out = out[jnp.argsort(order)].reshape(num_tokens, top_k, -1)
    return combine(out, jnp.where(valid, weights, 0.0), x.dtype).astype(x.dtype)
