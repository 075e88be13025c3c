"""Qwen3-MoE sparse block: softmax top-k router and experts (grouped matmul).

By default every real token reaches all of its top-k experts, whatever the routing
imbalance: the (token, expert) pairs are sorted by expert and multiplied with
``jax.lax.ragged_dot`` (one group per expert), so there is no capacity and nothing is
dropped. Padding (segment id 0, the ``token_mask``) is never dispatched: its pairs are in
no expert group and no all-to-all block, no expert computes them, it takes no capacity,
its MoE output is 0 (the residual carries it) and the router statistics (so the
load-balancing loss) leave it out. So adding padding rows or padding tokens changes no
real token's output.

Under a device mesh (``jax.set_mesh``, e.g. via ``models.sharding.jit_sharded``) the
experts run expert-parallel: ``models.moe.api`` (``ModelConfig.expert_dispatch``:
ragged all-to-all on TPU / GPU, ``models.moe.ragged``; worst-case blocks on CPU,
``models.moe.dense``). With ``ModelConfig.expert_capacity_factor`` set, the ragged
receive buffer holds ``f`` times the balanced load; real pairs past it are dropped in
GShard's priority order (a dropped pair adds 0: its token keeps its residual and its
other experts, with their router weights unchanged) and counted (``RouterStats.dropped``,
the step's ``DecoderOutput.dropped_fraction``);
``ModelConfig.expert_capacity_overflow="nan"`` (strict) gives those tokens NaN outputs
instead. A drop changes the trained model away from the sampled one (RL log-probs), so
watch the dropped fraction, or stay dropless.

With ``ModelConfig.moe_token_chunk`` the experts take a device's tokens that many at a
time, one chunk after another, each rematerialised in the backward: the dispatch buffers
and expert activations stay one chunk's whatever the sequence length. The router runs on
all tokens at once (its float32 ``[T, E]`` logits and probabilities are ``E`` floats a
token, small next to the ``k`` hidden rows a token's pairs take), so the router statistics
are the unchunked ones; only the capacity, with a capacity factor, is per chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import context
from models.config import ModelConfig
from models.layers import param
from models.moe.api import routed_experts
from models.moe.invariant import on_mesh, router_logits, values_with_gradient_of
from models.moe.reference import dropless_experts


class RouterStats(NamedTuple):
    """Per-layer router statistics for the load-balancing loss (float32).

    Attributes:
      assignments: ``[E]`` number of (token, expert) top-k assignments per expert.
      probs: ``[E]`` sum over tokens of the router probability of each expert.
      tokens: scalar number of tokens counted (padding excluded).
      dropped: scalar number of real (token, expert) pairs dropped for capacity.
    """

    assignments: jax.Array
    probs: jax.Array
    tokens: jax.Array
    dropped: jax.Array


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool):
    """Softmax top-k routing.

    Args:
      logits: float32 ``[T, E]`` router logits.
      top_k: experts per token.
      norm_topk_prob: renormalise the selected probabilities to sum to 1.

    Returns:
      ``(probs [T, E] f32, weights [T, k] f32, experts [T, k] int32)``: full softmax,
      combine weights and expert ids (highest probability first).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts.astype(jnp.int32)


def router_stats(probs: jax.Array, experts: jax.Array, token_mask: jax.Array,
                 dropped: jax.Array) -> RouterStats:
    """``RouterStats`` of ``probs`` float32 ``[T, E]`` and ``experts`` int32 ``[T, k]``,
    counting the tokens of bool ``token_mask [T]`` only; ``dropped`` the scalar count."""
    m = token_mask.astype(jnp.float32)
    onehot = jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32).sum(axis=1)
    return RouterStats(m @ onehot, m @ probs, jnp.sum(m), dropped)


def replay_route(logits: jax.Array, experts: jax.Array, top_k: int, norm_topk_prob: bool):
    """Routing replay (R3): ``route`` with the experts given, where given.

    Rollout Routing Replay (Ma et al. 2025, arXiv:2510.11370, Sec. 3): the trainer's
    forward takes the experts the rollout engine chose for a token, and the gate values
    from its own router, so the router keeps its gradient. Here each replayed token's
    weights are the trainer's softmax over all experts gathered at the replayed experts,
    renormalised to sum to 1 when ``norm_topk_prob`` (the paper's softmax over the
    replayed experts' logits; Qwen3-MoE's setting), else left as they are, as the
    model's own top-k would weigh them. A token whose first entry is negative (no
    recorded route: padding, or a completion's last token, never fed to the sampler)
    takes its own top-k.

    Args:
      logits: float32 ``[T, E]`` the trainer's router logits.
      experts: int32 ``[T, k]`` the recorded experts (``-1`` rows: none recorded).
      top_k: k. norm_topk_prob: as ``route``.

    Returns:
      ``(probs [T, E] f32, weights [T, k] f32, experts [T, k] int32)`` as ``route``'s: the
      experts used (the replayed ones where given).

    Raises:
      ValueError: ``experts`` not ``[T, k]`` (the shapes named).
    """
    if experts.shape != (logits.shape[0], top_k):
        raise ValueError(f"replayed experts must be [tokens, top_k] = "
                         f"{[logits.shape[0], top_k]}, got {list(experts.shape)}")
    probs, weights, own = route(logits, top_k, norm_topk_prob)
    given = experts[:, :1] >= 0
    chosen = jnp.where(given, experts.astype(jnp.int32), own)
    gathered = jnp.take_along_axis(probs, chosen, axis=-1)
    if norm_topk_prob:
        gathered = gathered / jnp.sum(gathered, axis=-1, keepdims=True)
    return probs, jnp.where(given, gathered, weights), chosen


class MoE(nnx.Module):
    """Sparse MoE feed-forward block of Qwen3-MoE.

    Parameters: ``router`` ``[H, E]`` (axes ``embed, expert``); experts stacked on the
    leading axis: ``gate_proj`` / ``up_proj`` ``[E, H, I]`` (``expert, embed, mlp``) and
    ``down_proj`` ``[E, I, H]`` (``expert, mlp, embed``), I = ``moe_intermediate_size``.

    Args:
      cfg: model config with ``num_experts > 0``. rngs: initialiser keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, e, i, pd = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.param_dtype
        self.dtype, self.top_k, self.norm_topk_prob = cfg.dtype, cfg.num_experts_per_tok, \
            cfg.norm_topk_prob
        self.rules = cfg.sharding_rules  # where the experts live under a mesh
        self.dispatch, self.capacity_factor = cfg.expert_dispatch, cfg.expert_capacity_factor
        self.overflow = cfg.expert_capacity_overflow
        self.token_chunk = cfg.moe_token_chunk  # tokens per expert chunk (None: all)
        self.router = param(rngs, (h, e), ("embed", "expert"), pd)
        self.gate_proj = param(rngs, (e, h, i), ("expert", "embed", "mlp"), pd, in_axes=(1,))
        self.up_proj = param(rngs, (e, h, i), ("expert", "embed", "mlp"), pd, in_axes=(1,))
        self.down_proj = param(rngs, (e, i, h), ("expert", "mlp", "embed"), pd, in_axes=(1,))

    def __call__(self, x: jax.Array, token_mask: jax.Array, *, split_tokens: bool = False,
                 replay: jax.Array | None = None, with_experts: bool = False):
        """Route and run the experts.

        Args:
          x: ``[B, T, H]`` normed hidden states.
          token_mask: bool ``[B, T]``: the real tokens; the others (padding) are not
            dispatched, get output 0 and are not counted in the router statistics.
          split_tokens: the rows' tokens are split over the mesh's ``context`` axis
            (training and scoring; ``models.context``): the expert dispatch then takes
            them in token-major order. False (decoding with a KV cache): rows only.
          replay: None (the router's own top-k), or int32 ``[B, T, k]`` experts to use
            instead (routing replay, ``replay_route``; ``-1`` rows: the token's own).
          with_experts: also return the experts each token used (what a rollout engine
            records, and the trainer compares with the record).

        Returns:
          ``(y [B, T, H] compute dtype, RouterStats)``; with ``with_experts`` also
          ``experts [B, T, k] int32``.
        """
        dt = self.dtype
        mesh = jax.sharding.get_abstract_mesh()
        # a row's tokens split over context (training): the experts see them token-major
        c = context.context_size(mesh) if split_tokens else 1
        x, token_mask = context.to_token_major(x, c), context.to_token_major(token_mask, c)
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).astype(dt)
        logits = router_logits(flat, self.router[...].astype(dt))
        if replay is None:
            probs, weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        else:  # routing replay: the recorded experts, the trainer's gate values
            replay = context.to_token_major(replay, c).reshape(-1, self.top_k)
            probs, weights, experts = replay_route(logits, replay, self.top_k,
                                                   self.norm_topk_prob)
        mask = token_mask.reshape(-1)
        y, dropped = self._experts(flat, experts, weights, mask, *self._weights(), c=c)
        stats = router_stats(probs, experts, mask, dropped)
        y = context.from_token_major(y.reshape(shape), c)
        if not with_experts:
            return y, stats
        return y, stats, context.from_token_major(experts.reshape(*shape[:-1], self.top_k), c)

    def _weights(self):
        """The experts' ``gate``, ``up``, ``down`` in the compute dtype."""
        dt = self.dtype
        return tuple(p[...].astype(dt) for p in (self.gate_proj, self.up_proj,
                                                 self.down_proj))

    def _experts(self, flat, experts, weights, mask, gate, up, down, *, c: int):
        """The default (dropless) experts of ``flat [T, H]`` (token-major under a context
        axis of ``c`` devices): ``(y [T, H], dropped pairs)``."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            y = dropless_experts(flat, experts, weights, gate, up, down, token_mask=mask,
                                 token_chunk=self.token_chunk)
            return y, jnp.zeros((), jnp.float32)
        y, lost = routed_experts(
            flat, experts, weights, gate, up, down, mesh=mesh, rules=self.rules,
            token_chunk=self.token_chunk, dispatch=self.dispatch,
            capacity_factor=self.capacity_factor, overflow=self.overflow, token_mask=mask,
            token_axes=context.token_axes(mesh) if c > 1 else None)
        return y, jnp.sum(lost, dtype=jnp.float32)

    def route_tile(self, h: jax.Array):
        """The router on one row tile under ``numerics="invariant"`` (called by
        ``models.invariant.row_tiled``): ``h [t, H]`` normed hidden states ->
        ``(probs [t, E] float32, weights [t, k] float32, experts [t, k] int32)``, each row
        a function of its own token (``models.moe.invariant.router_logits``, ``route``)."""
        dt = self.dtype
        return route(router_logits(h.astype(dt), self.router[...].astype(dt)), self.top_k,
                     self.norm_topk_prob)

    def residual_block(self, x: jax.Array, h: jax.Array, weights: jax.Array,
                       experts: jax.Array, token_mask: jax.Array, *,
                       split_tokens: bool = False) -> jax.Array:
        """``x + MoE(h)`` under ``numerics="invariant"``, for the router's choice
        (``route_tile``): the forward in expert-major tiles of one shape, expert-parallel
        on a mesh (``models.moe.invariant``), the gradient the default dropless path's
        with the same experts (``__call__``'s ``dropless_experts`` / ``routed_experts``).

        Args:
          x: ``[B, T, H]`` the residual stream. h: ``[B, T, H]`` normed hidden states.
          weights: float32 ``[B, T, k]``; experts: int32 ``[B, T, k]``.
          token_mask: bool ``[B, T]``: the real tokens (padding adds 0).
          split_tokens: the rows' tokens are split over the mesh's ``context`` axis (the
            trainer's forward).

        Returns:
          ``[B, T, H]`` in the dtype of ``x``.

        Raises:
          ValueError: as ``models.moe.invariant.on_mesh``.
        """
        dt, rules = self.dtype, self.rules
        mesh = jax.sharding.get_abstract_mesh()
        c = context.context_size(mesh) if split_tokens else 1

        def forward(x, h, weights, gate, up, down, experts, mask):
            return on_mesh(x, h, weights, experts, mask, gate, up, down, rules=rules,
                           split_tokens=split_tokens)

        def default(x, h, weights, gate, up, down, experts, mask):
            h, weights, experts, mask = (context.to_token_major(a, c)
                                         for a in (h, weights, experts, mask))
            shape = h.shape
            y, _ = self._experts(h.reshape(-1, shape[-1]), experts.reshape(-1, self.top_k),
                                 weights.reshape(-1, self.top_k), mask.reshape(-1),
                                 gate, up, down, c=c)
            return x + context.from_token_major(y.reshape(shape), c).astype(x.dtype)

        return values_with_gradient_of(forward, default, x, h.astype(dt), weights,
                                       *self._weights(), experts, token_mask)

    def tiled_stats(self, probs: jax.Array, experts: jax.Array, token_mask: jax.Array
                    ) -> RouterStats:
        """After ``tile`` over all rows: the ``RouterStats`` of ``probs [B, T, E]`` over
        the real tokens (``token_mask [B, T]``), as ``__call__``'s (nothing is dropped).
        Inside ``nnx.capture(model, nnx.Intermediate)`` the chosen experts (int32
        ``[B, T, k]``) are sown as ``"experts"``, so the routing of two forwards can be
        compared; elsewhere (the engines' traced loops) nothing is recorded."""
        if hasattr(self, "__captures__"):  # set by nnx.capture for the call (flax 0.12)
            self.sow(nnx.Intermediate, "experts", experts)
        k, e = experts.shape[-1], probs.shape[-1]
        return router_stats(probs.reshape(-1, e), experts.reshape(-1, k),
                            token_mask.reshape(-1), jnp.zeros((), jnp.float32))


def load_balancing_loss(stats: list[RouterStats]) -> jax.Array:
    """Switch-Transformer auxiliary loss over all MoE layers, as transformers computes it.

    With ``f_e`` = top-k assignments to expert ``e`` per counted token and ``P_e`` = mean
    router probability of ``e``, both pooled over the layers:
    ``loss = E * sum_e f_e * P_e`` (equal to top_k when perfectly balanced).

    Args:
      stats: one ``RouterStats`` per MoE layer (non-empty).

    Returns:
      float32 scalar.
    """
    assignments = sum(s.assignments for s in stats)
    probs = sum(s.probs for s in stats)
    tokens = jnp.maximum(sum(s.tokens for s in stats), 1.0)
    return assignments.shape[0] * jnp.sum((assignments / tokens) * (probs / tokens))


def dropped_fraction(stats: list[RouterStats], top_k: int) -> jax.Array:
    """Fraction of the real (token, expert) pairs dropped for capacity, pooled over the
    MoE layers: ``sum dropped / (top_k * sum tokens)`` (0 without a capacity factor).

    Args:
      stats: one ``RouterStats`` per MoE layer (non-empty). top_k: experts per token.

    Returns:
      float32 scalar in ``[0, 1]``.
    """
    pairs = top_k * sum(s.tokens for s in stats)
    return sum(s.dropped for s in stats) / jnp.maximum(pairs, 1.0)
