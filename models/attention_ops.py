"""Which attention implementation runs a call: the ``ModelConfig.attention_impl`` switch.

Implementations (``IMPLEMENTATIONS``):

* ``"xla_chunked"``: blockwise attention in XLA with an online softmax and a recomputing
  backward (``models.attention_xla.chunked_attention``); any backend, memory linear in
  the length. The portable default and the fallback.
* ``"splash"``: JAX's TPU splash attention kernel (``models.attention_kernels``).
* ``"pallas_gpu"``: JAX's Pallas GPU (Triton) FlashAttention kernel. Chosen on GPU over
  ``jax.nn.dot_product_attention(implementation="cudnn")`` because in this JAX (0.10)
  that function takes padding only as per-row ``query_seq_lengths`` /
  ``key_value_seq_lengths`` and anything else as a dense ``[B, N, T, S]`` mask or bias,
  so packed segments would bring back the quadratic buffer; the Pallas kernel takes
  ``segment_ids`` directly.
* ``"dense"``: the materialised ``[B, T, S]`` mask and scores
  (``models.attention_xla.dense_attention``): the test reference.

``"auto"`` picks by ``jax.default_backend()``: ``splash`` on TPU, ``pallas_gpu`` on GPU,
``xla_chunked`` elsewhere, and falls back to ``xla_chunked`` when the kernel cannot run
the call (a length that is not a multiple of its block), logging a warning on logger
``"models"``. An explicit kernel raises ``KernelUnsupported`` instead; off its platform it
runs in Pallas interpret mode (slow: for tests).
"""

from __future__ import annotations

import logging

import jax

from models.attention_kernels import (
    KernelUnsupported,
    check_packing,
    pallas_gpu_attention,
    splash_attention,
)
from models.attention_xla import chunked_attention, dense_attention

logger = logging.getLogger("models")

IMPLEMENTATIONS = ("xla_chunked", "splash", "pallas_gpu", "dense")
_AUTO = {"tpu": "splash", "gpu": "pallas_gpu"}
_KERNELS = {"splash": (splash_attention, "tpu"), "pallas_gpu": (pallas_gpu_attention, "gpu")}


def resolve_impl(impl: str) -> str:
    """The implementation ``impl`` names (``"auto"``: by ``jax.default_backend()``).

    Raises:
      ValueError: not ``"auto"`` nor one of ``IMPLEMENTATIONS``.
    """
    if impl == "auto":
        return _AUTO.get(jax.default_backend(), "xla_chunked")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl must be 'auto' or one of {IMPLEMENTATIONS}, "
                         f"got {impl!r}")
    return impl


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                   segment_ids: jax.Array, *, scale: float, impl: str = "auto") -> jax.Array:
    """Causal grouped-query attention of packed rows (training and scoring).

    A query reads the keys of its own non-zero segment whose position is <= its own.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, T, K, D]`` (``N % K == 0``); compute dtype.
      positions, segment_ids: int ``[B, T]``; segment id 0 is padding. The kernels also
        need positions increasing with the index within each segment
        (``models.attention_kernels.check_packing``, checked when concrete).
      scale: logit scale (``D ** -0.5``).
      impl: ``"auto"`` or one of ``IMPLEMENTATIONS``.

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``. Padding rows hold finite values that differ
      between implementations (no loss reads them).

    Raises:
      ValueError: unknown ``impl``; positions that break the kernels' precondition.
      KernelUnsupported: an explicitly requested kernel cannot run these shapes.
    """
    name = resolve_impl(impl)
    if name == "dense":
        return dense_attention(q, k, v, positions, segment_ids, positions, segment_ids,
                               scale=scale)
    if name in _KERNELS:
        kernel, platform = _KERNELS[name]
        check_packing(positions, segment_ids)
        try:
            return kernel(q, k, v, segment_ids, scale=scale,
                          interpret=jax.default_backend() != platform)
        except KernelUnsupported as err:
            if impl != "auto":
                raise
            logger.warning("attention_impl='auto': %s cannot run this call (%s); using "
                           "'xla_chunked'", name, err)
    return chunked_attention(q, k, v, positions, segment_ids, positions, segment_ids,
                             scale=scale)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                    segment_ids: jax.Array, kv_positions: jax.Array,
                    kv_segment_ids: jax.Array, *, scale: float, impl: str = "auto"
                    ) -> jax.Array:
    """Attention of T new tokens over the whole KV cache (prefill and decode).

    A one-token decode step (``T = 1``) uses the dense path: its scores are ``[B, N, 1,
    L]``, linear in the cache length, and one matmul pair beats the blockwise loop (XLA:CPU,
    bfloat16, B=8, L=4096, N=16, K=8, D=128: 0.68 s dense vs 1.28 s blockwise per step on a
    loaded 2-core Xeon; not measured on TPU / GPU). Prefill (``T > 1``) uses
    ``xla_chunked``, or ``dense`` when ``impl="dense"``. The kernels never serve the cache:
    their causal mask counts from index 0 of a static length, while the new tokens sit at
    the traced slot ``cache.index``.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, L, K, D]`` (the whole cache, new tokens written).
      positions, segment_ids: int ``[B, T]`` of the new tokens.
      kv_positions, kv_segment_ids: int ``[B, L]`` of every slot (0: empty or padding).
      scale, impl: as ``self_attention`` (``impl`` validated).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``.

    Raises:
      ValueError: unknown ``impl``.
    """
    name = resolve_impl(impl)
    args = (q, k, v, positions, segment_ids, kv_positions, kv_segment_ids)
    if name == "dense" or q.shape[1] == 1:
        return dense_attention(*args, scale=scale)
    return chunked_attention(*args, scale=scale)
