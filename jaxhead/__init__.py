"""jaxhead: exact float32 log-probs and entropy of kept tokens, for RL post-training in JAX.

Public API (everything under ``jaxhead._src`` is private and may change):

  token_logprobs              the chunked, memory-bounded head on the kept tokens
  sharded_token_logprobs      the same under a device mesh: per-shard compaction, optional
                              vocab-parallel head
  reference_token_logprobs    the plain full-logits head (oracle and baseline)
  sample, Sample              sampling from the head (chunked Gumbel-max, no [B, V] logits;
                              top-k / top-p / min-p with the support's log-probs)
  sample_from_logits          the same draw from logits a model has already computed
  keep_mask                   union of the loss components that read each token
  shift_to_predictions        a token-aligned mask as the prediction-aligned one
  next_token_labels           shift-left labels that respect packed segments
  bucket_size, bucket_ladder  static padded sizes for the kept set
  bucket_for_shards           the one static bucket of all token shards (host)
  LMHead                      Flax NNX module owning or tying the head weight
  HeadOutput                  the head's result type
  Impl, IMPLEMENTATIONS       implementation names and the registry (``impl=``)
  XlaConfig, XlaCpuConfig, PallasTpuConfig, PallasTritonConfig   their settings (``config=``)
  KernelUnsupported           raised when an explicit implementation cannot run a call
  pallas_interpret            run the Pallas kernels in interpret mode (tests, CPU)
  __version__                 the package version (the wheel's and pyproject.toml's)
"""

__version__ = "0.1.0"

from jaxhead._src.buckets import bucket_ladder, bucket_size
from jaxhead._src.head.api import IMPLEMENTATIONS, Impl, token_logprobs
from jaxhead._src.head.pallas_mode import interpret as pallas_interpret
from jaxhead._src.head.pallas_tpu import PallasTpuConfig
from jaxhead._src.head.pallas_triton import PallasTritonConfig
from jaxhead._src.head.reference import reference_token_logprobs
from jaxhead._src.head.sharded import bucket_for_shards, sharded_token_logprobs
from jaxhead._src.head.xla import XlaConfig
from jaxhead._src.head.xla_cpu import XlaCpuConfig
from jaxhead._src.masks import keep_mask, next_token_labels, shift_to_predictions
from jaxhead._src.nnx import LMHead
from jaxhead._src.sampling import sample, sample_from_logits
from jaxhead._src.types import HeadOutput, Sample
from jaxhead.dispatch import KernelUnsupported

__all__ = [
    "IMPLEMENTATIONS",
    "HeadOutput",
    "Impl",
    "KernelUnsupported",
    "LMHead",
    "PallasTpuConfig",
    "PallasTritonConfig",
    "Sample",
    "XlaConfig",
    "XlaCpuConfig",
    "bucket_for_shards",
    "bucket_ladder",
    "bucket_size",
    "keep_mask",
    "next_token_labels",
    "pallas_interpret",
    "reference_token_logprobs",
    "sample",
    "sample_from_logits",
    "sharded_token_logprobs",
    "shift_to_predictions",
    "token_logprobs",
]
