"""Grouped-query self-attention (q/k RMSNorm and q/k/v biases optional) with RoPE, for packed
rows and the KV cache.

Masking comes from per-token segment ids and positions: a query attends to a key iff both
are in the same non-zero segment and the key's position is not after the query's. The
attention itself is ``models.attention.api`` (``cfg.attention_impl``): blockwise, with no
``[T, S]`` mask or score buffer, except the ``"dense"`` reference and one-token decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.attention.api import cache_attention, self_attention
from models.attention.paged import paged_attention
from models.cache import LayerKV, PagedLayerKV
from models.config import ModelConfig
from models.layers import RMSNorm, apply_rope, param
from models.mesh import active_mesh
from models.sharding import kv_head_layout, logical_to_mesh


class Attention(nnx.Module):
    """Self-attention block: projections (with biases on q/k/v when ``cfg.qkv_bias``:
    Qwen2), per-head q/k RMSNorm (when ``cfg.qk_norm``: Qwen3), RoPE (with
    ``cfg.rope_scaling``: Llama 3), grouped-query attention, output projection (no bias).

    Parameters: ``q_proj`` ``[H, N, D]`` (axes ``embed, heads, head_dim``), ``k_proj`` /
    ``v_proj`` ``[H, K, D]`` (``embed, kv_heads, head_dim``), ``o_proj`` ``[N, D, H]``
    (``heads, head_dim, embed``); with ``qk_norm`` ``q_norm`` / ``k_norm`` ``[D]``
    (``head_dim``); with ``qkv_bias`` ``q_bias`` ``[N, D]`` (``heads, head_dim``),
    ``k_bias`` / ``v_bias`` ``[K, D]`` (``kv_heads, head_dim``), zeros at init.

    Under a mesh whose tensor axis is wider than the K KV heads (T = r K devices), the K/V
    projections are replicated over it (``models.sharding.kv_head_layout`` says why) and
    each KV head is repeated r times before attention, so shard ``s`` holds head
    ``s // r``, the one its query heads read, and every kernel sees whole heads per
    shard; the KV cache keeps K heads.

    Args:
      cfg: model config. rngs: initialiser keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, n, k, d = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
        self.dtype, self.rope_theta, self.scale = cfg.dtype, cfg.rope_theta, d ** -0.5
        self.rope_scaling, self.qk_norm, self.qkv_bias = (cfg.rope_scaling, cfg.qk_norm,
                                                          cfg.qkv_bias)
        self.rules, self.heads = cfg.sharding_rules, (n, k)
        self.impl = "invariant" if cfg.numerics == "invariant" else cfg.attention_impl
        pd = cfg.param_dtype
        self.q_proj = param(rngs, (h, n, d), ("embed", "heads", "head_dim"), pd)
        self.k_proj = param(rngs, (h, k, d), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = param(rngs, (h, k, d), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = param(rngs, (n, d, h), ("heads", "head_dim", "embed"), pd,
                            in_axes=(0, 1))
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.q_bias = param(rngs, (n, d), ("heads", "head_dim"), pd, init=zeros)
            self.k_bias = param(rngs, (k, d), ("kv_heads", "head_dim"), pd, init=zeros)
            self.v_bias = param(rngs, (k, d), ("kv_heads", "head_dim"), pd, init=zeros)
        if cfg.qk_norm:
            norm = {"eps": cfg.rms_norm_eps, "dtype": cfg.dtype, "param_dtype": pd,
                    "rngs": rngs}
            self.q_norm = RMSNorm(d, "head_dim", **norm)
            self.k_norm = RMSNorm(d, "head_dim", **norm)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 kv: LayerKV | PagedLayerKV | None = None
                 ) -> tuple[jax.Array, LayerKV | PagedLayerKV | None]:
        """Attend within segments, or over the cache.

        Args:
          x: ``[B, T, H]`` normed hidden states.
          positions: int ``[B, T]`` (RoPE and causality).
          segment_ids: int ``[B, T]``, 0 = padding.
          kv: None for a plain (training / scoring) forward; otherwise this layer's cache
            view: the new keys/values are written at ``kv.index`` and the queries read
            every cache slot (masked by ``kv.positions`` / ``kv.segment_ids``); or a
            ``PagedLayerKV`` for a one-token decode step (T = 1): the new key and value
            are written at the row's slot and the query reads the row's written slots
            (``models.attention.paged``; ``impl="dense"`` there when ``attention_impl``
            is ``"dense"``).

        Returns:
          ``(y [B, T, H] compute dtype, updated kv or None)``.

        Raises:
          ValueError: a mesh whose tensor axis is wider than the KV heads but not a multiple
            of them, or not dividing the query heads (``kv_head_layout``).
        """
        q, k, v = self.project(x, positions)
        out, kv = self.attend(q, k, v, positions, segment_ids, kv)
        return self.output(out), kv

    def project(self, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(q [..., N, D], k [..., K, D], v [..., K, D])`` of ``x`` ``[..., H]`` at
        ``positions`` int ``[...]``: projections, biases, q/k norms, RoPE (compute dtype).
        Per token: ``numerics="invariant"`` runs it in row tiles (``models.invariant``)."""
        dt = self.dtype
        x = x.astype(dt)
        q = jnp.einsum("...h,hnd->...nd", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("...h,hkd->...kd", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("...h,hkd->...kd", x, self.v_proj[...].astype(dt))
        if self.qkv_bias:
            q, k, v = (y + b[...].astype(dt) for y, b in
                       ((q, self.q_bias), (k, self.k_bias), (v, self.v_bias)))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        q = apply_rope(q, positions, self.rope_theta, scaling)
        k = apply_rope(k, positions, self.rope_theta, scaling)
        return q, k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The output projection: ``[..., N, D]`` -> ``[..., H]`` (per token)."""
        return jnp.einsum("...nd,ndh->...h", out, self.o_proj[...].astype(self.dtype))

    def attend(self, q, k, v, positions, segment_ids, kv=None):
        """``(out [B, T, N, D], kv)``: the attention of ``project``'s ``q``, ``k``, ``v``
        ``[B, T, ...]`` (see ``__call__``). Without a cache the tokens attend to each
        other; with one, the cache's view writes them and calls back the read its kind
        of cache needs (``kv.attend``: ``over_cache`` or ``over_pages``)."""
        if kv is not None:
            return kv.attend(q, k, v, self, positions, segment_ids)
        mesh = active_mesh()
        k, v = (_per_shard(x, self._replicas(mesh), mesh, self.rules) for x in (k, v))
        return self_attention(q, k, v, positions, segment_ids, scale=self.scale,
                              impl=self.impl), None

    def over_cache(self, q, kv, positions, segment_ids):
        """``[B, T, N, D]``: ``q`` (at ``positions`` / ``segment_ids`` ``[B, T]``) over a
        dense cache's written slots (``kv`` a ``models.cache.LayerKV`` with the new tokens
        written)."""
        mesh = active_mesh()
        r = self._replicas(mesh)
        keys, values = (_per_shard(x, r, mesh, self.rules) for x in (kv.keys, kv.values))
        return cache_attention(q, keys, values, positions, segment_ids, kv.positions,
                               kv.segment_ids, scale=self.scale, impl=self.impl)

    def over_pages(self, q, kv):
        """``[R, N, D]``: each row's new token ``q`` over its written pages (``kv`` a
        ``models.cache.PagedLayerKV`` with the new token written; its slots are its
        positions)."""
        return paged_attention(q, kv.keys, kv.values, kv.block_tables, kv.slots,
                               scale=self.scale,
                               impl=self.impl if self.impl in ("dense", "invariant")
                               else "auto")

    def _replicas(self, mesh) -> int:
        """How many times each K/V head repeats over the mesh's ``kv_heads`` axes."""
        return 1 if mesh is None else kv_head_layout(*self.heads, mesh, self.rules)


def _per_shard(x: jax.Array, r: int, mesh, rules) -> jax.Array:
    """``x`` ``[B, S, K, D]`` with each head repeated ``r`` times, the ``r K`` heads split
    over the mesh axes of ``"kv_heads"``. Without the constraint on ``x`` (whole heads on
    every shard) the partitioner reshards the replicated K/V weights through a full
    rematerialisation."""
    if r == 1:
        return x
    u = P.UNCONSTRAINED
    heads = logical_to_mesh((None, None, "kv_heads", None), mesh, rules)[2]
    x = jax.lax.with_sharding_constraint(x, P(u, u, None, u))
    return jax.lax.with_sharding_constraint(jnp.repeat(x, r, axis=2), P(u, u, heads, u))
