"""``Transformer``: the Qwen3 / Qwen3-MoE decoder, and by ``ModelConfig`` flags the Qwen2 and
Llama 3 ones. It returns final-normed hidden states; the LM head is ``jaxhead.LMHead``
(float32 log-probs and entropy of kept tokens)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxhead
from models import context
from models.attention.api import REGISTRY as ATTENTION
from models.attention.layer import Attention
from models.cache import KVCache, PagedKVCache, init_cache
from models.config import ModelConfig
from models.invariant import check_config as check_numerics
from models.invariant import check_mesh, head_logprobs, row_tiled
from models.layers import MLP, RMSNorm, embedding
from models.lookup import embed_lookup
from models.mesh import active_mesh, axis_size
from models.moe.api import REGISTRY as EXPERT_DISPATCH
from models.moe.api import check_capacity_factor, check_overflow, check_token_chunk
from models.moe.layer import MoE, RouterStats, dropped_fraction, load_balancing_loss
from models.scan import REMAT_POLICIES, layer_at, name_layer_input, scan_layers, stack_modules


class DecoderOutput(NamedTuple):
    """Result of ``Transformer.__call__``.

    Attributes:
      hidden: ``[B, T, H]`` final-normed hidden states in the compute dtype (feed them to
        ``Transformer.token_logprobs`` / ``model.lm_head`` / ``Transformer.logits``).
      cache: the updated ``KVCache`` (None when no cache was given).
      aux_loss: float32 scalar load-balancing loss over the MoE layers (0 for a dense
        model); weight it with ``cfg.router_aux_loss_coef`` if the trainer uses it.
      dropped_fraction: float32 scalar: the fraction of the real (token, expert) pairs
        the MoE layers dropped for capacity (``models.moe.layer.dropped_fraction``; 0 for a
        dense model and without ``cfg.expert_capacity_factor``).
      routes: int32 ``[B, T, M, k]``: the experts each token used at each of the M MoE
        layers (in layer order; k = ``cfg.num_experts_per_tok``): what the rollout
        engines record for routing replay. None for a dense model and under
        ``numerics="invariant"``.
    """

    hidden: jax.Array
    cache: KVCache | None
    aux_loss: jax.Array
    dropped_fraction: jax.Array
    routes: jax.Array | None = None


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` where the MLP is
    the SwiGLU ``MLP`` or, on sparse layers (``cfg.is_moe_layer(layer)``), the ``MoE``.

    Args:
      cfg: model config. layer: 0-based index. rngs: initialiser keys.
    """

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        norm = {"eps": cfg.rms_norm_eps, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype,
                    "rngs": rngs}
        self.input_layernorm = RMSNorm(cfg.hidden_size, "embed", **norm)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, "embed", **norm)
        self.invariant = cfg.numerics == "invariant"
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype, rngs=rngs)

    def __call__(self, x, positions, segment_ids, kv=None, replay=None, *,
                 with_experts: bool = False):
        """``x`` ``[B, T, H]`` -> ``(x, kv, RouterStats | None)``; see ``Attention``.
        ``replay``: None, or int32 ``[B, T, k]`` experts the MoE uses instead of its top-k
        (routing replay, ``models.moe.layer.replay_route``). ``with_experts``: also return
        the experts ``[B, T, k]`` the MoE used (None on a dense layer).
        Under ``numerics="invariant"`` everything but the attention runs in row tiles
        (``models.invariant.row_tiled``), the MoE block's router too (``MoE.route_tile``);
        its experts run in expert-major tiles (``MoE.residual_block``)."""
        if self.invariant:
            *out, experts = self._invariant(x, positions, segment_ids, kv)
            return (*out, experts) if with_experts else tuple(out)
        attn, kv = self.self_attn(self.input_layernorm(x), positions, segment_ids, kv)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            # training and scoring (no cache): a row's tokens may be split over context
            out, stats, experts = self.mlp(h, segment_ids != 0, split_tokens=kv is None,
                                           replay=replay, with_experts=True)
        else:
            out, stats, experts = self.mlp(h), None, None
        return (x + out, kv, stats) + ((experts,) if with_experts else ())

    def _invariant(self, x, positions, segment_ids, kv):
        moe = isinstance(self.mlp, MoE)

        def pre(layer, x, p):
            return layer.self_attn.project(layer.input_layernorm(x), p)

        def post(layer, x, a):
            x = x + layer.self_attn.output(a)
            h = layer.post_attention_layernorm(x)
            if moe:  # the router on the tile (models.moe.invariant)
                return x, h, *layer.mlp.route_tile(h)
            return x + layer.mlp(h)

        split = kv is None  # training: a row's tokens may be split over context
        q, k, v = row_tiled(pre, x, positions, split_tokens=split, modules=(self,))
        out, kv = self.self_attn.attend(q, k, v, positions, segment_ids, kv)
        real = segment_ids != 0
        if not moe:
            x = row_tiled(post, x, out, split_tokens=split, modules=(self,))
            return x, kv, None, None
        x, h, probs, weights, experts = row_tiled(post, x, out, split_tokens=split,
                                                  modules=(self,))
        # the experts in expert-major tiles, the combine on the row tiles
        x = self.mlp.residual_block(x, h, weights, experts, real, split_tokens=split)
        return x, kv, self.mlp.tiled_stats(probs, experts, real), experts


def check_ops(cfg: ModelConfig) -> None:
    """Check ``cfg``'s op choices against the ops, where the model is built: the
    attention and expert-dispatch names against their registries (``models.attention.api
    .REGISTRY``, ``models.moe.api.REGISTRY``), the capacity factor, overflow and token
    chunk against ``models.moe.api``'s rules (checked for a dense config too: a typo in a
    config is an error whatever the model), ``numerics`` and what its ``"invariant"``
    mode cannot run (``models.invariant.check_config``).

    Raises:
      ValueError: the offending field and value named (with the choices for a name).
    """
    ATTENTION.check_name(cfg.attention_impl)
    EXPERT_DISPATCH.check_name(cfg.expert_dispatch)
    check_capacity_factor(cfg.expert_capacity_factor)
    check_overflow(cfg.expert_capacity_overflow)
    check_token_chunk(cfg.moe_token_chunk)
    check_numerics(cfg)


def moe_layers(cfg: ModelConfig) -> int:
    """M, the number of MoE layers of ``cfg`` (0 for a dense model): the third axis of
    ``DecoderOutput.routes``."""
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def check_routes(cfg: ModelConfig, routes, shape) -> None:
    """Check replayed ``routes`` for tokens of ``shape`` ``[B, T]`` (``Transformer``).

    Raises:
      ValueError: a dense model (no router to replay), ``numerics="invariant"`` (its
        routing agrees by construction), ``routes`` not an integer array
        ``[B, T, M, k]`` (M = ``moe_layers(cfg)``, k = ``cfg.num_experts_per_tok``), the
        values named.
    """
    if not cfg.is_moe:
        raise ValueError("routing replay needs an MoE model; this one is dense "
                         "(num_experts = 0)")
    if cfg.numerics == "invariant":
        raise ValueError("routing replay is for the default numerics; numerics='invariant' "
                         "makes the trainer's routing the sampler's by construction")
    want = (*shape, moe_layers(cfg), cfg.num_experts_per_tok)
    if tuple(routes.shape) != want or not jnp.issubdtype(routes.dtype, jnp.integer):
        raise ValueError(f"routes must be an int array [B, T, MoE layers, top_k] = "
                         f"{list(want)}, got {routes.dtype} {list(routes.shape)}")


def head_rows(x, mesh):
    """``x [B, S, ...]`` laid out as the head's rows under ``mesh``, as
    ``Transformer.token_logprobs`` feeds them to the sharded head: with context
    parallelism (``C > 1`` devices on ``context``) each row's tokens in ``models.context``'s
    load-balanced order, then token-major, ``[C * B, S / C, ...]`` (split over
    ``models.context.token_axes``); else ``x`` itself. The one statement of that layout:
    a trainer's bucket reads its keep mask through it (``head_bucket``), so the bucket
    and the head cannot disagree.

    Raises:
      ValueError: ``S`` not a multiple of ``2 C`` (``models.context.balance_order``).
    """
    c = context.context_size(mesh)
    return context.to_token_major(context.balance(x, c), c)


def from_head_rows(x, mesh):
    """The inverse of ``head_rows``: the head's rows back to ``[B, S, ...]`` in token
    order."""
    c = context.context_size(mesh)
    return context.unbalance(context.from_token_major(x, c), c)


def head_bucket(keep, mesh, multiple: int = 128) -> int:
    """The static ``bucket`` ``Transformer.token_logprobs`` needs on ``mesh`` (default
    ``token_axes``) for a concrete bool ``keep [B, S]``: ``jaxhead.bucket_for_shards`` of
    the fullest of the head's token shards, its rows laid out by ``head_rows``.

    Raises:
      ValueError: as ``head_rows`` and ``jaxhead.bucket_for_shards``.
    """
    rows = np.asarray(head_rows(np.asarray(keep), mesh))
    shards = axis_size(mesh, context.token_axes(mesh))
    return jaxhead.bucket_for_shards(rows, shards, multiple=multiple)


def _call_layer(layer: DecoderLayer, x, positions, segment_ids, replay):
    return layer(name_layer_input(x), positions, segment_ids, None, replay,
                 with_experts=True)


class Transformer(nnx.Module):
    """Qwen3 (dense) / Qwen3-MoE decoder with a jaxhead LM head (Qwen2 and Llama 3 by the
    config's ``qk_norm`` / ``qkv_bias`` / ``rope_scaling``).

    Attributes (parameter tree, Hugging Face-like names): ``embed_tokens`` (``nnx.Embed``
    ``[V, H]``), ``layers[i]`` (``DecoderLayer``; with ``cfg.scan_layers`` one
    ``DecoderLayer`` whose parameters are stacked on a leading ``[L]`` axis, see
    ``models.scan``), ``norm``, ``lm_head``
    (``jaxhead.LMHead``: ties to ``embed_tokens`` when ``cfg.tie_word_embeddings``, else
    owns an ``[H, V]`` kernel; soft-cap ``cfg.final_logit_softcapping``).

    Args:
      cfg: the architecture and dtype policy.
      rngs: initialiser keys (``nnx.Rngs(seed)``).

    Raises:
      ValueError: an op choice of ``cfg`` its op does not have (``check_ops``).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        check_ops(cfg)
        self.cfg = cfg
        self.embed_tokens = embedding(cfg, rngs)
        layers = [DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)]
        self.layers = stack_modules(layers) if cfg.scan_layers else nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, "embed", eps=cfg.rms_norm_eps, dtype=cfg.dtype,
                            param_dtype=cfg.param_dtype, rngs=rngs)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.invariant = cfg.numerics == "invariant"
        self.lm_head = jaxhead.LMHead(
            cfg.hidden_size, cfg.vocab_size, rngs=rngs, tied_embedding=tied,
            softcap=cfg.final_logit_softcapping, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
        )

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 cache: KVCache | PagedKVCache | None = None, *,
                 routes: jax.Array | None = None) -> DecoderOutput:
        """Run the decoder.

        Training / scoring (``cache=None``): rows may pack several sequences; token ``t``
        attends to the tokens of its own segment whose position is <= its own.

        Prefill / decode (``cache`` from ``init_cache``): the T new tokens are written at
        slots ``[cache.index, cache.index + T)`` and attend to every cache slot of their
        segment with position <= theirs; the returned cache has ``index + T``. Prefill is
        the call with the prompt (T = prompt length, right-padded rows with segment id 0
        on padding), a decode step the call with T = 1.

        Paged decode (``cache`` a ``models.cache.PagedKVCache``, T = 1): each row's token
        is written at its ``slots`` entry (its position) and attends to the row's slots
        ``[0, slots]``; ``positions`` must equal ``slots`` (segment ids are not read).

        Args:
          tokens: int ``[B, T]`` token ids in ``[0, V)``.
          positions: int ``[B, T]``: position of each token within its own sequence
            (``0, 1, ...`` from each segment start; for decoding, the sequence's length so
            far).
          segment_ids: int ``[B, T]``: a positive id per packed sequence, 0 = padding.
          cache: optional ``KVCache`` or ``PagedKVCache``.
          routes: None, or int32 ``[B, T, M, k]`` (``DecoderOutput.routes``' layout):
            routing replay, each MoE layer uses these experts instead of its own top-k
            (``models.moe.layer.replay_route``; a token whose entry is ``-1`` takes its
            own).

        Returns:
          ``DecoderOutput(hidden [B, T, H] compute dtype, cache, aux_loss,
          dropped_fraction, routes)``.

        Raises:
          ValueError: ``tokens``, ``positions`` and ``segment_ids`` shapes differ or are
            not 2-D; the T new tokens do not fit in the cache's free slots (checked
            eagerly; under ``jit`` the hidden states come out NaN instead); a paged cache
            with T != 1; ``routes`` for a dense model, under ``numerics="invariant"`` or
            not of shape ``[B, T, M, k]`` (``check_routes``).
        """
        shapes = {tuple(a.shape) for a in (tokens, positions, segment_ids)}
        if len(shapes) != 1 or len(tokens.shape) != 2:
            raise ValueError(
                f"tokens, positions, segment_ids must share one [B, T] shape, got "
                f"{tokens.shape}, {positions.shape}, {segment_ids.shape}"
            )
        if routes is not None:
            check_routes(self.cfg, routes, tokens.shape)
        overflow = None
        if cache is not None:
            cache, overflow = cache.begin(positions, segment_ids)
        # gathered in param_dtype; training's gradient is formed shard by shard
        x = embed_lookup(self.embed_tokens.embedding[...], tokens,
                         rules=self.cfg.sharding_rules, split_tokens=cache is None)
        x = x.astype(self.cfg.dtype)
        if self.invariant:
            check_mesh(active_mesh())
        if cache is None:  # a row's tokens split over context, if the mesh has one
            x = context.constrain_tokens(x, active_mesh())
        if cache is None and self.cfg.scan_layers:
            x, stats, used = self._scan(x, positions, segment_ids, routes)
        else:
            x, cache, stats, used = self._loop(x, positions, segment_ids, cache, routes)
        zero = jnp.zeros((), jnp.float32)
        aux = load_balancing_loss(stats) if stats else zero
        dropped = dropped_fraction(stats, self.cfg.num_experts_per_tok) if stats else zero
        hidden = (row_tiled(lambda norm, x: norm(x), x, split_tokens=cache is None,
                            modules=(self.norm,)) if self.invariant else self.norm(x))
        if overflow is not None:  # traced index past the cache: NaN, never a wrong value
            hidden = jnp.where(overflow, jnp.nan, hidden)
        used = None if not used else jnp.stack(used, axis=2)  # [B, T, M, k]
        return DecoderOutput(hidden, cache, aux, dropped, used)

    def _scan(self, x, positions, segment_ids, routes):
        """The stacked layers over ``x`` ``[B, T, H]`` with ``jax.lax.scan``. Returns
        ``(x, router statistics summed over the layers (one entry, or none for a dense
        model), each layer's experts [B, T, k] (none for a dense model))``."""
        policy = self.cfg.remat_policy if self.cfg.remat else "full"

        def body(layer, carry):
            x, i = carry
            replay = None if routes is None else jax.lax.dynamic_index_in_dim(
                routes, i, axis=2, keepdims=False)
            x, _, layer_stats, experts = layer(x, positions, segment_ids, None, replay,
                                               with_experts=True)
            return (x, i + 1), (layer_stats, experts)

        (x, _), (stats, experts) = scan_layers(self.layers, body, (x, jnp.int32(0)),
                                               policy=policy)
        if stats is None:
            return x, [], []
        return x, [RouterStats(*(s.sum(0) for s in stats))], list(experts)

    def _loop(self, x, positions, segment_ids, cache, routes):
        """The layers one by one (unrolled); with a ``cache``, each layer writes its keys
        and values. Returns ``(x, cache with the new keys / values, router stats, the
        experts [B, T, k] of each MoE layer)``."""
        policy = REMAT_POLICIES[self.cfg.remat_policy] if self.cfg.remat else None
        keys, values, stats, used = [], [], [], []
        for i in range(self.cfg.num_hidden_layers):
            layer = layer_at(self.layers, i) if self.cfg.scan_layers else self.layers[i]
            kv = None if cache is None else cache.layer(i)
            replay = None if routes is None else routes[:, :, len(used)]
            if policy is not None and kv is None:
                x, _, layer_stats, experts = nnx.remat(_call_layer, policy=policy)(
                    layer, x, positions, segment_ids, replay)
            else:
                x, kv, layer_stats, experts = layer(x, positions, segment_ids, kv, replay,
                                                    with_experts=True)
            if kv is not None:
                keys.append(kv.keys)
                values.append(kv.values)
            if layer_stats is not None:
                stats.append(layer_stats)
            if experts is not None:
                used.append(experts)
        if cache is not None:
            cache = cache.end(keys, values, x.shape[1])
        return x, cache, stats, used

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty ``KVCache`` of ``max_len`` slots per row (``models.cache.init_cache``)."""
        return init_cache(self.cfg, batch, max_len)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Full float32 logits ``[..., V]`` of ``hidden`` ``[..., H]`` (soft-capped, for
        sampling and debugging; training reads ``token_logprobs``)."""
        return self.lm_head.logits(hidden)

    def token_logprobs(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        labels: jax.Array,
        keep: jax.Array | None = None,
        *,
        temperature=1.0,
        with_entropy: bool = True,
        bucket: int | None = None,
        token_axes: tuple[str, ...] | None = None,
        min_logit: jax.Array | None = None,
        routes: jax.Array | None = None,
    ) -> tuple[jaxhead.HeadOutput, DecoderOutput]:
        """Decoder forward, then the jaxhead head on the kept tokens: the one function
        through which the trainer reads every log-prob of the model.

        Under a mesh with a ``context`` axis of ``C > 1`` devices, each row's tokens are
        reordered for causal load balance before the decoder and the head's outputs put
        back in token order (``models.context``): the results are those of one device.
        ``S`` must then be a multiple of ``2 C``.

        On one device (no mesh set, or a one-device mesh) the head is ``self.lm_head``
        (``jaxhead.token_logprobs``). Traced under a multi-device mesh (``jax.set_mesh``,
        e.g. ``models.jit_sharded``) it is ``self.lm_head.sharded``: the tokens split over
        ``token_axes`` and each shard compacts its own kept tokens into ``bucket`` slots
        (``jaxhead.bucket_for_shards`` picks it on the host). Under ``numerics=
        "invariant"`` it is ``models.invariant.head_logprobs``, the sampler's, on one
        device or per shard (a shard: its rows' ``S / C`` tokens; ``token_axes`` unused).

        Args:
          tokens, positions, segment_ids: int ``[B, S]`` (see ``__call__``).
          labels: int ``[B, S]``: the next token of each position, e.g. from
            ``jaxhead.next_token_labels(tokens, segment_ids)``.
          keep: bool ``[B, S]`` tokens any loss reads (``jaxhead.keep_mask``); None: all
            (then every label must be in ``[0, V)``).
          temperature, with_entropy, bucket: see ``jaxhead.token_logprobs``.
          min_logit: None, or float32 ``[B, S]``: per position, the truncated sampling
            support each label was drawn from (``jaxhead.token_logprobs``'s
            ``min_logit``; ``-inf``: untruncated).
          routes: None, or int32 ``[B, S, M, k]``: routing replay (``__call__``).
          token_axes: mesh axes the head's rows are split over under a mesh (default:
            ``models.context.token_axes``: the batch axes, with context parallelism
            ``context`` first, the head's rows then token-major); ignored on one device.

        Returns:
          ``(HeadOutput(logprobs, entropy) float32 [B, S], DecoderOutput)``: log-probs
          and entropy 0 where not kept; the decoder's output (its ``aux_loss`` and
          ``dropped_fraction``).

        Raises:
          ValueError / TypeError: as ``jaxhead.token_logprobs`` and ``__call__``.
        """
        mesh = active_mesh()
        if self.invariant and mesh is None:  # the sampler's tiles (head_logprobs)
            out = self(tokens, positions, segment_ids, routes=routes)
            head = head_logprobs(self.lm_head, out.hidden, labels, keep,
                                 temperature=temperature, bucket=bucket,
                                 with_entropy=with_entropy, min_logit=min_logit)
            return head, out
        if mesh is None:
            out = self(tokens, positions, segment_ids, routes=routes)
            head = self.lm_head(out.hidden, labels, keep, temperature=temperature,
                                with_entropy=with_entropy, bucket=bucket, min_logit=min_logit)
            return head, out
        # context parallelism: tokens in load-balanced order through the decoder, the head
        # on token-major rows (head_rows), its outputs back in token order (models.context)
        c = context.context_size(mesh)

        def to_head(x):
            return None if x is None else head_rows(x, mesh)

        tokens, positions, segment_ids = (
            context.constrain_tokens(context.balance(x, c), mesh)
            for x in (tokens, positions, segment_ids))
        if routes is not None:
            routes = context.constrain_tokens(context.balance(routes, c), mesh)
        out = self(tokens, positions, segment_ids, routes=routes)
        if out.routes is not None:  # back in token order, as the caller's routes
            out = out._replace(routes=context.unbalance(out.routes, c))
        if self.invariant:  # each device its own [B, S / C] block, on the sampler's tiles
            def balanced(x):
                return None if x is None else context.balance(jnp.asarray(x), c)

            if jnp.ndim(temperature) == 2:
                temperature = balanced(temperature)
            head = head_logprobs(self.lm_head, out.hidden, balanced(labels), balanced(keep),
                                 temperature=temperature, bucket=bucket,
                                 with_entropy=with_entropy, min_logit=balanced(min_logit),
                                 split_tokens=True)
            return jax.tree.map(lambda x: context.unbalance(x, c), head), out
        if jnp.ndim(temperature) == 2:
            temperature = to_head(jnp.asarray(temperature))
        axes = context.token_axes(mesh) if token_axes is None else tuple(token_axes)
        head = self.lm_head.sharded(
            context.to_token_major(out.hidden, c), to_head(labels), to_head(keep),
            token_axes=axes, temperature=temperature, with_entropy=with_entropy,
            bucket=bucket, min_logit=to_head(min_logit))
        head = jax.tree.map(lambda x: from_head_rows(x, mesh), head)
        return head, out
