"""Attention, one op folder (as ``jaxhead/_src/head/``).

  layer.py        ``Attention``: the Qwen3 nnx layer (projections, q/k norm, RoPE)
  api.py          ``self_attention`` / ``cache_attention``, ``REGISTRY`` (the
                  ``ModelConfig.attention_impl`` values), ``"auto"`` and its fallback
  base.py         what the kernels share: ``check_packing``, ``block_size``
  reference.py    ``"dense"``: ``attention_mask``, ``dense_attention``
  xla.py          ``"xla_chunked"``: ``chunked_attention``
  pallas_tpu.py   ``"splash"``: ``splash_attention``
  pallas_gpu.py   ``"pallas_gpu"``: ``pallas_gpu_attention``
  paged.py        decode over a paged KV cache: ``paged_attention`` (``REGISTRY``: ``"xla"``,
                  a dynamic trip count over the written pages; ``"invariant"``;
                  ``"dense"``); the pool, its writes and its split over the mesh are
                  ``models.cache.paged``
The layer is imported from ``models.attention.layer`` (it needs ``models.config``); this
package's API is the op, which needs no config: ``models.transformer.check_ops`` checks a
config's ``attention_impl`` against ``REGISTRY`` where the model is built.
"""

from models.attention.api import IMPLEMENTATIONS, REGISTRY, cache_attention, self_attention

__all__ = ["IMPLEMENTATIONS", "REGISTRY", "cache_attention", "self_attention"]
