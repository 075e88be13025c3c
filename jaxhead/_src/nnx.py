"""``LMHead``: a thin Flax NNX module that owns (or ties) the head weight and calls the head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxhead._src.head.api import token_logprobs
from jaxhead._src.head.sharded import sharded_token_logprobs
from jaxhead._src.types import HeadOutput

#: Logical axis names of the head weight ``[H, V]`` (mapped to mesh axes by sharding rules).
KERNEL_AXES = ("embed", "vocab")


class LMHead(nnx.Module):
    """LM head ``[H, V]`` whose forward returns log-probs and entropy of kept tokens.

    Either owns its kernel (``nnx.Param`` ``[H, V]`` with logical axes ``("embed",
    "vocab")``; ``weight_layout = "hv"``) or, with ``tied_embedding``, reads the ``[V, H]``
    table of an ``nnx.Embed`` (Qwen3-0.6B style tied embeddings; ``weight_layout = "vh"``):
    the head uses the table as it is, never a transposed copy, and its gradient arrives
    ``[V, H]``, in the table's own layout.

    Args:
      hidden_size: H.
      vocab_size: V.
      rngs: initialiser keys (unused when tied).
      tied_embedding: an ``nnx.Embed`` with ``num_embeddings == V``, ``features == H``.
      softcap: final-logit soft-cap ``c`` (Gemma 2) or None.
      dtype: compute dtype of the matmuls (hidden and weight are cast to it); None keeps
        the dtype of ``hidden``.
      param_dtype: dtype of the owned kernel.
      kernel_init: initialiser of the owned kernel.
      impl, config: forwarded to ``jaxhead.token_logprobs``.

    Raises:
      ValueError: a tied embedding whose shape is not ``[V, H]``.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        rngs: nnx.Rngs | None = None,
        tied_embedding: nnx.Embed | None = None,
        softcap: float | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=nnx.initializers.lecun_normal(),  # noqa: B008 - flax initialisers are factories
        impl: str = "auto",
        config=None,
    ):
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.softcap, self.dtype = softcap, dtype
        self.impl, self.config = impl, config
        if tied_embedding is not None:
            shape = tuple(tied_embedding.embedding.shape)
            if shape != (vocab_size, hidden_size):
                raise ValueError(
                    f"tied embedding has shape {shape}, expected (V, H) = "
                    f"{(vocab_size, hidden_size)}"
                )
            self.embedding = tied_embedding
            self.kernel = None
            self.weight_layout = "vh"
        else:
            if rngs is None:
                raise ValueError("an untied LMHead needs rngs to initialise its kernel")
            self.embedding = None
            self.weight_layout = "hv"
            value = kernel_init(rngs.params(), (hidden_size, vocab_size), param_dtype)
            self.kernel = nnx.Param(value, out_sharding=KERNEL_AXES, eager_sharding=False)

    def weight(self, dtype=None) -> jax.Array:
        """The head weight in ``weight_layout`` (the ``[H, V]`` kernel, or the tied ``[V, H]``
        table as it is), cast to ``dtype`` if given."""
        w = self.embedding.embedding[...] if self.kernel is None else self.kernel[...]
        return w if dtype is None else w.astype(dtype)

    def __call__(
        self,
        hidden: jax.Array,
        labels: jax.Array,
        keep: jax.Array | None = None,
        *,
        temperature=1.0,
        with_entropy: bool = True,
        bucket: int | None = None,
        min_logit=None,
        ignore_index: int | None = -100,
    ) -> HeadOutput:
        """``jaxhead.token_logprobs(hidden, weight, labels, keep, ...)``; see there."""
        dtype = self.dtype or hidden.dtype
        return token_logprobs(
            hidden.astype(dtype), self.weight(dtype), labels, keep,
            temperature=temperature, softcap=self.softcap, with_entropy=with_entropy,
            bucket=bucket, min_logit=min_logit, impl=self.impl, config=self.config,
            ignore_index=ignore_index, weight_layout=self.weight_layout,
        )

    def sharded(
        self,
        hidden: jax.Array,
        labels: jax.Array,
        keep: jax.Array | None = None,
        *,
        mesh=None,
        token_axes,
        vocab_axis: str | None = None,
        temperature=1.0,
        with_entropy: bool = True,
        bucket: int | None = None,
        min_logit=None,
        ignore_index: int | None = -100,
    ) -> HeadOutput:
        """``jaxhead.sharded_token_logprobs`` with this head's weight and settings: tokens
        split over ``token_axes`` of ``mesh`` (None: the mesh set with ``jax.set_mesh``),
        one static ``bucket`` per shard (``jaxhead.bucket_for_shards``), optionally the
        vocabulary over ``vocab_axis``; see there."""
        dtype = self.dtype or hidden.dtype
        return sharded_token_logprobs(
            hidden.astype(dtype), self.weight(dtype), labels, keep, mesh=mesh,
            token_axes=token_axes, vocab_axis=vocab_axis, bucket=bucket,
            temperature=temperature, softcap=self.softcap, with_entropy=with_entropy,
            min_logit=min_logit, impl=self.impl, config=self.config,
            ignore_index=ignore_index, weight_layout=self.weight_layout,
        )

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Full float32 logits ``[..., V]`` (soft-capped, temperature 1): for debugging and
        for samplers that need them; the training path never calls this."""
        dtype = self.dtype or hidden.dtype
        u = jnp.einsum(
            f"...h,{self.weight_layout}->...v", hidden.astype(dtype), self.weight(dtype),
            preferred_element_type=jnp.float32,
        )
        return u if self.softcap is None else self.softcap * jnp.tanh(u / self.softcap)
