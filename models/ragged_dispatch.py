"""Ragged expert-parallel dispatch: ``jax.lax.ragged_all_to_all`` instead of the
worst-case ``[P, C, H]`` blocks of ``models.expert_parallel``.

One round, inside ``jax.shard_map``, per device (``P`` devices on the expert axis, each
owning ``E_l`` experts, ``t`` tokens, ``k`` experts per token):

1. the ``t * k`` (token, expert) pairs are sorted by expert id, which is by destination
   device and then local expert: the send operand is exactly ``[t * k, H]`` (no padding),
   cut into ``P * E_l`` slices, one per (destination, local expert);
2. one small ``all_to_all`` carries each slice's size and start to its receiver
   (``[P, 2, E_l]`` int32); the receiver lays its rows out grouped by local expert (and by
   source within an expert) in a buffer of ``R`` rows, and a second small ``all_to_all``
   tells every sender where its slices land;
3. ``ragged_all_to_all`` delivers the rows, already grouped: the grouped SwiGLU
   (``models.experts.expert_ffn``) runs on the ``R`` rows with no re-sort;
4. a second ``ragged_all_to_all`` sends each result back to its sender's ``[t * k, H]``
   buffer, at the pair's sorted position; results are unsorted and combined in float32.

Receive buffer (``receive_rows``): it must be allocated before the sizes are known.
``capacity_factor=None`` (the default) sizes it for the worst case,
``R = P * t * min(k, E_l)`` (every pair of every source may pick this device): dropless
whatever the routing, as MaxText's default ``ragged_buffer_factor=-1``. A float ``f``
gives ``R = ceil(f * t * k)`` rows (``f`` times the perfectly balanced load, as MaxText's
``ragged_buffer_factor > 0``); but where MaxText then drops the overflowing tokens, here a
pair that does not fit is detected (its slice arrives shorter than sent) and the output
rows of its token are NaN: the step's loss is NaN, never silently wrong (as a KV cache
overflow, ``models.transformer``). Choose ``f`` from the measured routing skew.

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
``ragged_buffer_factor``); the ``jax.lax.ragged_all_to_all`` docstring.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from models.experts import combine, expert_ffn

#: ``ModelConfig.expert_dispatch`` values; ``"auto"`` picks by the mesh's platform.
DISPATCHES = ("ragged", "dense")
_NATIVE = ("tpu", "gpu", "cuda", "rocm")


def mesh_platform(mesh) -> str:
    """The platform of ``mesh``'s devices (``"tpu"``, ``"gpu"``, ``"cpu"``; a TPU
    topology's mesh says ``"tpu"`` on a CPU machine), else ``jax.default_backend()``."""
    abstract = getattr(mesh, "abstract_mesh", mesh)
    device = getattr(abstract, "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def resolve_dispatch(dispatch: str, mesh) -> str:
    """``"ragged"`` or ``"dense"``; ``"auto"`` is ragged where the backend has
    ``ragged_all_to_all`` (TPU, GPU) and dense elsewhere (CPU).

    Raises:
      ValueError: not ``"auto"`` nor one of ``DISPATCHES``.
    """
    if dispatch == "auto":
        return "ragged" if mesh_platform(mesh) in _NATIVE else "dense"
    if dispatch not in DISPATCHES:
        raise ValueError(f"expert_dispatch must be 'auto' or one of {DISPATCHES}, "
                         f"got {dispatch!r}")
    return dispatch


def check_capacity_factor(factor: float | None) -> None:
    """Raise unless ``factor`` is None or a finite number > 0.

    Raises:
      ValueError: naming ``factor``.
    """
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"expert_capacity_factor must be None or > 0, got {factor!r}")


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


def ragged_round(x, experts, weights, gate, up, down, *, expert_axis, num, partial,
                 capacity_factor, native):
    """One ragged round for ``x [t, H]`` (steps 1-4 of the module docstring); float32
    ``[t, H]`` (a partial sum over the MLP width when ``partial``), NaN rows for tokens
    with a pair past the receive buffer. ``native``: ``jax.lax.ragged_all_to_all``, else
    ``emulated_ragged_all_to_all``."""
    tokens, top_k = experts.shape
    local = gate.shape[0]
    pairs = tokens * top_k
    rows = receive_rows(tokens, num, top_k, local, capacity_factor)

    def a2a(a):
        return a if num == 1 else jax.lax.all_to_all(a, expert_axis, 0, 0)

    def ragged(operand, output, *offsets_sizes):
        if native and num > 1:
            return jax.lax.ragged_all_to_all(operand, output, *offsets_sizes,
                                             axis_name=expert_axis)
        return emulated_ragged_all_to_all(operand, output, *offsets_sizes,
                                          axis_name=expert_axis, num=num)

    # 1. sort the pairs by expert: slice (destination, local expert) of the send operand
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num * local).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    send = x[order // top_k]  # [pairs, H]

    # 2. receiver layout [source, local expert]: grouped by expert, then by source
    got = a2a(jnp.stack([counts, starts]).reshape(2, num, local).transpose(1, 0, 2))
    recv_counts, sender_starts = got[:, 0], got[:, 1]
    group = recv_counts.sum(axis=0)
    group_start = jnp.cumsum(group) - group
    place = group_start + jnp.cumsum(recv_counts, axis=0) - recv_counts
    lo = jnp.minimum(place, rows)
    fits = jnp.minimum(place + recv_counts, rows) - lo  # rows that fit the buffer
    back_info = a2a(jnp.stack([lo, fits], axis=1))  # sender's view [destination, 2, local]
    out_offsets, send_sizes = back_info[:, 0].reshape(-1), back_info[:, 1].reshape(-1)

    # 3. deliver, grouped by local expert; the grouped SwiGLU
    recv = ragged(send, jnp.zeros((rows, x.shape[1]), x.dtype), starts, send_sizes,
                  out_offsets, fits.reshape(-1))
    sizes = jnp.minimum(group_start + group, rows) - jnp.minimum(group_start, rows)
    out = expert_ffn(recv, sizes, gate, up, down)
    out = out if partial else out.astype(x.dtype)  # partial sums stay float32

    # 4. back to each pair's sorted position, unsort, combine
    back = ragged(out, jnp.zeros((pairs, x.shape[1]), out.dtype), lo.reshape(-1),
                  fits.reshape(-1), sender_starts.reshape(-1), send_sizes)
    pair_out = back[jnp.argsort(order)].reshape(tokens, top_k, -1)
    y = combine(pair_out, weights, pair_out.dtype)
    if capacity_factor is None:
        return y
    rank = jnp.arange(pairs, dtype=jnp.int32) - starts[flat[order]]
    lost = (rank >= send_sizes[flat[order]])[jnp.argsort(order)].reshape(tokens, top_k)
    return jnp.where(lost.any(axis=1, keepdims=True), jnp.nan, y)
