"""``"dense"`` expert dispatch: one round of worst-case blocks and ``jax.lax.all_to_all``
(GShard).

Per device, inside the ``jax.shard_map`` of ``models.moe.api.routed_experts`` (``P``
devices on the ``expert`` axis, each owning ``E_l = E / P`` experts):

1. every device sorts the (token, expert) pairs of its real tokens by expert id, which
   groups them by destination device and, within it, by local expert (padding tokens,
   ``token_mask`` false, have no pair: they take no slot of any block, no expert
   computes them, and their output is 0);
2. it packs them into a send buffer ``[P, C, H]`` (row block ``p`` for device ``p``) and
   one ``all_to_all`` over ``expert`` delivers block ``p`` to device ``p``; a second,
   tiny ``all_to_all`` carries the per-(device, expert) counts ``[P, E_l]``;
3. the receiver sorts the ``P * C`` received rows by local expert, runs the grouped
   SwiGLU (``models.moe.experts.expert_ffn``, ``ragged_dot``), unsorts them, and a third
   ``all_to_all`` sends each result back to the device its token lives on;
4. results are unsorted to the original pairs and combined with the router weights, in
   float32, exactly as the single-device ``models.moe.reference.dropless_experts``.

(The blocks have a static size, so the all-to-all moves ``P * C`` rows whatever the
number of real tokens; the ragged path, ``models.moe.ragged``, sends only the real pairs.)

Dropless with static shapes: the buffers have a fixed size sized for the worst case. A
token's ``k`` experts are distinct, so one device receives at most ``min(k, E_l)`` of its
pairs: ``C = T * min(k, E_l)`` rows per (source, destination) block, with ``T`` the
tokens per device, never overflows whatever the routing. Memory per MoE layer per
device: the send and receive buffers ``2 * P * C * H`` elements in the compute dtype,
plus the expert activations of the ``P * C`` received rows (``[P * C, 2 I]`` and a
float32 ``[P * C, H]``), i.e. ``P * min(k, E_l) / k`` times what the average routing
needs. For Qwen3-30B-A3B (H = 2048, I = 768, k = 8, E = 128) on ``expert = 8``
(E_l = 16) that is 8x the average: with T = 2048 tokens per device, 2 x 512 MiB of bf16
buffers per layer (``models.moe.api`` bounds them by rounds). Rows past a block's count
are zeros and belong to no expert (``ragged_dot`` skips them on accelerators that
implement it grouped; the CPU lowering computes them densely, in row chunks, see
``models.moe.experts.rows_per_chunk``).

Sources: Lepikhin et al., "GShard" (2020); Fedus et al., "Switch Transformers" (2021).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.moe.experts import combine, expert_ffn, route_valid


def capacity(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows per (source, destination) block: ``tokens * min(top_k, local_experts)``, the
    most pairs of ``tokens`` tokens that can route to one device's experts."""
    return tokens * min(top_k, local_experts)


def _exchange(x, axis, num):
    """``all_to_all`` of block ``p`` (leading axis) to device ``p`` of ``axis``."""
    return x if num == 1 else jax.lax.all_to_all(x, axis, 0, 0)


def dense_round(x, experts, weights, token_mask, gate, up, down, *, expert_axis, num,
                partial):
    """One all-to-all round for ``x [t, H]`` (steps 1-4 of the module docstring); float32
    ``[t, H]``, a partial sum over the MLP width when ``partial``, 0 for padding tokens
    (``token_mask`` false: no pair in any block). Returns ``(y, dropped)``; this path never
    drops (``dropped`` all false)."""
    tokens, top_k = experts.shape
    local = gate.shape[0]
    cap = capacity(tokens, top_k, local)
    pairs = tokens * top_k

    # 1-2. sort pairs by expert (= by destination, then local expert) and pack the blocks
    flat, valid = route_valid(experts, token_mask, num * local)
    flat = flat.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num * local).astype(jnp.int32).reshape(num, local)
    send_sizes = counts.sum(axis=1)
    send_start = jnp.cumsum(send_sizes) - send_sizes
    slot = jnp.arange(cap, dtype=jnp.int32)
    src = jnp.where(slot < send_sizes[:, None], send_start[:, None] + slot, pairs)
    sorted_rows = x[order // top_k]
    send = sorted_rows.at[src].get(mode="fill", fill_value=0)  # [num, cap, H]
    recv = _exchange(send, expert_axis, num)
    recv_counts = _exchange(counts, expert_axis, num)  # [source, local expert]

    # 3. group the received rows by local expert (empty slots: id `local`, past all groups)
    ends = jnp.cumsum(recv_counts, axis=1)
    local_ids = jax.vmap(lambda e: jnp.searchsorted(e, slot, side="right"))(ends)
    order2 = jnp.argsort(local_ids.reshape(-1), stable=True)
    rows = recv.reshape(num * cap, -1)[order2]
    out = expert_ffn(rows, recv_counts.sum(axis=0), gate, up, down)
    out = out if partial else out.astype(x.dtype)  # partial sums stay float32
    out = out[jnp.argsort(order2)].reshape(num, cap, -1)
    back = _exchange(out, expert_axis, num).reshape(num * cap, -1)

    # 4. each sorted pair's result sits at (its destination, its rank there); padding: 0
    real = flat[order] < num * local
    dest = jnp.where(real, flat[order] // local, 0)
    rank = jnp.arange(pairs, dtype=jnp.int32) - send_start[dest]
    pair_out = jnp.where(real[:, None], back[dest * cap + rank], 0)
    pair_out = pair_out[jnp.argsort(order)].reshape(tokens, top_k, -1)
    y = combine(pair_out, jnp.where(valid, weights, 0.0), pair_out.dtype)
    return y, jnp.zeros(experts.shape, bool)
