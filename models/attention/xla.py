"""``"xla_chunked"``: blockwise (flash-style) attention in plain XLA, any backend.

The mask is data, per token, as in ``models.attention.reference``; but where
``dense_attention`` builds it and the scores as whole ``[T, S]`` arrays,
``chunked_attention`` never does: it walks ``[block_q, block_kv]`` tiles with an online
softmax (float32 running max and sum) and recomputes each tile in the backward pass, the
algorithm of FlashAttention (Dao et al., 2022, arXiv:2205.14135) and its FlashAttention-2
backward (Dao, 2023, arXiv:2307.08691), written as ``lax.scan`` loops and a
``jax.custom_vjp``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from models.attention.reference import attention_mask

BLOCK_Q = 512
BLOCK_KV = 512


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                      q_segment_ids: jax.Array, kv_positions: jax.Array,
                      kv_segment_ids: jax.Array, *, scale: float, block_q: int = BLOCK_Q,
                      block_kv: int = BLOCK_KV) -> jax.Array:
    """The same attention as ``models.attention.reference.dense_attention`` with memory
    linear in the length.

    Queries are cut into blocks of ``block_q`` and keys into blocks of ``block_kv``
    (lengths are padded up with segment id 0); each ``[block_q, block_kv]`` tile builds
    its own mask from the tokens' segment ids and positions, and a tile whose mask is all
    False (a key block after the query block, segments that never meet, padding) skips
    its matmuls and exponentials under ``lax.cond``. The backward pass (``jax.custom_vjp``)
    saves only the inputs, the output and the per-row log-sum-exp ``[B, N, T]`` float32,
    and recomputes every tile.

    Args:
      q, k, v, q_positions, q_segment_ids, kv_positions, kv_segment_ids, scale: as
        ``dense_attention``.
      block_q, block_kv: tile sizes (positive ints; clipped to the lengths).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``; differentiable w.r.t. ``q``, ``k``, ``v``.
      A query with no readable key (padding) gets 0 (and passes no gradient), decided by
      the mask; a query that reads a NaN key or value gets NaN, as in ``dense_attention``.

    Raises:
      ValueError: ``N`` not a multiple of ``K``, or non-positive block sizes.
    """
    b, t, n, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if n % kv_heads:
        raise ValueError(f"{n} query heads are not a multiple of {kv_heads} KV heads")
    if block_q <= 0 or block_kv <= 0:
        raise ValueError(f"block sizes must be > 0, got {block_q}, {block_kv}")
    bq, bk = min(block_q, t), min(block_kv, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk

    def pad(x, length):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, length - x.shape[1])
        return jnp.pad(x, widths)

    q5 = pad(q, tp).reshape(b, tp, kv_heads, n // kv_heads, d)
    out = _flash(q5, pad(k, sp), pad(v, sp), pad(q_positions, tp), pad(q_segment_ids, tp),
                 pad(kv_positions, sp), pad(kv_segment_ids, sp), float(scale), bq, bk)
    return out[:, :t].reshape(b, t, n, d)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """``[B, L, ...]`` -> ``[L // size, B, size, ...]`` (the scan axis first)."""
    return jnp.moveaxis(x.reshape(x.shape[0], -1, size, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
    """Inverse of ``_blocks``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _scores(qb, kb, mask, scale):
    """float32 ``[B, K, G, bq, bk]`` scaled logits, -inf where masked."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32)
    return jnp.where(mask[:, None, None], s * scale, -jnp.inf)


def _tie(x, *ids):
    """``ids`` as values that depend on ``x`` (``lax.optimization_barrier``), so that no
    tile mask built from them is invariant in a loop over which ``x`` varies.

    Inside a ``lax.scan`` over layers the positions and segment ids are the same every
    layer; under ``jax.grad``, JAX's scan partial evaluation hoists loop-invariant work
    out of the loop, and for these nested tile loops that would precompute every tile's
    mask (and masked fill) for all ``(query block, key block)`` pairs at once: a
    ``[T / bq, S / bk, ..., bq, bk]`` buffer, quadratic in the length (2 GiB per layer at
    4096 tokens with Qwen3-30B-A3B's 32 heads)."""
    return lax.optimization_barrier((x, *ids))[1:]


def _forward(q, k, v, qpos, qseg, kpos, kseg, scale, bq, bk):
    """Output ``[B, T, K, G, D]`` (dtype of v) and log-sum-exp ``[B, K, G, T]`` float32."""
    qpos, qseg, kpos, kseg = _tie(q, qpos, qseg, kpos, kseg)
    kv_xs = (_blocks(k, bk), _blocks(v, bk), _blocks(kpos, bk), _blocks(kseg, bk))

    def query_block(_, q_xs):
        qb, qp, qs = q_xs
        b, _, kh, g, d = qb.shape
        init = (jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32),
                jnp.zeros((b, kh, g, bq), jnp.float32),
                jnp.zeros((b, kh, g, bq, d), jnp.float32))

        def key_block(carry, xs):
            kb, vb, kp, ks = xs
            mask = attention_mask(qp, qs, kp, ks)
            carry, seen = carry

            def update(carry):
                m, l, acc = carry
                s = _scores(qb, kb, mask, scale)
                m_new = jnp.maximum(m, s.max(-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vb.dtype), vb,
                                preferred_element_type=jnp.float32)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

            carry = lax.cond(mask.any(), update, lambda c: c, carry)
            return (carry, seen | mask.any(-1)), None

        # seen [B, bq]: the query reads some key, decided by the mask (never by the sum,
        # which is NaN when a key or value it reads is NaN: that NaN must stay).
        ((m, l, acc), seen), _ = lax.scan(key_block, (init, jnp.zeros((b, bq), bool)), kv_xs)
        seen = seen[:, None, None, :]
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        return None, (jnp.einsum("bkgqd->bqkgd", out).astype(v.dtype), lse)

    _, (out, lse) = lax.scan(query_block, None,
                             (_blocks(q, bq), _blocks(qpos, bq), _blocks(qseg, bq)))
    return _unblocks(out), jnp.moveaxis(lse, 0, -2).reshape(*lse.shape[1:-1], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, qpos, qseg, kpos, kseg, scale, bq, bk):
    return _forward(q, k, v, qpos, qseg, kpos, kseg, scale, bq, bk)[0]


def _flash_fwd(q, k, v, qpos, qseg, kpos, kseg, scale, bq, bk):
    out, lse = _forward(q, k, v, qpos, qseg, kpos, kseg, scale, bq, bk)
    return out, (q, k, v, qpos, qseg, kpos, kseg, out, lse)


def _flash_bwd(scale, bq, bk, res, dout):
    q, k, v, qpos, qseg, kpos, kseg, out, lse = res
    qpos, qseg, kpos, kseg = _tie(dout, qpos, qseg, kpos, kseg)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", dout.astype(jnp.float32),
                       out.astype(jnp.float32))
    lse_blocks = jnp.moveaxis(lse.reshape(*lse.shape[:-1], -1, bq), -2, 0)
    delta_blocks = jnp.moveaxis(delta.reshape(*delta.shape[:-1], -1, bq), -2, 0)
    q_xs = (_blocks(q, bq), _blocks(dout, bq), _blocks(qpos, bq), _blocks(qseg, bq),
            lse_blocks, delta_blocks)

    def key_block(dq, kv_xs):
        kb, vb, kp, ks = kv_xs
        init = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))

        def query_block(carry, xs):
            qb, dob, qp, qs, lseb, deltab = xs
            mask = attention_mask(qp, qs, kp, ks)

            def grads(carry):
                dk, dv = carry
                p = jnp.exp(_scores(qb, kb, mask, scale) - lseb[..., None])
                dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb,
                                preferred_element_type=jnp.float32)
                ds = (p * (dp - deltab[..., None]) * scale).astype(qb.dtype)
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb,
                                     preferred_element_type=jnp.float32)
                dqb = jnp.einsum("bkgqs,bskd->bqkgd", ds, kb,
                                 preferred_element_type=jnp.float32)
                return (dk, dv), dqb

            def skip(carry):
                return carry, jnp.zeros(qb.shape, jnp.float32)

            return lax.cond(mask.any(), grads, skip, carry)

        (dk, dv), dq_parts = lax.scan(query_block, init, q_xs)
        return dq + dq_parts, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = jnp.zeros((q.shape[1] // bq, q.shape[0], bq, *q.shape[2:]), jnp.float32)
    kv_xs = (_blocks(k, bk), _blocks(v, bk), _blocks(kpos, bk), _blocks(kseg, bk))
    dq, (dk, dv) = lax.scan(key_block, dq0, kv_xs)
    return (_unblocks(dq).astype(q.dtype), _unblocks(dk), _unblocks(dv),
            None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
