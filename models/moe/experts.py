"""The expert computation every dispatch path shares: grouped SwiGLU (``ragged_dot``) of
rows sorted by expert, the weighted combination of each token's top-k expert outputs, the
routing of padding tokens (a token mask) past every expert group (not computed, output 0),
and the sequential token chunks (``token_chunks``) that bound the buffers of each."""

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


def token_chunks(fn, chunk: int, *args):
    """``fn(*args)``, ``chunk`` tokens at a time: the leading (token) axis of every arg is
    cut into chunks that run one after another (``jax.lax.map``), each rematerialised in
    the backward pass (``jax.checkpoint``: only its inputs are saved), so one chunk's
    intermediates are live at a time. Tokens are independent, so the result is ``fn`` on
    all of them (up to float32 summation order in the weight gradients).

    ``T`` not a multiple of ``chunk``: the args are padded with zeros to one (a token mask
    among them is then False there: padding, which ``fn`` must neither count nor let
    change a real token) and the outputs cut back to ``T``. ``chunk >= T``: one call.

    Args:
      fn: ``fn(*chunk_args) -> pytree of [t, ...]`` arrays, ``t`` the chunk's tokens.
      chunk: tokens per call (> 0). args: arrays ``[T, ...]``.

    Returns:
      ``fn``'s pytree with leading axis ``T``.
    """
    tokens = args[0].shape[0]
    one = jax.checkpoint(lambda a: fn(*a))
    if chunk >= tokens:
        return one(args)
    steps = -(-tokens // chunk)
    pad = steps * chunk - tokens
    split = tuple(jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
                  .reshape(steps, chunk, *a.shape[1:]) for a in args)
    out = jax.lax.map(one, split)
    return jax.tree.map(lambda o: o.reshape(steps * chunk, *o.shape[2:])[:tokens], out)
