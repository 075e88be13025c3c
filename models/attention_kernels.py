"""Fused attention kernels that ship with JAX, wrapped for packed rows with GQA.

Both kernels mask causally **by index** within a row and by segment-id equality; the
model masks by **position** (``models.attention_xla.attention_mask``). The two agree when,
within every non-zero segment of a row, positions strictly increase with the index (e.g.
contiguous segments whose positions restart at 0 and grow by 1: what the trainer's
packing and ``Transformer`` prefill produce). ``check_packing`` asserts it on concrete
inputs; under ``jit`` the inputs are traced and the precondition is the caller's.
Padding (segment id 0) reads earlier padding here (finite, read by no loss) instead of
nothing as in the XLA paths; real tokens never read padding in either.

Shapes not supported by a kernel raise ``KernelUnsupported`` (``models.attention_ops``
falls back to the XLA path under ``impl="auto"`` and logs it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxhead.dispatch import KernelUnsupported


def check_packing(positions: jax.Array, segment_ids: jax.Array) -> None:
    """Raise ``ValueError`` unless positions strictly increase with the index within each
    non-zero segment of each row (then causal-by-index within a segment equals
    causal-by-position). No-op on traced inputs.

    Args:
      positions, segment_ids: int ``[B, T]``.
    """
    try:
        pos, seg = np.asarray(positions), np.asarray(segment_ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    for row, (p, s) in enumerate(zip(pos, seg)):
        order = np.lexsort((np.arange(len(s)), s))  # by segment, then index
        p, s = p[order], s[order]
        same = (s[1:] == s[:-1]) & (s[1:] != 0)
        bad = np.flatnonzero(same & (p[1:] <= p[:-1]))
        if bad.size:
            raise ValueError(
                f"row {row}: positions do not increase within segment {s[bad[0]]} "
                f"(index-causal kernels need them increasing with the index)"
            )


def _block(length: int, block: int, quantum: int, name: str) -> int:
    """The tile size for ``length`` tokens, or ``KernelUnsupported``."""
    size = min(block, length)
    if length % size or size % quantum:
        raise KernelUnsupported(
            f"{name} needs the length ({length}) to be a multiple of its block ({size}) "
            f"and the block a multiple of {quantum}"
        )
    return size


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
        ``check_packing``.
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
    size = _block(t, block, 128, "splash attention")
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
        ``check_packing``.
      scale: logit scale. block: forward tile size (the backward uses 32).
      interpret: run in Pallas interpret mode (CPU tests).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``; differentiable w.r.t. ``q``, ``k``, ``v``.

    Raises:
      KernelUnsupported: T not a multiple of the tile size, or not of 32.
    """
    from jax.experimental.pallas.ops.gpu import attention as ga

    t, n, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    size = _block(t, block, 32, "Pallas GPU attention")
    sizes = ga.BlockSizes(block_q=size, block_k=size, block_q_dkv=32, block_kv_dkv=32,
                          block_q_dq=32, block_kv_dq=32)
    k, v = (jnp.repeat(x, n // kv_heads, axis=2) for x in (k, v))
    out = ga.mha(q, k, v, segment_ids.astype(jnp.int32), sm_scale=float(scale), causal=True,
                 block_sizes=sizes, interpret=interpret)
    return out.astype(v.dtype)
