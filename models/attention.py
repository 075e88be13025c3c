"""Grouped-query self-attention with q/k RMSNorm and RoPE, for packed rows and the KV cache.

Masking is built inside the graph from per-token segment ids and positions: a query
attends to a key iff both are in the same non-zero segment and the key's position is not
after the query's. No ``[B, 1, S, S]`` mask is ever passed in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.cache import LayerKV, write_kv
from models.config import ModelConfig
from models.layers import RMSNorm, apply_rope, param


def attention_mask(q_positions: jax.Array, q_segment_ids: jax.Array, kv_positions: jax.Array,
                   kv_segment_ids: jax.Array) -> jax.Array:
    """bool ``[B, T, S]``: query ``t`` may read key ``s``.

    True iff ``q_segment_ids[t] == kv_segment_ids[s] != 0`` and
    ``kv_positions[s] <= q_positions[t]`` (causal within the segment; positions must
    increase within a segment). Segment id 0 (padding, empty cache slots) reads and is
    read by nothing.

    Args:
      q_positions, q_segment_ids: int ``[B, T]``.
      kv_positions, kv_segment_ids: int ``[B, S]``.
    """
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]
    return same & causal & (q_segment_ids[:, :, None] != 0)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                          scale: float) -> jax.Array:
    """Softmax attention with grouped KV heads; logits and softmax in float32.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]`` with ``N % K == 0`` (query head ``n``
        reads KV head ``n // (N // K)``); all in the compute dtype.
      mask: bool ``[B, T, S]``. A query with no readable key (padding) gets the mean of
        the values: finite, and ignored by every loss.
      scale: multiplies the logits (``D ** -0.5``).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``.
    """
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, None, None], logits * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, d).astype(v.dtype)


class Attention(nnx.Module):
    """Qwen3 self-attention block (no biases): projections, per-head q/k RMSNorm, RoPE,
    grouped-query attention, output projection.

    Parameters: ``q_proj`` ``[H, N, D]`` (axes ``embed, heads, head_dim``), ``k_proj`` /
    ``v_proj`` ``[H, K, D]`` (``embed, kv_heads, head_dim``), ``o_proj`` ``[N, D, H]``
    (``heads, head_dim, embed``), ``q_norm`` / ``k_norm`` ``[D]`` (``head_dim``).

    Args:
      cfg: model config. rngs: initialiser keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, n, k, d = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
        self.dtype, self.rope_theta, self.scale = cfg.dtype, cfg.rope_theta, d ** -0.5
        pd = cfg.param_dtype
        self.q_proj = param(rngs, (h, n, d), ("embed", "heads", "head_dim"), pd)
        self.k_proj = param(rngs, (h, k, d), ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = param(rngs, (h, k, d), ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = param(rngs, (n, d, h), ("heads", "head_dim", "embed"), pd,
                            in_axes=(0, 1))
        norm = {"eps": cfg.rms_norm_eps, "dtype": cfg.dtype, "param_dtype": pd, "rngs": rngs}
        self.q_norm = RMSNorm(d, "head_dim", **norm)
        self.k_norm = RMSNorm(d, "head_dim", **norm)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 kv: LayerKV | None = None) -> tuple[jax.Array, LayerKV | None]:
        """Attend within segments, or over the cache.

        Args:
          x: ``[B, T, H]`` normed hidden states.
          positions: int ``[B, T]`` (RoPE and causality).
          segment_ids: int ``[B, T]``, 0 = padding.
          kv: None for a plain (training / scoring) forward; otherwise this layer's cache
            view: the new keys/values are written at ``kv.index`` and the queries read
            every cache slot (masked by ``kv.positions`` / ``kv.segment_ids``).

        Returns:
          ``(y [B, T, H] compute dtype, updated kv or None)``.
        """
        dt = self.dtype
        x = x.astype(dt)
        q = jnp.einsum("bth,hnd->btnd", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("bth,hkd->btkd", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("bth,hkd->btkd", x, self.v_proj[...].astype(dt))
        q = apply_rope(self.q_norm(q), positions, self.rope_theta)
        k = apply_rope(self.k_norm(k), positions, self.rope_theta)
        if kv is None:
            mask = attention_mask(positions, segment_ids, positions, segment_ids)
        else:
            kv = write_kv(kv, k, v)
            k, v = kv.keys, kv.values
            mask = attention_mask(positions, segment_ids, kv.positions, kv.segment_ids)
        out = dot_product_attention(q, k, v, mask, self.scale)
        return jnp.einsum("btnd,ndh->bth", out, self.o_proj[...].astype(dt)), kv
