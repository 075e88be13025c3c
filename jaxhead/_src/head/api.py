"""``token_logprobs``: validation, implementation choice, bucket choice, compaction, expansion.

The implementations (``IMPLEMENTATIONS``) all satisfy ``base.HeadImplementation`` and work
on compacted rows; this module is what turns a user's ``[..., H]`` hidden states and keep
mask into those rows and back.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxhead import dispatch
from jaxhead._src import compaction
from jaxhead._src.buckets import bucket_size
from jaxhead._src.head import (
    invalid,
    layout,
    pallas_tpu,
    pallas_triton,
    probe,
    reference,
    validation,
    xla,
    xla_cpu,
)
from jaxhead._src.head.base import HeadImplementation, HeadSpec
from jaxhead._src.head.layout import WeightLayout
from jaxhead._src.types import HeadOutput

#: Names of the implementations (``impl=``); ``"auto"`` picks one by platform.
Impl = Literal["pallas_tpu", "pallas_triton", "xla_cpu", "xla", "reference"]


def _plan(head: HeadImplementation, config, spec: HeadSpec):
    """An entry's check: ``(plan, padded rows)`` of ``head`` for ``spec``, with ``config``
    if it is ``head``'s (another implementation's config: the defaults)."""
    return head.plan(config if type(config) is head.config_type else None, spec)


def head_entry(name: str, head: HeadImplementation, platforms=None, *, kernel: bool = False,
               auto: bool = True) -> dispatch.Entry[HeadImplementation]:
    """The ``dispatch.Entry`` of ``head``: checked by planning it (``HeadImplementation.
    plan``), called as ``head(plan, h, w, labels, temperature, min_logit)`` on the
    compacted rows; a ``kernel``'s plan is probed under ``"auto"`` (``probe.lowering_error``:
    its forward and backward lower for the target platform)."""
    def lowers(plan, config, spec):
        return probe.lowering_error(head, *plan, spec)

    return dispatch.Entry(name, head, platforms, check=functools.partial(_plan, head),
                          probe=lowers if kernel else None, auto=auto)


#: ``"auto"``'s order: the platform's kernel, then XLA (the last resort everywhere).
REGISTRY: dispatch.Registry[HeadImplementation] = dispatch.Registry("impl", [
    head_entry("pallas_tpu", pallas_tpu.PALLAS_TPU, ("tpu",), kernel=True),
    head_entry("pallas_triton", pallas_triton.PALLAS_TRITON, ("gpu",), kernel=True),
    head_entry("xla_cpu", xla_cpu.XLA_CPU, ("cpu",)),
    head_entry("xla", xla.XLA),
    head_entry("reference", reference.REFERENCE, auto=False),
])
IMPLEMENTATIONS: dict[Impl, HeadImplementation] = {n: e.call for n, e in REGISTRY.entries.items()}


def _config_owner(impl: str, config) -> str | None:
    """The implementation ``config`` belongs to (None without a config).

    Raises:
      ValueError: an unknown ``impl``.
      TypeError: a config of another implementation than ``impl`` (both named).
    """
    REGISTRY.check_name(impl)
    if config is None:
        return None
    entries = REGISTRY.entries
    owner = next((n for n, e in entries.items() if type(config) is e.call.config_type), None)
    if owner is None or impl not in ("auto", owner):
        want = [entries[n].call.config_type.__name__
                for n in (entries if impl == "auto" else (impl,))]
        raise TypeError(f"config must be one of {want} for impl={impl!r}, got "
                        f"{type(config).__name__}")
    return owner


def resolve_impl(impl: Impl | Literal["auto"], config=None) -> Impl:
    """The implementation that ``impl`` and ``config`` name, before any is planned.

    ``"auto"`` without a config is the first of ``REGISTRY``'s order for the platform the
    trace compiles for (``jaxhead.dispatch.target_platform``): ``"pallas_tpu"`` on TPU,
    ``"pallas_triton"`` on GPU, ``"xla_cpu"`` on CPU, ``"xla"`` elsewhere; ``"auto"`` with
    a config is the implementation that config belongs to.

    Raises:
      ValueError: an unknown name (the valid ones listed).
      TypeError: a config of another implementation than ``impl`` (both named).
    """
    owner = _config_owner(impl, config)
    if owner is not None or impl != "auto":
        return owner or impl
    return REGISTRY.candidates(dispatch.target_platform())[0]


def plan(impl: Impl | Literal["auto"], config, spec: HeadSpec):
    """``(implementation, plan, padded rows)`` for ``spec``, through
    ``jaxhead.dispatch.Registry.resolve``.

    An implementation that cannot run ``spec`` raises under an explicit ``impl``. Under
    ``"auto"`` the implementation ``config`` belongs to is tried first, then the
    platform's order (``REGISTRY``), each with its default config: a kernel
    (``pallas_tpu``, ``pallas_triton``) is used only if it plans (no
    ``KernelUnsupported``) and its plan lowers, forward and backward, for the target
    platform (``probe.lowering_error``; not in interpret mode); otherwise the next one
    takes over and the reason is logged (logger ``"jaxhead"``, level WARNING; an error
    under ``jaxhead.dispatch.strict``).

    Raises:
      KernelUnsupported / ValueError / TypeError: as ``resolve_impl`` and the
        implementation's ``plan`` (any error but ``KernelUnsupported`` under ``"auto"``
        too: a kernel that fails to plan is a bug to see, not a reason to fall back).
    """
    owner = _config_owner(impl, config)
    choice = REGISTRY.resolve(impl, config, spec, first=owner)
    made, padded = choice.plan
    return choice.call, made, padded


def _resolve_bucket(keep, bucket, num_tokens: int) -> int:
    # numpy, not jnp: inside a jit trace jnp ops on a closed-over concrete array are traced
    count = int(np.count_nonzero(np.asarray(keep))) if validation.is_concrete(keep) else None
    if bucket is None:
        if count is None:
            warnings.warn(
                "jaxhead.token_logprobs: keep is traced and bucket is None, so every one of "
                f"the {num_tokens} tokens goes through the head (no compaction). Pick the "
                "bucket on the host, e.g. bucket=jaxhead.bucket_size(int(keep.sum()), "
                "keep.size), and pass it as a static argument.", stacklevel=3)
        return num_tokens if count is None else bucket_size(count, num_tokens)
    if count is not None and count > bucket:
        raise ValueError(
            f"bucket={bucket} is smaller than the {count} kept tokens; pass a larger bucket "
            f"(jaxhead.bucket_size({count}, {num_tokens}) = {bucket_size(count, num_tokens)})"
        )
    return min(bucket, num_tokens)


def run_compacted(head, made, padded: int, h, weight, y, temperature, min_logit, keep=None):
    """Compact the kept rows into ``padded`` slots, run ``head(made, ...)``, expand back.

    Args:
      head: an implementation (``HeadImplementation``) and ``made`` its plan for
        ``padded`` rows.
      h: ``[N, H]``; weight: ``[H, V]`` or ``[V, H]`` (the plan's layout; or a vocab
      shard); y: int32 ``[N]``;
      temperature, min_logit: float32 ``[N]`` (padding rows get 1.0 and ``-inf``); keep:
      bool ``[N]`` or None (every row, in order).

    Returns:
      float32 ``(logp, entropy)``, ``[N]`` each: 0 where not kept, NaN for kept rows
      beyond the bucket (it overflowed).
    """
    num_tokens = h.shape[0]
    if padded == 0:  # nothing kept, or no tokens: nothing to compute
        zeros = jnp.zeros((num_tokens,), jnp.float32)
        if keep is None:
            return zeros, zeros
        lost = jnp.where(keep, jnp.nan, 0.0).astype(jnp.float32)  # kept tokens cannot fit
        return lost, lost
    if keep is None:  # every row, in order: pad to the implementation's row multiple
        pad = [(0, padded - num_tokens)]
        logp, ent = head(made, jnp.pad(h, pad + [(0, 0)]), weight, jnp.pad(y, pad),
                         jnp.pad(temperature, pad, constant_values=1.0),
                         jnp.pad(min_logit, pad, constant_values=-jnp.inf))
        return logp[:num_tokens], ent[:num_tokens]
    idx, pos = compaction.kept_indices(keep, padded)
    gather = compaction.gather_rows
    logp, ent = head(made, compaction.compact(h, idx, pos), weight, gather(y, idx, 0),
                     gather(temperature, idx, 1.0), gather(min_logit, idx, -jnp.inf))
    logp, ent = compaction.expand(logp, idx, pos), compaction.expand(ent, idx, pos)
    if padded < num_tokens:
        lost = compaction.overflow_mask(keep, padded)
        logp = jnp.where(lost, jnp.nan, logp)
        ent = jnp.where(lost, jnp.nan, ent)
    return logp, ent


def ignored_labels(labels, keep, bucket, ignore_index):
    """``(labels, keep, ignored)`` for a call whose ``keep`` may be None.

    With concrete labels (or a ``bucket`` to compact into), labels equal to
    ``ignore_index`` become a keep mask (None when there are none). With traced labels and
    no bucket, compacting into all ``N`` rows would save nothing and cost a gather and a
    scatter of ``[N, H]``: the head then runs on every row in order and ``ignored`` (bool,
    labels' shape) marks the rows whose outputs ``mask_ignored`` zeroes (their labels
    become 0, a valid id, so that the label rule does not fire on them). ``ignored`` is
    None otherwise."""
    if keep is not None or ignore_index is None:
        return labels, keep, None
    if validation.is_concrete(labels):
        keep = np.asarray(labels) != ignore_index
        return labels, (None if keep.all() else keep), None
    if bucket is not None:
        return labels, labels != ignore_index, None
    ignored = labels == ignore_index
    return jnp.where(ignored, 0, labels), None, ignored


def mask_ignored(ignored, logp, ent):
    """``(logp, entropy)`` with exactly 0 (and zero gradient) on the ``ignored`` rows."""
    if ignored is None:
        return logp, ent
    return jnp.where(ignored, 0.0, logp), jnp.where(ignored, 0.0, ent)


def row_inputs(temperature, min_logit, batch_shape):
    """float32 ``(temperature, min_logit)``, flat ``[N]`` each, without gradients (the one
    ``stop_gradient`` of both; ``min_logit`` None: ``-inf``)."""
    stop = jax.lax.stop_gradient
    temperature = stop(jnp.asarray(temperature, jnp.float32))
    ml = -jnp.inf if min_logit is None else stop(jnp.asarray(min_logit, jnp.float32))
    return tuple(jnp.broadcast_to(x, batch_shape).reshape(-1) for x in (temperature, ml))


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
    impl: Impl | Literal["auto"] = "auto",
    config=None,
    min_logit=None,
    ignore_index: int | None = -100,
    weight_layout: WeightLayout = "hv",
    weight_hidden_axes: str | Sequence[str] = (),
) -> HeadOutput:
    """float32 ``log p(label)`` and entropy of the kept tokens, without ``[N, V]`` logits.

    The logits of a token are ``l = z / temperature`` with ``z = u`` or, with a soft-cap
    ``c``, ``z = c * tanh(u / c)`` (Gemma 2, applied before the temperature), where
    ``u = hidden @ weight`` is accumulated in float32. Then
    ``logprobs = l_label - logsumexp(l)`` and ``entropy = -sum_v p_v log p_v`` (nats). Kept
    tokens are gathered into a padded bucket of static size, the vocabulary is scanned in
    chunks with an online log-sum-exp, and the backward pass recomputes each logit tile: memory
    is ``O(bucket * H + tile)``, never ``O(N * V)``.

    Args:
      hidden: ``[..., H]`` bf16 / f16 / f32 final hidden states (after the final norm).
      weight: the head weight, same dtype as ``hidden``: ``[H, V]`` (``weight_layout="hv"``,
        a ``Linear`` kernel) or ``[V, H]`` (``"vh"``: e.g. a tied embedding table, used as
        it is: no transposed copy, forward or backward).
      labels: int ``[...]``: the next token of each position (see ``next_token_labels``).
      keep: optional bool ``[...]`` (see ``keep_mask``): positions to compute. None: every
        position whose label is not ``ignore_index``.
      temperature: scalar or float ``[...]`` (> 0): sampling temperature per token. Treated
        as a constant: no gradient flows to it.
      softcap: ``c > 0`` or None.
      with_entropy: also compute the entropy and its gradient.
      bucket: static number of rows the kept tokens are compacted into, any integer scalar
        known on the host (``int``, ``np.int64``, a concrete 0-d array). None: with a
        concrete ``keep``, ``bucket_size(keep.sum(), N)`` chosen on the host; with a traced
        ``keep``, N (correct, but no saving, and a warning: pass a bucket under ``jit``). 0:
        nothing is computed (every kept token then overflows).
      impl: one of ``Impl``: ``"xla"`` (the chunked XLA scan, every backend), ``"xla_cpu"``
        (the same with XLA:CPU tuning), ``"pallas_tpu"`` (Mosaic TPU kernels),
        ``"pallas_triton"`` (Triton GPU kernels), ``"reference"`` (full logits of the
        compacted rows), or ``"auto"``: by the platform compiled for (the devices of the
        mesh in context, else ``jax.default_backend()``): pallas_tpu on TPU, pallas_triton
        on GPU, xla_cpu on CPU; when the kernel cannot run the call (e.g. an unsupported
        dtype, tiles that exceed VMEM, a mesh that would partition it outside
        ``shard_map``, its lowering refused by the compiler) ``"auto"`` uses the next
        implementation (xla) and logs the reason (logger ``"jaxhead"``; an error under
        ``jaxhead.dispatch.strict``); any other error planning it raises. The kernels
        run on CPU only in Pallas interpret mode (``jaxhead.pallas_interpret``), for tests.
      config: the implementation's settings: ``XlaConfig``, ``XlaCpuConfig``,
        ``PallasTpuConfig`` or ``PallasTritonConfig`` (a config also names its
        implementation under ``impl="auto"``); None: the defaults.
      min_logit: None, or a float scalar / ``[...]``: per token, the threshold of a
        truncated support on the tempered logits ``l = z / temperature`` (ties included;
        ``-inf``: untruncated), e.g. ``Sample.min_logit`` of the draw. Treated as data: no
        gradient flows to it; computed in the same chunked scan, never ``[N, V]``.
      ignore_index: when ``keep`` is None, labels equal to it are not kept (their outputs
        are 0, with zero gradient), as in PyTorch's and optax's cross-entropy
        (``next_token_labels`` writes -100 where there is no next token); None: every label
        must be in ``[0, V)``. Other out-of-range labels still raise. Ignored when ``keep``
        is given. With traced labels and no ``bucket`` their rows still run through the
        head in order (no compaction, which would save nothing), so their hidden states
        must be finite.
      weight_layout: ``"hv"`` (``weight [H, V]``) or ``"vh"`` (``weight [V, H]``). Both
        give the same numbers (the same float32 accumulation of each logit).
      weight_hidden_axes: inside ``jax.shard_map``, the manual mesh axes over which
        ``weight``'s hidden dimension is split (FSDP / ZeRO-3's layout): ``weight`` holds
        this device's ``H / n`` of its hidden dimension (``n`` the axes' device count;
        rows of ``[H, V]``, columns of ``[V, H]``) and ``hidden`` has all H.
        Each vocab chunk is all-gathered where it is used, so no device holds the whole
        weight, and the weight's gradient comes back split the same way (summed over the
        axes). The XLA implementations (and ``"reference"``, which gathers it whole);
        the kernels raise ``KernelUnsupported``. ``()``: the weight is whole.

    Returns:
      ``HeadOutput(logprobs, entropy)``, float32 ``[...]``; exactly 0 where ``keep`` is
      false, and exactly zero gradient there; ``entropy`` is None without
      ``with_entropy``. Differentiable w.r.t. ``hidden`` and ``weight``; gradients come
      back in their dtypes (and the weight's in its ``weight_layout``), accumulated in
      float32.

    Raises:
      ValueError: shapes that disagree (both named; a weight whose hidden dimension does
        not match in ``weight_layout``, with the layout, and the other layout when it would
        fit); a ``weight_layout`` other than ``"hv"`` / ``"vh"``; with concrete inputs, kept labels
        outside ``[0, V)`` (count and first position named), a temperature not > 0 on a
        kept token, or ``bucket`` smaller than the number of kept tokens (or no integer
        scalar); an unknown impl;
        a bad config value (named). ``jaxhead.KernelUnsupported`` (a ValueError): an
        explicit kernel impl that cannot run the call (the reason named).
      TypeError: inputs that are no arrays (e.g. a Python list, shown cut short),
        non-float hidden/weight, different hidden/weight dtypes, non-integer labels,
        non-bool keep; a config of another implementation.

    Under ``jit`` the value checks cannot run on the host. Instead, a kept token whose
    label is outside ``[0, V)``, or that does not fit in ``bucket``, gets ``logprobs = NaN``
    (and, for the bucket case, ``entropy = NaN``) so that the loss turns NaN rather than
    silently wrong; a temperature <= 0 gives inf/NaN the same way.
    """
    hidden_axes, hidden_shards = validation.hidden_shards(weight_hidden_axes)
    validation.check_inputs(hidden, weight, labels, keep, temperature, softcap, min_logit,
                            weight_layout, hidden_shards)
    vocab_size = layout.sizes(weight.shape, weight_layout)[1]
    hidden_size = jnp.shape(hidden)[-1]
    bucket = validation.static_bucket(bucket)
    labels, keep, ignored = ignored_labels(labels, keep, bucket, ignore_index)
    validation.check_values(labels, keep, temperature, vocab_size)
    batch_shape = labels.shape
    num_tokens = math.prod(batch_shape)
    rows = num_tokens if keep is None else _resolve_bucket(keep, bucket, num_tokens)
    spec = HeadSpec(rows, hidden_size, vocab_size, jnp.dtype(hidden.dtype).name, softcap,
                    with_entropy, truncated=min_logit is not None, weight_layout=weight_layout,
                    hidden_axes=hidden_axes, hidden_shards=hidden_shards)
    head, made, padded = plan(impl, config, spec)
    # under jit: an invalid kept token makes both gradients NaN too, not only its log-prob
    # (a split weight: every device's part of it, as a whole weight's psum would)
    bad = invalid.invalid_kept(labels, keep, vocab_size, padded)
    if spec.hidden_axes:
        bad = jax.lax.pmax(bad.astype(jnp.int32), spec.hidden_axes) > 0
    hidden, weight = invalid.nan_gradients_if(bad, hidden, weight)
    logp, ent = run_compacted(
        head, made, padded, hidden.reshape(num_tokens, hidden_size), weight,
        labels.reshape(num_tokens).astype(jnp.int32), *row_inputs(temperature, min_logit,
                                                                   batch_shape),
        None if keep is None else keep.reshape(num_tokens),
    )
    logp, ent = mask_ignored(ignored, logp.reshape(batch_shape), ent.reshape(batch_shape))
    return HeadOutput(logp, ent if with_entropy else None)
