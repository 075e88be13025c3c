"""``token_logprobs``: validation, bucket choice, compaction, dispatch, expansion."""

from __future__ import annotations

import importlib
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxhead import compaction, validation, xla
from jaxhead.buckets import bucket_size
from jaxhead.pallas_mode import KernelUnsupported
from jaxhead.reference import reference_token_logprobs
from jaxhead.types import HeadOutput

IMPLS = ("auto", "xla", "reference", "pallas_tpu", "pallas_triton")
_KERNEL_BY_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_triton"}
logger = logging.getLogger(__name__)


def resolve_impl(impl: str) -> str:
    """The implementation ``impl`` names: ``"auto"`` picks by ``jax.default_backend()``,
    ``"pallas_tpu"`` on TPU, ``"pallas_triton"`` on GPU, ``"xla"`` elsewhere.

    Raises:
      ValueError: an unknown name (the valid ones are listed).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return _KERNEL_BY_BACKEND.get(jax.default_backend(), "xla")


def _configure(impl, requested, rows, hidden_size, vocab_size, dtype, chunk_kw, blocks):
    """``(head function, config, padded rows)`` for ``impl``. A kernel that cannot run the
    call raises under an explicit ``impl``; under ``"auto"`` the XLA path takes over and
    the reason is logged."""
    if impl in ("pallas_tpu", "pallas_triton"):
        try:
            module = importlib.import_module(f"jaxhead.{impl}")
            cfg, padded = module.make_config(
                rows, hidden_size, vocab_size, dtype=dtype, blocks=blocks,
                softcap=chunk_kw["softcap"], with_entropy=chunk_kw["with_entropy"],
            )
            return module.chunked_head, cfg, padded
        except (ImportError, KernelUnsupported) as err:
            if requested != "auto":
                raise
            logger.warning("impl='auto': %s cannot run this call (%s); using 'xla'", impl, err)
    cfg, padded = xla.make_config(rows, hidden_size, vocab_size, dtype, **chunk_kw)
    return xla.chunked_head, cfg, padded


def _resolve_bucket(keep, bucket, num_tokens: int) -> int:
    # numpy, not jnp: inside a jit trace jnp ops on a closed-over concrete array are traced
    count = int(np.count_nonzero(np.asarray(keep))) if validation.is_concrete(keep) else None
    if bucket is None:
        return num_tokens if count is None else bucket_size(count, num_tokens)
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0:
        raise ValueError(f"bucket must be a non-negative int or None, got {bucket!r}")
    if count is not None and count > bucket:
        raise ValueError(
            f"bucket={bucket} is smaller than the {count} kept tokens; pass a larger bucket "
            f"(jaxhead.bucket_size({count}, {num_tokens}) = {bucket_size(count, num_tokens)})"
        )
    return min(bucket, num_tokens)


def run_compacted(head, cfg, padded: int, h, weight, y, inv_temp, keep=None):
    """Compact the kept rows into ``padded`` slots, run ``head`` on them, expand back.

    Args:
      head: ``head(cfg, h_c, weight, y_c, inv_temp_c) -> (logZ, logp, entropy)`` on
        ``[padded]`` rows (``xla.chunked_head``, a kernel, or a vocab-parallel head).
      cfg, padded: the head's static config and its padded row count.
      h: ``[N, H]``; weight: ``[H, V]`` (or a vocab shard); y: int32 ``[N]``;
      inv_temp: float32 ``[N]``; keep: bool ``[N]`` or None (every row, in order).

    Returns:
      float32 ``(logp, entropy)``, ``[N]`` each: 0 where not kept, NaN for kept rows
      beyond ``padded`` (the bucket overflowed).
    """
    num_tokens = h.shape[0]
    if keep is None:  # every row, in order: pad to whole token chunks
        pad = [(0, padded - num_tokens)]
        h_c = jnp.pad(h, pad + [(0, 0)])
        y_c, it_c = jnp.pad(y, pad), jnp.pad(inv_temp, pad, constant_values=1.0)
        _, logp, ent = head(cfg, h_c, weight, y_c, it_c)
        return logp[:num_tokens], ent[:num_tokens]
    idx, pos = compaction.kept_indices(keep, padded)
    _, logp, ent = head(
        cfg,
        compaction.compact(h, idx, pos),
        weight,
        compaction.gather_rows(y, idx, 0),
        compaction.gather_rows(inv_temp, idx, 1.0),
    )
    logp, ent = compaction.expand(logp, idx, pos), compaction.expand(ent, idx, pos)
    if padded < num_tokens:
        lost = compaction.overflow_mask(keep, padded)
        logp = jnp.where(lost, jnp.nan, logp)
        ent = jnp.where(lost, jnp.nan, ent)
    return logp, ent


def token_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    keep: jax.Array | None = None,
    *,
    temperature=1.0,
    softcap: float | None = None,
    with_entropy: bool = True,
    bucket: int | None = None,
    impl: str = "auto",
    token_chunk: int = xla.DEFAULT_TOKEN_CHUNK,
    vocab_chunk: int = xla.DEFAULT_VOCAB_CHUNK,
    blocks=None,
) -> HeadOutput:
    """float32 ``log p(label)`` and entropy of the kept tokens, without ``[N, V]`` logits.

    The logits of a token are ``l = z / temperature`` with ``z = u`` or, with a soft-cap
    ``c``, ``z = c * tanh(u / c)`` (Gemma 2, applied before the temperature), where
    ``u = hidden @ weight`` is accumulated in float32. Then ``logprobs = l_label - logsumexp(l)``
    and ``entropy = -sum_v p_v log p_v`` (nats). Kept tokens are gathered into a padded
    bucket of static size, the vocabulary is scanned in chunks with an online log-sum-exp,
    and the backward pass recomputes each logit tile (see ``jaxhead.xla``; the Pallas
    kernels keep each tile in VMEM / registers): memory is ``O(bucket * H + tile)``, never
    ``O(N * V)``.

    Args:
      hidden: ``[..., H]`` bf16 / f16 / f32 final hidden states (after the final norm).
      weight: ``[H, V]`` head weight, same dtype as ``hidden`` (for tied embeddings pass the
        embedding table transposed).
      labels: int ``[...]``: the next token of each position (see ``next_token_labels``).
      keep: optional bool ``[...]`` (see ``keep_mask``): positions to compute. None: all.
      temperature: scalar or float ``[...]`` (> 0): sampling temperature per token. Treated
        as a constant: no gradient flows to it.
      softcap: ``c > 0`` or None.
      with_entropy: also compute the entropy and its gradient.
      bucket: static number of rows the kept tokens are compacted into. None: with a
        concrete ``keep``, ``bucket_size(keep.sum(), N)`` chosen on the host; with a traced
        ``keep``, N (correct, but no saving: pass a bucket under ``jit``).
      impl: ``"xla"`` (chunked XLA scan, every backend), ``"pallas_tpu"`` (Mosaic TPU
        kernels, ``jaxhead.pallas_tpu``), ``"pallas_triton"`` (Triton GPU kernels,
        ``jaxhead.pallas_triton``), ``"reference"`` (full logits), or ``"auto"``: by
        ``jax.default_backend()``, pallas_tpu on TPU, pallas_triton on GPU, xla elsewhere;
        when the kernel cannot run the call (e.g. an unsupported dtype, or a hidden size
        whose tiles exceed VMEM) ``"auto"`` uses xla and logs the reason (``logging``,
        logger ``jaxhead.head``). The kernels run on CPU only in Pallas interpret mode
        (``JAXHEAD_PALLAS_INTERPRET=1``, see ``jaxhead.pallas_mode``), for tests.
      token_chunk: rows per tile of the XLA path (rounded down to fit the bucket in as few
        tiles).
      vocab_chunk: columns per tile of the XLA path; V need not be a multiple of it.
      blocks: tile sizes of a kernel impl (``jaxhead.pallas_tpu.TpuBlocks`` or
        ``jaxhead.pallas_triton.TritonBlocks``); None: the documented defaults for the
        backend and dtype. Ignored by the XLA and reference paths.

    Returns:
      ``HeadOutput(logprobs, entropy)``, float32 ``[...]``; exactly 0 where ``keep`` is
      false, and exactly zero gradient there. Differentiable w.r.t. ``hidden`` and
      ``weight``; gradients come back in their dtypes, accumulated in float32.

    Raises:
      ValueError: shapes that disagree (both named); with concrete inputs, kept labels
        outside ``[0, V)`` (count and first position named), a temperature not > 0 on a
        kept token, or ``bucket`` smaller than the number of kept tokens; an unknown impl.
        ``jaxhead.pallas_mode.KernelUnsupported`` (a ValueError): an explicit kernel impl
        that cannot run the call (the reason named); bad ``blocks`` sizes.
      TypeError: non-float hidden/weight, different hidden/weight dtypes, non-integer
        labels, non-bool keep.

    Under ``jit`` the value checks cannot run on the host. Instead, a kept token whose
    label is outside ``[0, V)``, or that does not fit in ``bucket``, gets ``logprobs = NaN``
    (and, for the bucket case, ``entropy = NaN``) so that the loss turns NaN rather than
    silently wrong; a temperature <= 0 gives inf/NaN the same way.
    """
    validation.check_inputs(hidden, weight, labels, keep, temperature, softcap)
    requested, impl = impl, resolve_impl(impl)
    hidden_size, vocab_size = weight.shape
    validation.check_values(labels, keep, temperature, vocab_size)
    if impl == "reference":
        return reference_token_logprobs(
            hidden, weight, labels, keep, temperature=temperature, softcap=softcap,
            with_entropy=with_entropy,
        )

    batch_shape = labels.shape
    num_tokens = math.prod(batch_shape)
    h = hidden.reshape(num_tokens, hidden_size)
    y = labels.reshape(num_tokens).astype(jnp.int32)
    temp = jax.lax.stop_gradient(jnp.asarray(temperature, jnp.float32))
    inv_temp = jnp.broadcast_to(1.0 / temp, batch_shape).reshape(num_tokens)
    keep_flat = None if keep is None else keep.reshape(num_tokens)
    rows = num_tokens if keep is None else _resolve_bucket(keep, bucket, num_tokens)

    head, cfg, padded = _configure(
        impl, requested, rows, hidden_size, vocab_size, hidden.dtype,
        {"softcap": softcap, "with_entropy": with_entropy, "token_chunk": token_chunk,
         "vocab_chunk": vocab_chunk},
        blocks,
    )
    logp, ent = run_compacted(head, cfg, padded, h, weight, y, inv_temp, keep_flat)
    ent = ent if with_entropy else None
    return HeadOutput(
        logp.reshape(batch_shape), None if ent is None else ent.reshape(batch_shape)
    )
