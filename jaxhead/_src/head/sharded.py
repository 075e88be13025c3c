"""The head under a device mesh: tokens split over the data-like axes, each shard compacts
its own kept tokens into one static bucket, optionally the vocabulary split over one axis.

``sharded_token_logprobs`` runs ``jaxhead.token_logprobs`` per token shard inside
``jax.shard_map``: no token ever moves between devices, each shard gathers its kept rows
into ``bucket`` slots (the same static size on every shard, so one compiled program),
and results come back split like the inputs. With ``vocab_axis`` the head weight is split
over that axis along its vocab dimension (columns of ``[H, V]``, rows of ``[V, H]``) and
each device scans only its part; the per-row log-sum-exp
statistics are combined with ``pmax`` / ``psum`` (the XLA implementation's vocab-parallel
mode, after Megatron-LM's vocab-parallel cross-entropy).

The bucket is a host decision: ``bucket_for_shards`` counts the kept tokens of every
shard, takes the largest count (over all processes only when asked to: a collective), and
rounds it up to the bucket ladder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxhead._src.buckets import DEFAULT_GROWTH, DEFAULT_MULTIPLE, bucket_size
from jaxhead._src.head import api, invalid, layout, pallas_mode, validation
from jaxhead._src.head.base import HeadSpec
from jaxhead._src.head.layout import WeightLayout
from jaxhead._src.types import HeadOutput


def _axis_size(mesh, axes: Sequence[str]) -> int:
    return math.prod(dict(mesh.shape)[a] for a in axes)


def _max_shard_count(keep, num_shards: int) -> tuple[int, int]:
    """``(largest kept count of one of the ``num_shards`` leading-axis shards of the host
    array ``keep``, tokens per shard)``."""
    keep = np.asarray(keep)
    if num_shards < 1 or keep.ndim < 1 or keep.shape[0] % num_shards:
        raise ValueError(
            f"keep has {keep.shape[0] if keep.ndim else 0} rows, not divisible into "
            f"{num_shards} token shards"
        )
    counts = keep.reshape(num_shards, -1).sum(axis=1)
    return int(counts.max()), keep.size // num_shards


def bucket_for_shards(
    keep,
    num_shards: int,
    *,
    multiple: int = DEFAULT_MULTIPLE,
    growth: float = DEFAULT_GROWTH,
    across_processes: bool = False,
) -> int:
    """The static bucket for ``sharded_token_logprobs``: the ladder rung (``bucket_size``)
    that holds the largest number of kept tokens of any token shard. Runs on the host,
    before the step.

    Args:
      keep: bool ``[B, ...]`` host array (numpy, or a fully addressable ``jax.Array``):
        the rows this process holds, split into ``num_shards`` equal shards along the
        leading axis (in the mesh's order of the token axes).
      num_shards: the number of token shards ``keep`` holds (the product of the token
        axes' sizes, divided by the process count when each process passes its own rows).
      multiple, growth: the ladder (``jaxhead.bucket_size``).
      across_processes: also take the maximum over all processes
        (``jax.experimental.multihost_utils.process_allgather``, a collective: every
        process must call this with the same arguments but its own ``keep``). False: this
        process's ``keep`` alone decides (right when every process holds the same rows).

    Returns:
      An int; with ``across_processes`` the same on every process.

    Raises:
      ValueError: rows not divisible by ``num_shards`` (both numbers named).
    """
    count, per_shard = _max_shard_count(keep, validation.static_int(num_shards, "num_shards", 1))
    if across_processes and jax.process_count() > 1:
        count = int(np.max(multihost_utils.process_allgather(np.int32(count))))
    return bucket_size(count, per_shard, multiple=multiple, growth=growth)


def _check_axes(mesh, token_axes, vocab_axis, vocab_size):
    names = tuple(mesh.axis_names)
    unknown = [a for a in (*token_axes, *(() if vocab_axis is None else (vocab_axis,)))
               if a not in names]
    if unknown:
        raise ValueError(f"mesh axes {unknown} are not in the mesh, whose axes are {names}")
    if vocab_axis is None:
        return
    if vocab_axis in token_axes:
        raise ValueError(
            f"vocab_axis={vocab_axis!r} is also a token axis {token_axes}: the devices of "
            f"the vocab axis must see the same tokens"
        )
    n = _axis_size(mesh, (vocab_axis,))
    if vocab_size % n:
        raise ValueError(
            f"vocab size {vocab_size} is not divisible by the {n} devices of vocab_axis "
            f"{vocab_axis!r}"
        )


def _placed(args, specs, mesh):
    """``args`` laid out as ``specs`` over ``mesh``'s Explicit axes (every axis of a
    default ``jax.make_mesh`` mesh): ``jax.shard_map`` takes arrays sharded over such axes
    only in its ``in_specs``' layout. Auto axes are the compiler's to move; a mesh without
    Explicit axes returns ``args`` as given."""
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types)
                if t == jax.sharding.AxisType.Explicit}
    if not explicit:
        return args

    def over_explicit(spec):
        dims = [tuple(a for a in ((d,) if isinstance(d, str) else d or ()) if a in explicit)
                for d in spec]
        return P(*(d or None for d in dims))

    return [jax.sharding.reshard(x, NamedSharding(mesh, over_explicit(s)))
            for x, s in zip(args, specs)]


def _fully_known(*xs) -> bool:
    return all(
        x is None or (validation.is_concrete(x) and getattr(x, "is_fully_addressable", True))
        for x in xs
    )


def sharded_token_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    keep: jax.Array | None = None,
    *,
    mesh: Mesh | None = None,
    token_axes: Sequence[str],
    vocab_axis: str | None = None,
    bucket: int | None = None,
    temperature=1.0,
    softcap: float | None = None,
    with_entropy: bool = True,
    impl: api.Impl | Literal["auto"] = "auto",
    config=None,
    min_logit=None,
    ignore_index: int | None = -100,
    weight_layout: WeightLayout = "hv",
) -> HeadOutput:
    """``jaxhead.token_logprobs`` with the tokens split over mesh axes, compacted per shard.

    The leading axis of ``hidden`` / ``labels`` / ``keep`` / a per-token ``temperature``
    is split over ``token_axes``; every token shard compacts its kept tokens into
    ``bucket`` slots and runs the head on them (``jax.shard_map``). Without
    ``vocab_axis``, ``weight`` is used whole on every device (the compiler gathers it if
    it is stored sharded), and every ``impl`` is available. With ``vocab_axis``, device
    ``k`` of that axis uses vocabulary entries ``[k V/n, (k+1) V/n)`` of ``weight``
    (columns of ``[H, V]``, rows of ``[V, H]``: its vocab dimension is split; an XLA
    implementation: the kernels have no vocab-parallel variant, so ``"auto"`` uses XLA) and
    the statistics are combined over the axis with ``pmax`` / ``psum``; the tokens are
    replicated over it (the compiler gathers ``hidden`` over that axis if it arrives split
    there: ``[N/shards, H]`` rows, much less than the ``[H, V]`` weight).

    Works eagerly and under ``jax.jit`` (in/out shardings or not).

    Args:
      hidden: ``[B, ..., H]`` float; weight: ``[H, V]`` (``weight_layout="hv"``) or
        ``[V, H]`` (``"vh"``, e.g. a tied embedding table, used as it is), same dtype.
      labels: int ``[B, ...]``; keep: bool ``[B, ...]`` or None (all tokens).
      mesh: a ``jax.sharding.Mesh`` (or ``AbstractMesh`` under ``jit``); None: the mesh
        set with ``jax.set_mesh``.
      token_axes: mesh axes the leading axis is split over, in order (e.g. a model's
        batch axes; ``()``: not split, every device computes every token).
      vocab_axis: mesh axis the vocabulary is split over, or None.
      bucket: static number of slots per token shard (``bucket_for_shards`` on the host).
        None: with a concrete ``keep``, chosen here by ``bucket_for_shards``; with a traced
        one, the shard's token count (correct, no saving).
      temperature, softcap, with_entropy, impl, config, min_logit, ignore_index,
        weight_layout: as ``jaxhead.token_logprobs``
        (with ``vocab_axis``, an explicit kernel ``impl`` raises ``KernelUnsupported``).

    Returns:
      ``HeadOutput(logprobs, entropy)`` float32 ``[B, ...]``, split like ``labels``; 0
      (and zero gradient) where not kept; NaN for a kept token that overflows its shard's
      bucket under ``jit``. Differentiable w.r.t. ``hidden`` and ``weight`` (its gradient
      in ``weight_layout``).

    Raises:
      ValueError: as ``jaxhead.token_logprobs``; a leading axis not divisible by the token
        shards or a vocabulary not divisible by the vocab axis (both numbers named); mesh
        axes that the mesh lacks; a vocab axis that is also a token axis; a kernel impl
        with ``vocab_axis`` (``KernelUnsupported``); with a concrete ``keep``, a bucket
        smaller than a shard's kept count. No mesh given or set.
      TypeError: as ``jaxhead.token_logprobs``.
    """
    validation.check_inputs(hidden, weight, labels, keep, temperature, softcap, min_logit,
                            weight_layout)
    hidden_size, vocab_size = layout.sizes(weight.shape, weight_layout)
    bucket = validation.static_bucket(bucket)
    labels, keep, ignored = api.ignored_labels(labels, keep, bucket, ignore_index)
    if _fully_known(labels, keep, temperature):
        validation.check_values(labels, keep, temperature, vocab_size)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty:
        raise ValueError("no mesh: pass mesh= or call under jax.set_mesh(mesh)")
    token_axes = tuple(token_axes)
    _check_axes(mesh, token_axes, vocab_axis, vocab_size)
    if labels.ndim < 1:
        raise ValueError(f"labels need a leading batch axis to split, got shape {labels.shape}")
    shards = _axis_size(mesh, token_axes)
    if labels.shape[0] % shards:
        sizes = {a: dict(mesh.shape)[a] for a in token_axes}
        raise ValueError(
            f"the head's batch of {labels.shape[0]} rows is not divisible by the {shards} "
            f"shards of mesh axes {sizes}; use a multiple of {shards}"
        )
    if keep is not None and _fully_known(keep):
        needed, per_shard = _max_shard_count(keep, shards)
        if bucket is None:
            bucket = bucket_size(needed, per_shard)
        elif needed > bucket:
            raise ValueError(
                f"bucket={bucket} is smaller than the {needed} kept tokens of the fullest "
                f"token shard; use jaxhead.bucket_for_shards(keep, {shards})"
            )

    tokens = math.prod(labels.shape) // shards
    rows = tokens if keep is None else min(tokens if bucket is None else bucket, tokens)
    n_vocab = 1 if vocab_axis is None else _axis_size(mesh, (vocab_axis,))
    spec = HeadSpec(rows, hidden_size, vocab_size, jnp.dtype(hidden.dtype).name,
                    softcap, with_entropy, vocab_axis, n_vocab, min_logit is not None,
                    weight_layout)
    with pallas_mode.per_device(mesh):  # a plan for one of mesh's devices, in shard_map
        head, made, padded = api.plan(impl, config, spec)

    per_row = [x.reshape(labels.shape) for x in api.row_inputs(temperature, min_logit,
                                                                labels.shape)]
    tok = P(token_axes or None)
    args = [hidden, weight, labels, *per_row] + ([] if keep is None else [keep])
    w_spec = P(None, vocab_axis) if weight_layout == "hv" else P(vocab_axis, None)
    specs = [tok, w_spec, tok, tok, tok] + ([] if keep is None else [tok])

    def body(h, w, y, temperature, min_logit, k=None):
        w = jax.lax.pcast(w, token_axes, to="varying") if token_axes else w
        n = math.prod(y.shape)
        # an invalid kept token of this shard: NaN gradients too (psum spreads dw's)
        h, w = invalid.nan_gradients_if(invalid.invalid_kept(y, k, vocab_size, padded), h, w)
        logp, ent = api.run_compacted(
            head, made, padded, h.reshape(n, h.shape[-1]), w, y.reshape(n).astype(jnp.int32),
            temperature.reshape(n), min_logit.reshape(n), None if k is None else k.reshape(n),
        )
        return logp.reshape(y.shape), ent.reshape(y.shape)

    run = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(tok, tok))
    logp, ent = api.mask_ignored(ignored, *run(*_placed(args, specs, mesh)))
    return HeadOutput(logp, ent if with_entropy else None)
