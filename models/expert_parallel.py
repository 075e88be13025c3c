"""Expert parallelism: tokens travel to the devices that own their experts (GShard).

Inside ``jax.shard_map`` over the whole mesh, with ``P`` devices on the ``expert`` axis,
each owning ``E_l = E / P`` experts (``[E_l, H, I]`` of each projection: no device ever
holds, or gathers, another device's experts):

1. every device sorts the (token, expert) pairs of its real tokens by expert id, which
   groups them by destination device and, within it, by local expert (padding tokens,
   ``token_mask`` false, have no pair: they take no slot of any block, no expert
   computes them, and their output is 0);
2. it packs them into a send buffer ``[P, C, H]`` (row block ``p`` for device ``p``) and
   one ``all_to_all`` over ``expert`` delivers block ``p`` to device ``p``; a second,
   tiny ``all_to_all`` carries the per-(device, expert) counts ``[P, E_l]``;
3. the receiver sorts the ``P * C`` received rows by local expert, runs the grouped
   SwiGLU (``models.experts.expert_ffn``, ``ragged_dot``), unsorts them, and a third
   ``all_to_all`` sends each result back to the device its token lives on;
4. results are unsorted to the original pairs and combined with the router weights, in
   float32, exactly as the single-device ``models.experts.dropless_experts``.

(The blocks have a static size, so the all-to-all moves ``P * C`` rows whatever the
number of real tokens; the ragged path below sends only the real pairs.)

Two dispatch paths (``dispatch``, ``ModelConfig.expert_dispatch``): on TPU and GPU
``"auto"`` sends the rows with ``jax.lax.ragged_all_to_all`` (``models.ragged_dispatch``:
no padded send block, the received rows arrive grouped, and the receive buffer may be
sized by a capacity factor, past which real pairs are dropped, see ``routed_experts``).
XLA:CPU has no ragged all-to-all, so there ``"auto"`` takes the dense path described
here, dropless with static shapes: the buffers have a fixed size sized for the worst
case. A token's ``k`` experts are distinct, so one device receives at most
``min(k, E_l)`` of its pairs: ``C = T * min(k, E_l)`` rows per (source, destination)
block, with ``T`` the tokens per device, never overflows whatever the routing. Memory per MoE layer per device: the send and receive buffers
``2 * P * C * H`` elements in the compute dtype, plus the expert activations of the
``P * C`` received rows (``[P * C, 2 I]`` and a float32 ``[P * C, H]``), i.e. ``P *
min(k, E_l) / k`` times what the average routing needs. For Qwen3-30B-A3B (H = 2048,
I = 768, k = 8, E = 128) on ``expert = 8`` (E_l = 16) that is 8x the average: with
T = 2048 tokens per device, 2 x 512 MiB of bf16 buffers per layer. Rows past a block's
count are zeros and belong to no expert (``ragged_dot`` skips them on accelerators that
implement it grouped; the CPU lowering computes them densely, in row chunks, see
``models.experts.rows_per_chunk``). The body is rematerialised in the backward pass
(``jax.checkpoint``), so these buffers live for one layer at a time, never for the whole
network: the backward repeats the dispatch (3 more all-to-alls per layer). And a
device's tokens go through the all-to-all in equal rounds (``lax.map``) of at most
``MAX_DISPATCH_ROWS`` receive rows (``tokens_per_dispatch``): the buffers are bounded
whatever T (for the example above: 4 rounds of 512 tokens, 2 x 128 MiB), at the price of
more, smaller all-to-alls.

Other axes: the tokens are split over ``BATCH_AXES`` (``data, fsdp, expert``). Expert
weights split on their hidden dimension over ``fsdp`` are all-gathered over ``fsdp``
(only this device's ``E_l`` experts, ZeRO-3 style); split on their MLP width over
``tensor``, each device computes a partial down-projection and the combined output is
summed over ``tensor`` (Megatron-style).

Sources: Lepikhin et al., "GShard" (2020); Fedus et al., "Switch Transformers" (2021).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxhead.dispatch import target_platform
from models.experts import combine, expert_ffn, route_valid
from models.mesh import BATCH_AXES, axis_size, check_divisible, present
from models.ragged_dispatch import (
    NATIVE,
    REGISTRY,
    check_capacity_factor,
    check_overflow,
    ragged_round,
    receive_rows,
)
from models.sharding import DEFAULT_RULES, logical_to_mesh


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _nontrivial(spec: P, mesh) -> P:
    """``spec`` without mesh axes of size 1 (same layout; no size-1 collectives)."""
    sizes = dict(mesh.shape)

    def keep(entry):
        axes = tuple(a for a in _axes(entry) if sizes[a] > 1)
        return axes[0] if len(axes) == 1 else axes or None

    return P(*(keep(e) for e in spec))


#: Default bound on the rows of one all-to-all round's receive buffer (128 MiB of bf16
#: rows at H = 2048); see ``tokens_per_dispatch``.
MAX_DISPATCH_ROWS = 2**15


def capacity(tokens: int, top_k: int, local_experts: int) -> int:
    """Rows per (source, destination) block: ``tokens * min(top_k, local_experts)``, the
    most pairs of ``tokens`` tokens that can route to one device's experts."""
    return tokens * min(top_k, local_experts)


def _exchange(x, axis, num):
    """``all_to_all`` of block ``p`` (leading axis) to device ``p`` of ``axis``."""
    return x if num == 1 else jax.lax.all_to_all(x, axis, 0, 0)


def tokens_per_dispatch(tokens: int, devices: int, top_k: int, local_experts: int,
                        max_rows: int, capacity_factor: float | None = None) -> int:
    """Tokens per all-to-all round: the largest divisor ``t`` of ``tokens`` whose receive
    buffer (``models.ragged_dispatch.receive_rows``: ``devices * capacity(t, top_k,
    local_experts)`` without a capacity factor) stays within ``max_rows`` rows (at least
    1 token)."""
    for t in range(tokens, 0, -1):
        if tokens % t == 0 and (t == 1 or receive_rows(
                t, devices, top_k, local_experts, capacity_factor) <= max_rows):
            return t
    return 1


def _dispatch(x, experts, weights, token_mask, gate, up, down, *, expert_axis, num,
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


def _shard_body(x, experts, weights, token_mask, gate, up, down, *, expert_axis, num,
                gather_axes, sum_axes, max_rows, ragged, native, capacity_factor, overflow):
    """Per-device expert-parallel MoE: the token rounds (``lax.map``) of ``_dispatch``, or
    of ``models.ragged_dispatch.ragged_round`` when ``ragged``; ``(y, dropped)``."""
    if gather_axes:  # this device's experts only, whole on their hidden dimension
        gate, up = (jax.lax.all_gather(w, gather_axes, axis=1, tiled=True) for w in (gate, up))
        down = jax.lax.all_gather(down, gather_axes, axis=2, tiled=True)
    tokens, top_k = experts.shape
    factor = capacity_factor if ragged else None
    step = tokens_per_dispatch(tokens, num, top_k, gate.shape[0], max_rows, factor)
    kw = {"expert_axis": expert_axis, "num": num, "partial": bool(sum_axes)}
    if ragged:
        kw.update(capacity_factor=capacity_factor, overflow=overflow, native=native)

    @jax.checkpoint  # the backward recomputes one round at a time, never all at once
    def one(args):
        return (ragged_round if ragged else _dispatch)(*args, gate, up, down, **kw)

    args = (x, experts, weights, token_mask)
    if step == tokens:
        y, dropped = one(args)
    else:
        rounds = tokens // step
        split = (a.reshape(rounds, step, *a.shape[1:]) for a in args)
        y, dropped = jax.lax.map(one, tuple(split))
        y, dropped = y.reshape(tokens, -1), dropped.reshape(tokens, top_k)
    if sum_axes:
        y = jax.lax.psum(y, sum_axes)
    return y.astype(x.dtype), dropped


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array,
                   up: jax.Array, down: jax.Array, *, mesh, rules=DEFAULT_RULES,
                   max_rows: int = MAX_DISPATCH_ROWS, dispatch: str = "auto",
                   capacity_factor: float | None = None, overflow: str = "drop",
                   token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``models.experts.dropless_experts`` with the experts spread over ``mesh``: dropless,
    except that with the ragged dispatch and a ``capacity_factor`` the real pairs past the
    capacity are dropped (``models.ragged_dispatch``).

    Args:
      x: ``[T, H]`` compute dtype, all tokens of the step (split over ``BATCH_AXES``).
      experts: int32 ``[T, k]``; weights: float32 ``[T, k]`` (the router's choice).
      gate, up: ``[E, H, I]``; down: ``[E, I, H]``; laid out by ``rules``.
      mesh: a ``Mesh`` or ``AbstractMesh`` with the ``models.mesh`` axes.
      rules: the logical -> mesh axis rules the weights are placed by
        (``ModelConfig.sharding_rules``; default ``models.sharding.DEFAULT_RULES``:
        experts over ``expert``).
      max_rows: receive-buffer rows per all-to-all round (``tokens_per_dispatch``): the
        device's tokens go in as few equal rounds as keep within it.
      dispatch: ``"dense"`` (the worst-case blocks of this module), ``"ragged"``
        (``models.ragged_dispatch``: ``jax.lax.ragged_all_to_all`` on TPU / GPU, its
        emulation elsewhere), or ``"auto"`` (ragged where the mesh's platform has it,
        else dense; ``models.ragged_dispatch.REGISTRY``).
      capacity_factor: ragged only: None (receive buffers for the worst case: dropless)
        or ``f > 0`` (``f`` times the balanced load per device; real pairs past it are
        dropped by GShard's priority, see ``models.ragged_dispatch``).
      overflow: ragged with a capacity factor only: ``"drop"`` (a dropped pair adds 0,
        its token keeps its other experts) or ``"nan"`` (strict: a token with a dropped
        pair gets NaN rows).
      token_mask: bool ``[T]`` (split like ``x``): the real tokens; the others (padding)
        are routed nowhere (not sent, not computed, not counted against the capacity)
        and their output is 0. None: every token is real.

    Returns:
      ``(y, dropped)``: ``y [T, H]`` in the dtype of ``x``, split like ``x``; bool
      ``dropped [T, k]``, the real (token, expert) pairs dropped for capacity (all false
      without a capacity factor, and on the dense path). Under differentiation the
      per-device body is rematerialised (``jax.checkpoint``): only its inputs are kept
      for the backward pass, which repeats the dispatch, so the worst-case buffers never
      outlive the layer (otherwise every layer would keep them until its backward).

    Raises:
      ValueError: ``T`` not divisible by the token shards, or E (or H, I) not divisible by
        its mesh axes (both numbers named); an unknown ``dispatch`` or ``overflow``, or a
        ``capacity_factor`` <= 0 (named).
    """
    platform = target_platform(mesh)
    ragged = REGISTRY.resolve(dispatch, platform=platform)[0] == "ragged"
    check_capacity_factor(capacity_factor)
    check_overflow(overflow)
    token_axes = present(mesh, BATCH_AXES)
    check_divisible(x.shape[0], mesh, token_axes, "MoE input (batch x sequence)")
    gate_spec = _nontrivial(logical_to_mesh(
        ("expert", "embed", "mlp"), mesh, rules, gate.shape, "MoE gate_proj"), mesh)
    down_spec = _nontrivial(logical_to_mesh(
        ("expert", "mlp", "embed"), mesh, rules, down.shape, "MoE down_proj"), mesh)
    expert_axes = _axes(gate_spec[0])
    if token_mask is None:
        token_mask = jnp.ones(x.shape[:1], bool)

    def body(*args):
        return _shard_body(
            *args, expert_axis=expert_axes, num=axis_size(mesh, expert_axes),
            gather_axes=_axes(gate_spec[1]), sum_axes=_axes(gate_spec[2]),
            max_rows=max_rows, ragged=ragged,
            native=platform in NATIVE, capacity_factor=capacity_factor,
            overflow=overflow,
        )

    tok = P(token_axes or None)
    run = jax.shard_map(
        jax.checkpoint(body), mesh=mesh,
        in_specs=(tok, tok, tok, tok, gate_spec, gate_spec, down_spec), out_specs=(tok, tok),
    )
    return run(x, experts, weights, token_mask, gate, up, down)
