"""``"pallas_gpu"``: JAX's Pallas GPU (Triton) FlashAttention kernel, wrapped for packed
rows with GQA.

Masks by index, not position: the inputs must satisfy ``models.attention.base``'s
packing precondition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention.base import block_size


def pallas_gpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                         *, scale: float, block: int = 128, interpret: bool = False
                         ) -> jax.Array:
    """Causal self-attention of packed rows through JAX's Pallas GPU (Triton) attention
    kernel (``jax.experimental.pallas.ops.gpu.attention.mha``: FlashAttention-2 forward
    and backward with ``segment_ids``).

    The kernel reads one KV head per query head, so K and V are repeated ``N // K``
    times (linear memory; their gradients are summed back by autodiff).

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, T, K, D]``; compute dtype.
      segment_ids: int ``[B, T]`` (0 = padding); positions must satisfy
        ``models.attention.base.check_packing``.
      scale: logit scale. block: forward tile size (the backward uses 32).
      interpret: run in Pallas interpret mode (CPU tests).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``; differentiable w.r.t. ``q``, ``k``, ``v``.

    Raises:
      KernelUnsupported: T not a multiple of the tile size, or not of 32.
    """
    from jax.experimental.pallas.ops.gpu import attention as ga

    t, n, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    size = block_size(t, block, 32, "Pallas GPU attention")
    sizes = ga.BlockSizes(block_q=size, block_k=size, block_q_dkv=32, block_kv_dkv=32,
                          block_q_dq=32, block_kv_dq=32)
    k, v = (jnp.repeat(x, n // kv_heads, axis=2) for x in (k, v))
    out = ga.mha(q, k, v, segment_ids.astype(jnp.int32), sm_scale=float(scale), causal=True,
                 block_sizes=sizes, interpret=interpret)
    return out.astype(v.dtype)
