"""Expert parallelism: tokens travel to the devices that own their experts (GShard), by
the dispatch path that ``ModelConfig.expert_dispatch`` names.

``routed_experts`` runs inside ``jax.shard_map`` over the whole mesh, with ``P`` devices
on the ``expert`` axis, each owning ``E_l = E / P`` experts (``[E_l, H, I]`` of each
projection: no device ever holds, or gathers, another device's experts). Two dispatch
paths (``REGISTRY``, in ``"auto"``'s order):

* ``"ragged"``: ``jax.lax.ragged_all_to_all`` (``ragged.py``: no padded send block, the
  received rows arrive grouped, and the receive buffer may be sized by a capacity factor,
  past which real pairs are dropped, see ``routed_experts``). ``"auto"`` takes it where
  the mesh's platform has it (TPU, GPU: ``ragged.NATIVE``) but v5e (``LIMITED_ROUTING``:
  the compiler refuses the op there; an explicit ``"ragged"`` raises); an explicit
  ``"ragged"`` runs its emulation on other platforms.
* ``"dense"``: worst-case ``[P, C, H]`` blocks and ``jax.lax.all_to_all`` (``dense.py``),
  dropless with static shapes. XLA:CPU has no ragged all-to-all, so there ``"auto"``
  takes this path.

Both give what the single-device ``models.moe.reference.dropless_experts`` gives (up to
the ragged path's capacity drops). The body is rematerialised in the backward pass
(``jax.checkpoint``), so the dispatch buffers live for one layer at a time, never for the
whole network: the backward repeats the dispatch (3 more all-to-alls per layer on the
dense path). And a device's tokens go through the all-to-all in equal rounds, one after
another and each rematerialised on its own (``models.moe.experts.token_chunks``), of at
most ``MAX_DISPATCH_ROWS`` receive rows (``tokens_per_dispatch``) and at most
``token_chunk`` tokens (``ModelConfig.moe_token_chunk``): the dispatch buffers and the
expert activations are those of one round whatever T (for the example of ``dense.py``: 4
rounds of 512 tokens, 2 x 128 MiB), at the price of more, smaller all-to-alls.

Other axes: the tokens are split over ``BATCH_AXES`` (``data, fsdp, expert``). Expert
weights split on their hidden dimension over ``fsdp`` are all-gathered over ``fsdp``
(only this device's ``E_l`` experts, ZeRO-3 style); split on their MLP width over
``tensor``, each device computes a partial down-projection and the combined output is
summed over ``tensor`` (Megatron-style).

Sources: Lepikhin et al., "GShard" (2020); Fedus et al., "Switch Transformers" (2021).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxhead.dispatch import Choice, Entry, KernelUnsupported, Registry, target_platform
from models.mesh import BATCH_AXES, auto_axes, axis_size, check_divisible, present
from models.moe.dense import dense_round
from models.moe.experts import token_chunks
from models.moe.ragged import NATIVE, ragged_round, receive_rows
from models.sharding import DEFAULT_RULES, logical_to_mesh

#: Chips whose ICI routing the TPU compiler's ragged all-to-all refuses ("not supported in
#: limited ICI routing settings", libtpu 0.0.52): v5e.
LIMITED_ROUTING = ("TPU v5 lite",)


def _device_kind(mesh) -> str | None:
    """``device_kind`` of the mesh's devices (``"TPU v5 lite"``), None when unknown."""
    device = getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)
    return getattr(device, "device_kind", None)


def _ragged_plan(platform: str, capacity_factor: float | None, overflow: str,
                 kind: str | None = None) -> dict:
    """The ragged entry's check: ``ragged_round``'s settings for the call (native
    ``ragged_all_to_all`` where ``platform`` has it, else the emulation).

    Raises:
      KernelUnsupported: chips of ``LIMITED_ROUTING`` (``kind``), where the compiler
        refuses the native op (``"auto"`` takes the dense dispatch there).
    """
    if platform in NATIVE and kind in LIMITED_ROUTING:
        raise KernelUnsupported(f"the TPU compiler has no ragged all-to-all on {kind} "
                                f"chips (limited ICI routing); use expert_dispatch='dense'")
    return {"capacity_factor": capacity_factor, "overflow": overflow,
            "native": platform in NATIVE}


def _ragged(plan: dict, *args, **kwargs):
    return ragged_round(*args, **kwargs, **plan)


def _dense(plan, *args, **kwargs):
    return dense_round(*args, **kwargs)


#: ``ModelConfig.expert_dispatch`` values, in ``"auto"``'s order: ragged where the platform
#: has ``ragged_all_to_all`` (TPU, GPU; ``jaxhead.dispatch.target_platform`` of the mesh),
#: else dense (an explicit ``"ragged"`` runs ``ragged.emulated_ragged_all_to_all`` there).
#: Each checked with ``(platform, capacity_factor, overflow, device kind)`` and called as one
#: all-to-all round: ``call(plan, x, experts, weights, token_mask, gate, up, down, *,
#: expert_axis, num, partial) -> (y, dropped)``.
REGISTRY: Registry = Registry("expert_dispatch", [
    Entry("ragged", _ragged, platforms=NATIVE, check=_ragged_plan),
    Entry("dense", _dense),
])
#: ``ModelConfig.expert_capacity_overflow`` values: what a real pair past the capacity
#: gets (``models.moe.ragged``'s docstring).
OVERFLOWS = ("drop", "nan")


def check_capacity_factor(factor: float | None) -> None:
    """Raise unless ``factor`` is None or a finite number > 0.

    Raises:
      ValueError: naming ``factor``.
    """
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"expert_capacity_factor must be None or > 0, got {factor!r}")


def check_token_chunk(chunk: int | None) -> None:
    """Raise unless ``chunk`` (``ModelConfig.moe_token_chunk``) is None or an int > 0.

    Raises:
      ValueError: naming ``chunk``.
    """
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or chunk <= 0):
        raise ValueError(f"moe_token_chunk must be None or an int > 0, got {chunk!r}")


def check_overflow(overflow: str) -> None:
    """Raise unless ``overflow`` is one of ``OVERFLOWS``.

    Raises:
      ValueError: naming ``overflow``.
    """
    if overflow not in OVERFLOWS:
        raise ValueError(f"expert_capacity_overflow must be one of {OVERFLOWS}, got "
                         f"{overflow!r}")




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


def tokens_per_dispatch(tokens: int, devices: int, top_k: int, local_experts: int,
                        max_rows: int, capacity_factor: float | None = None) -> int:
    """Tokens per all-to-all round: the largest divisor ``t`` of ``tokens`` whose receive
    buffer (``models.moe.ragged.receive_rows``: ``devices * capacity(t, top_k,
    local_experts)`` without a capacity factor) stays within ``max_rows`` rows (at least
    1 token)."""
    for t in range(tokens, 0, -1):
        if tokens % t == 0 and (t == 1 or receive_rows(
                t, devices, top_k, local_experts, capacity_factor) <= max_rows):
            return t
    return 1


def _shard_body(x, experts, weights, token_mask, gate, up, down, *, expert_axis, num,
                gather_axes, sum_axes, max_rows, token_chunk, rounds: Choice):
    """Per-device expert-parallel MoE: the token rounds (``models.moe.experts.token_chunks``)
    of the dispatch path ``rounds`` (a ``REGISTRY`` choice); ``(y, dropped)``. A round has
    at most ``token_chunk`` tokens (None: all of them), and as many fewer as keep its
    receive buffer within ``max_rows``."""
    if gather_axes:  # this device's experts only, whole on their hidden dimension
        gate, up = (jax.lax.all_gather(w, gather_axes, axis=1, tiled=True) for w in (gate, up))
        down = jax.lax.all_gather(down, gather_axes, axis=2, tiled=True)
    tokens, top_k = experts.shape
    factor = (rounds.plan or {}).get("capacity_factor")
    chunk = tokens if token_chunk is None else min(token_chunk, tokens)
    step = tokens_per_dispatch(chunk, num, top_k, gate.shape[0], max_rows, factor)
    kw = {"expert_axis": expert_axis, "num": num, "partial": bool(sum_axes)}

    def one(*args):
        return rounds(*args, gate, up, down, **kw)

    y, dropped = token_chunks(one, step, x, experts, weights, token_mask)
    if sum_axes:
        y = jax.lax.psum(y, sum_axes)
    return y.astype(x.dtype), dropped


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array,
                   up: jax.Array, down: jax.Array, *, mesh, rules=DEFAULT_RULES,
                   max_rows: int = MAX_DISPATCH_ROWS, token_chunk: int | None = None,
                   dispatch: str = "auto",
                   capacity_factor: float | None = None, overflow: str = "drop",
                   token_mask: jax.Array | None = None,
                   token_axes: tuple[str, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """``models.moe.reference.dropless_experts`` with the experts spread over ``mesh``:
    dropless, except that with the ragged dispatch and a ``capacity_factor`` the real pairs
    past the capacity are dropped (``models.moe.ragged``).

    Args:
      x: ``[T, H]`` compute dtype, all tokens of the step, split over ``token_axes``.
      experts: int32 ``[T, k]``; weights: float32 ``[T, k]`` (the router's choice).
      gate, up: ``[E, H, I]``; down: ``[E, I, H]``; laid out by ``rules``.
      mesh: a ``Mesh`` or ``AbstractMesh`` with the ``models.mesh`` axes, of any axis types
        (used with its axes Auto, ``models.mesh.auto_axes``).
      rules: the logical -> mesh axis rules the weights are placed by
        (``ModelConfig.sharding_rules``; default ``models.sharding.DEFAULT_RULES``:
        experts over ``expert``).
      max_rows: receive-buffer rows per all-to-all round (``tokens_per_dispatch``): the
        device's tokens go in as few equal rounds as keep within it.
      token_chunk: at most this many of a device's tokens per round
        (``ModelConfig.moe_token_chunk``; None: no bound but ``max_rows``). A device's
        token count that is no multiple of its round is padded up to one with padding
        tokens (the ``token_mask``), which change nothing. The capacity (a
        ``capacity_factor``) is per round, so the round size changes which pairs are
        dropped; the dropless paths give the same result whatever it is.
      dispatch: ``"dense"`` (the worst-case blocks of ``models.moe.dense``), ``"ragged"``
        (``models.moe.ragged``: ``jax.lax.ragged_all_to_all`` on TPU / GPU, its
        emulation elsewhere), or ``"auto"`` (ragged where the mesh's platform has it,
        else dense; ``REGISTRY``).
      capacity_factor: ragged only: None (receive buffers for the worst case: dropless)
        or ``f > 0`` (``f`` times the balanced load per device; real pairs past it are
        dropped by GShard's priority, see ``models.moe.ragged``).
      overflow: ragged with a capacity factor only: ``"drop"`` (a dropped pair adds 0,
        its token keeps its other experts) or ``"nan"`` (strict: a token with a dropped
        pair gets NaN rows).
      token_mask: bool ``[T]`` (split like ``x``): the real tokens; the others (padding)
        are routed nowhere (not sent, not computed, not counted against the capacity)
        and their output is 0. None: every token is real.
      token_axes: the mesh axes ``x``'s tokens are split over, in order (default: the
        batch axes present; with context parallelism ``models.context.token_axes``, the
        tokens in its token-major order).

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
        ``capacity_factor`` <= 0 or a ``token_chunk`` that is no int > 0 (named).
    """
    mesh = auto_axes(mesh)
    check_capacity_factor(capacity_factor)
    check_overflow(overflow)
    check_token_chunk(token_chunk)
    platform = target_platform(mesh)
    rounds = REGISTRY.resolve(dispatch, platform, capacity_factor, overflow,
                              _device_kind(mesh), platform=platform)
    token_axes = present(mesh, BATCH_AXES) if token_axes is None else tuple(token_axes)
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
            max_rows=max_rows, token_chunk=token_chunk, rounds=rounds,
        )

    tok = P(token_axes or None)
    # weights split over an axis the tokens are not (context while decoding: the context
    # devices repeat the rows' work) are gathered whole there, so the outputs are the same
    # on each of its devices; JAX's type check cannot see through the gather
    replicated = bool(set(_axes(gate_spec[1])) - set(token_axes))
    run = jax.shard_map(
        jax.checkpoint(body), mesh=mesh,
        in_specs=(tok, tok, tok, tok, gate_spec, gate_spec, down_spec), out_specs=(tok, tok),
        check_vma=not replicated,
    )
    return run(x, experts, weights, token_mask, gate, up, down)
