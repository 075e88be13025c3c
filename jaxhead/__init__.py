"""jaxhead: exact float32 log-probs and entropy of kept tokens, for RL post-training in JAX.

Public API:
  token_logprobs            chunked, memory-bounded head on the kept tokens (``HeadOutput``)
  reference_token_logprobs  plain full-logits head (oracle and baseline)
  keep_mask                 union of the loss components that read each token
  next_token_labels         shift-left labels that respect packed segments
  bucket_size, bucket_ladder  static padded sizes for the kept set
  LMHead                    Flax NNX module owning or tying the head weight
  sharded_token_logprobs    the head under a device mesh: per-shard compaction, optional
                            vocab-parallel (``jaxhead.sharding``)
  bucket_for_shards         the one static bucket of all token shards (host, multi-host)

Sampling from the head (chunked Gumbel-max, no [B, V] logits): ``jaxhead.sampling``.
"""

from jaxhead.buckets import bucket_ladder, bucket_size
from jaxhead.head import token_logprobs
from jaxhead.masks import keep_mask, next_token_labels
from jaxhead.nnx import LMHead
from jaxhead.reference import reference_token_logprobs
from jaxhead.sharding import bucket_for_shards, sharded_token_logprobs
from jaxhead.types import HeadOutput

__all__ = [
    "HeadOutput",
    "LMHead",
    "bucket_for_shards",
    "bucket_ladder",
    "bucket_size",
    "keep_mask",
    "next_token_labels",
    "reference_token_logprobs",
    "sharded_token_logprobs",
    "token_logprobs",
]
