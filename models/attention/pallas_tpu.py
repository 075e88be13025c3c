"""``"splash"``: JAX's TPU splash attention kernel, wrapped for packed rows with GQA.

Masks by index, not position: the inputs must satisfy ``models.attention.base``'s
packing precondition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention.base import block_size


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     scale: float, block: int = 512, interpret=False) -> jax.Array:
    """Causal self-attention of packed rows through JAX's TPU splash attention kernel
    (``jax.experimental.pallas.ops.tpu.splash_attention``: block-sparse FlashAttention
    with a static causal mask and dynamic ``SegmentIds``).

    GQA runs the kernel's multi-query form once per KV head (``vmap`` over KV heads and
    over the batch), so K/V are never repeated.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, T, K, D]`` (``N % K == 0``); compute dtype.
      segment_ids: int ``[B, T]`` (0 = padding); positions must satisfy
        ``models.attention.base.check_packing``.
      scale: logit scale, folded into ``q``.
      block: tile size along both sequence axes (clipped to T).
      interpret: passed to the kernel (False on TPU; ``True`` or a
        ``pltpu.InterpretParams`` to run it on CPU).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``; differentiable w.r.t. ``q``, ``k``, ``v``.

    Raises:
      KernelUnsupported: T not a multiple of the block, or the block not a multiple of 128.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    size = block_size(t, block, 128, "splash attention")
    groups = n // kv_heads
    mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * groups)
    sizes = sk.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size,
                          block_q_dkv=size, block_kv_dkv=size, block_kv_dkv_compute=size,
                          block_q_dq=size, block_kv_dq=size)
    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)

    def one(qh, kh, vh, seg):  # qh [G, T, D], kh / vh [T, D], seg [T]
        return kernel(qh, kh, vh, segment_ids=sk.SegmentIds(q=seg, kv=seg))

    qs = (q * jnp.asarray(scale, q.dtype)).reshape(b, t, kv_heads, groups, d)
    qs = jnp.transpose(qs, (0, 2, 3, 1, 4))          # [B, K, G, T, D]
    ks, vs = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(qs, ks, vs, segment_ids.astype(jnp.int32))
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, d).astype(v.dtype)
