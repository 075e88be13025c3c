"""``"ragged"`` expert dispatch: ``jax.lax.ragged_all_to_all`` instead of the
worst-case ``[P, C, H]`` blocks of ``models.moe.dense``.

One round, inside ``jax.shard_map``, per device (``P`` devices on the expert axis, each
owning ``E_l`` experts, ``t`` tokens, ``k`` experts per token):

1. the (token, expert) pairs of the real tokens are sorted by expert id (which is by
   destination device, then local expert), then by choice rank (a token's best expert
   first), then by token: the send operand is ``[t * k, H]``, cut into ``P * E_l``
   slices, one per (destination, local expert). Padding tokens (the token mask) have no
   pair in any slice: they are not sent, not computed, not counted against the capacity,
   and their output is 0;
2. one small ``all_to_all`` carries each slice's size per choice rank and its start to
   its receiver (``[P, k + 1, E_l]`` int32); the receiver decides how many rows of each
   slice it keeps (the capacity rule below), lays them out grouped by local expert (and
   by source within an expert) in a buffer of ``R`` rows, and a second small
   ``all_to_all`` tells every sender how many rows of each slice to send and where they
   land;
3. ``ragged_all_to_all`` delivers the rows, already grouped: the grouped SwiGLU
   (``models.moe.experts.expert_ffn``) runs on the ``R`` rows with no re-sort;
4. a second ``ragged_all_to_all`` sends each result back to its sender's ``[t * k, H]``
   buffer, at the pair's sorted position; results are unsorted and combined in float32.

Receive buffer (``receive_rows``): it must be allocated before the sizes are known.
``capacity_factor=None`` (the default) sizes it for the worst case,
``R = P * t * min(k, E_l)`` (every pair of every source may pick this device): dropless
whatever the routing, as MaxText's default ``ragged_buffer_factor=-1``. A float ``f``
gives ``R = ceil(f * t * k)`` rows (``f`` times the perfectly balanced load, as MaxText's
``ragged_buffer_factor > 0``), shared by the device's ``E_l`` experts and its ``P``
sources: real pairs overflow only when more than ``R`` of them pick this device.

Capacity rule (``kept_rows``): when they do, the device keeps its real pairs in GShard's
priority order (Lepikhin et al. 2020, Algorithm 1: every token's first choice before any
token's second choice, and so on), within a choice rank by source device, local expert
and token, up to ``R``; the rest are dropped. With one expert per device (``E_l = 1``)
this is exactly GShard's per-expert capacity rule over the round's tokens of the expert
axis; with several, the device's buffer is the capacity unit (fewer drops for the same
memory than ``E_l`` separate per-expert capacities). Then, as in GShard, Switch (Fedus et
al. 2021, "dropped tokens" pass through the residual) and MaxText (``capacity_factor``
masks; ``ragged_buffer_factor`` truncation): ``overflow="drop"`` (default) gives the
dropped pair output 0, so its token keeps its residual and its other experts' outputs,
with their router weights unchanged (not renormalised over the kept experts: GShard
normalises the top-2 gates before the capacity check and multiplies the dropped one by a
zero mask, MaxText ``generate_masks`` multiplies the weights by the kept mask; a
renormalisation would make a token's output depend on other tokens' routing through the
capacity, and move gradient to the kept experts' weights). Each round reports the dropped
pairs (``MoE`` turns them into the step's dropped fraction). ``overflow="nan"`` (strict)
instead gives every token with a dropped pair NaN outputs: the step's loss is NaN, never
silently different from the dropless model. Choose ``f`` from the measured dropped
fraction or routing skew.

Compared with the dense path, the ``[P, C, H]`` send block becomes ``[t * k, H]`` and
the return block ``[t * k, H]``; with a capacity factor the receive buffer and the expert
activations shrink from ``P * min(k, E_l) / k`` to ``f`` times the balanced load.

Backends: XLA:TPU and XLA:GPU implement ``ragged_all_to_all``; XLA:CPU does not
("HLO opcode ragged-all-to-all is not supported by XLA:CPU", jax 0.10.2), and its vmap
rule refuses the mapped axis. There ``emulated_ragged_all_to_all`` gives the same result
with a dense ``all_to_all`` of ``[K, L, H]`` slices (worst-case memory; for tests).
Gradients: jax's transpose rule of ``ragged_all_to_all`` is another ``ragged_all_to_all``
(``jax._src.lax.parallel._ragged_all_to_all_transpose``).

Sources: MaxText ``layers/moe.py`` (``ragged_all_to_all`` dispatch,
``ragged_buffer_factor``, ``generate_masks``); the ``jax.lax.ragged_all_to_all``
docstring; GShard (Lepikhin et al. 2020), Switch Transformers (Fedus et al. 2021).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.moe.experts import combine, expert_ffn, route_valid

#: The platforms with a native ``ragged_all_to_all``.
NATIVE = ("tpu", "gpu")


def receive_rows(tokens: int, devices: int, top_k: int, local_experts: int,
                 capacity_factor: float | None) -> int:
    """Rows of one round's receive buffer for ``tokens`` tokens per device: the worst
    case ``devices * tokens * min(top_k, local_experts)`` (``capacity_factor=None``), else
    ``ceil(capacity_factor * tokens * top_k)``, at most the worst case."""
    worst = devices * tokens * min(top_k, local_experts)
    if capacity_factor is None:
        return worst
    return max(1, min(worst, math.ceil(capacity_factor * tokens * top_k)))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, num):
    """``jax.lax.ragged_all_to_all`` (same arguments and result) from a dense
    ``all_to_all`` of ``[K, L, ...]`` zero-padded slices, ``L = min(N, M)`` rows each, for
    backends without it (XLA:CPU). ``num``: devices on ``axis_name`` (1: no
    communication)."""
    k = input_offsets.shape[0]
    length = min(operand.shape[0], output.shape[0])
    j = jnp.arange(length, dtype=jnp.int32)
    src = jnp.where(j < send_sizes[:, None], input_offsets[:, None] + j, operand.shape[0])
    blocks = operand.at[src].get(mode="fill", fill_value=0)  # [K, L, ...]

    def exchange(a):
        if num == 1:
            return a
        return jax.lax.all_to_all(a.reshape(num, k // num, *a.shape[1:]), axis_name, 0, 0
                                  ).reshape(a.shape)

    blocks, offsets = exchange(blocks), exchange(output_offsets)
    dst = jnp.where(j < recv_sizes[:, None], offsets[:, None] + j, output.shape[0])
    return output.at[dst.reshape(-1)].set(blocks.reshape(k * length, *blocks.shape[2:]),
                                          mode="drop")


def kept_rows(ranked: jax.Array, rows: int) -> jax.Array:
    """The capacity rule (module docstring): how many rows of each source's slice for
    each local expert a device keeps.

    Args:
      ranked: int32 ``[P, k, E_l]``: the pairs each source sends to each local expert,
        by the choice rank they have in their token's top-k.
      rows: the receive buffer ``R``.

    Returns:
      int32 ``[P, E_l]``: the first rows of each slice (sorted by rank, then token) the
      device keeps; they sum to ``min(R, ranked.sum())``, filled in the order (rank,
      source, local expert).
    """
    sources, top_k, local = ranked.shape
    by_priority = ranked.transpose(1, 0, 2).reshape(-1)
    before = jnp.cumsum(by_priority) - by_priority
    kept = jnp.clip(rows - before, 0, by_priority)
    return kept.reshape(top_k, sources, local).sum(axis=0)


def ragged_round(x, experts, weights, token_mask, gate, up, down, *, expert_axis, num,
                 partial, capacity_factor, overflow, native):
    """One ragged round for ``x [t, H]`` (steps 1-4 of the module docstring).

    Returns ``(y, dropped)``: float32 ``y [t, H]`` (a partial sum over the MLP width when
    ``partial``; 0 for padding tokens, NaN for tokens with a dropped pair when
    ``overflow == "nan"``) and bool ``dropped [t, k]``, the real pairs past the capacity.
    ``token_mask``: bool ``[t]`` real tokens. ``native``: ``jax.lax.ragged_all_to_all``,
    else ``emulated_ragged_all_to_all``."""
    tokens, top_k = experts.shape
    local = gate.shape[0]
    total, pairs = num * local, tokens * top_k
    rows = receive_rows(tokens, num, top_k, local, capacity_factor)

    def a2a(a):
        return a if num == 1 else jax.lax.all_to_all(a, expert_axis, 0, 0)

    def ragged(operand, output, *offsets_sizes):
        if native and num > 1:
            return jax.lax.ragged_all_to_all(operand, output, *offsets_sizes,
                                             axis_name=expert_axis)
        return emulated_ragged_all_to_all(operand, output, *offsets_sizes,
                                          axis_name=expert_axis, num=num)

    # 1. sort the real pairs by (expert, rank, token): pair i = rank * t + token here
    flat, valid = route_valid(experts, token_mask, total)
    flat = flat.T.reshape(-1)
    rank = jnp.arange(pairs, dtype=jnp.int32) // tokens
    order = jnp.argsort(flat, stable=True)
    ranked = jnp.bincount(jnp.where(flat < total, rank * total + flat, top_k * total),
                          length=top_k * total).astype(jnp.int32).reshape(top_k, num, local)
    counts = ranked.sum(axis=0).reshape(-1)
    starts = jnp.cumsum(counts) - counts
    send = x[order % tokens]  # [pairs, H]

    # 2. the receiver keeps rows by the capacity rule, laid out [local expert, source]
    got = a2a(jnp.concatenate([ranked.transpose(1, 0, 2), starts.reshape(num, 1, local)],
                              axis=1))
    kept = kept_rows(got[:, :top_k], rows)  # [source, local expert]
    sender_starts = got[:, top_k]
    group = kept.sum(axis=0)
    place = jnp.cumsum(group) - group + jnp.cumsum(kept, axis=0) - kept
    back_info = a2a(jnp.stack([place, kept], axis=1))  # sender's view [destination, 2, local]
    out_offsets, send_sizes = back_info[:, 0].reshape(-1), back_info[:, 1].reshape(-1)

    # 3. deliver, grouped by local expert; the grouped SwiGLU
    recv = ragged(send, jnp.zeros((rows, x.shape[1]), x.dtype), starts, send_sizes,
                  out_offsets, kept.reshape(-1))
    out = expert_ffn(recv, group, gate, up, down)
    out = out if partial else out.astype(x.dtype)  # partial sums stay float32

    # 4. back to each pair's sorted position (dropped pairs: zeros), unsort, combine
    back = ragged(out, jnp.zeros((pairs, x.shape[1]), out.dtype), place.reshape(-1),
                  kept.reshape(-1), sender_starts.reshape(-1), send_sizes)
    where = jnp.argsort(order).reshape(top_k, tokens).T  # [t, k]: each pair's sorted slot
    pair_out = back[where.reshape(-1)].reshape(tokens, top_k, -1)
    slice_of = jnp.minimum(flat[order], total - 1)
    past = jnp.arange(pairs, dtype=jnp.int32) - starts[slice_of] >= send_sizes[slice_of]
    dropped = valid & past[where]
    y = combine(pair_out, jnp.where(valid, weights, 0.0), pair_out.dtype)
    if overflow == "nan":
        y = jnp.where(dropped.any(axis=1, keepdims=True), jnp.nan, y)
    return y, dropped
