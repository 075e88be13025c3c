"""Invariant numerics (``ModelConfig.numerics = "invariant"``): a token's results do not
depend on the batch it is computed in.

XLA:CPU's matmul is not batch-invariant: the rows of ``[M, H] @ [H, F]`` differ in their
last bits with ``M`` (its blocking and vectorisation follow the shape). A computation on a
fixed ``[ROW_TILE, ...]`` shape is: so every per-token computation of the decoder (norms,
projections, q/k norms, RoPE, the MLP) runs under ``row_tiled`` on row tiles of one shape,
attention reads its keys in blocks at fixed absolute positions
(``models.attention.invariant``), and the head's log-probs come from one tiled call shared
by the trainer and the sampler (``head_logprobs``). The sampler's log-probs of a
completion then equal the trainer's bit for bit, on the same hardware, dtype and device
count. The approach is that of the batch-invariant kernels behind vLLM's and SGLang's
deterministic modes (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025:
fixed tiles, no split reductions), written here with fixed shapes under ``lax.map``.

What the mode does not cover is refused by name (``check_config``, ``check_mesh``): MoE
layers, a mesh of more than one device, and op choices without an invariant variant.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxhead

#: ``ModelConfig.numerics`` values.
NUMERICS = ("default", "invariant")
#: Rows per tile of every per-token computation (and of the head's token chunk, and of
#: the attention's queries). Decode batches are padded to it: 32 costs a rollout of 32
#: rows nothing over 16 and halves the update's tile loop (docs/numerics.md, measured
#: with benchmarks/invariant.py).
ROW_TILE = 32
#: Vocabulary columns per chunk of the head's scan, on both sides.
VOCAB_CHUNK = 8192
#: The only attention implementations the mode accepts (``"auto"`` resolves to it).
ATTENTION = ("auto", "invariant")


def check_config(cfg) -> None:
    """Check ``cfg.numerics`` and, under ``"invariant"``, what the mode cannot run yet.

    Raises:
      ValueError: an unknown ``numerics``; under ``"invariant"``, MoE layers
        (``num_experts > 0``) or an ``attention_impl`` other than ``"auto"`` /
        ``"invariant"`` (the value named).
    """
    if cfg.numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {cfg.numerics!r}")
    if cfg.numerics != "invariant":
        return
    if cfg.num_experts:
        raise ValueError(f"numerics='invariant' covers dense models only; this config has "
                         f"num_experts={cfg.num_experts} (MoE layers have no invariant "
                         f"variant yet)")
    if cfg.attention_impl not in ATTENTION:
        raise ValueError(f"numerics='invariant' needs attention_impl in {ATTENTION}; "
                         f"attention_impl={cfg.attention_impl!r} has no invariant variant")


def check_mesh(mesh) -> None:
    """Refuse a mesh of more than one device under ``numerics="invariant"``.

    Raises:
      ValueError: ``mesh`` (a ``jax.sharding.Mesh`` or None) has more than one device.
    """
    if mesh is not None and mesh.size > 1:
        raise ValueError(f"numerics='invariant' runs on one device; the mesh in context has "
                         f"{mesh.size} ({dict(mesh.shape)}): sharded matmuls and the "
                         f"context axis have no invariant variant yet")


def row_tiled(fn: Callable, *xs: jax.Array, lead: int = 2, tile: int = ROW_TILE):
    """``fn`` applied to ``xs`` in row tiles of one shape.

    Args:
      fn: ``fn(*tiles) -> pytree`` of arrays: ``[tile, ...]`` in, ``[tile, ...]`` out, row
        ``i`` of each output a function of row ``i`` of the inputs only; a pure function
        of its arguments and of arrays it closes over (parameters: differentiable).
      xs: arrays whose first ``lead`` dimensions are the same (e.g. ``[B, T, H]`` hidden
        states and ``[B, T]`` positions with ``lead=2``): the token rows.
      lead: how many leading dimensions index the rows.
      tile: rows per tile.

    The rows (the ``lead`` dimensions flattened) are padded with zeros to a multiple of
    ``tile`` and mapped with ``jax.lax.map`` over ``[rows / tile, tile, ...]``, so ``fn``
    compiles once for one shape; the padding rows' outputs are dropped. Only these
    forward values must be the sampler's: the gradient (to ``xs`` and to the arrays
    ``fn`` closes over, hoisted by ``jax.closure_convert``) is that of ``fn`` on all the
    rows at once (``jax.vmap`` over the tiles), recomputed in the backward pass. It is
    the gradient of the same function to float rounding, without a loop of tile-sized
    backward steps and the residuals each would save (the same split as the invariant
    attention's, ``models.attention.invariant.self_attention``).

    Returns:
      ``fn``'s pytree with the ``lead`` dimensions restored.

    Raises:
      ValueError: the arrays' leading dimensions differ (shapes named).
    """
    dims = xs[0].shape[:lead]
    if any(x.shape[:lead] != dims for x in xs):
        raise ValueError(f"row_tiled: the first {lead} dimensions differ: "
                         f"{[x.shape for x in xs]}")
    n = math.prod(dims)
    padded = -(-n // tile) * tile

    def tiles(x):
        x = pad_rows(x.reshape(n, *x.shape[lead:]), padded)
        return x.reshape(padded // tile, tile, *x.shape[1:])

    tiled = tuple(tiles(x) for x in xs)
    converted, consts = jax.closure_convert(fn, *(x[0] for x in tiled))
    out = _mapped(converted, tiled, tuple(consts))
    return jax.tree.map(
        lambda y: y.reshape(padded, *y.shape[2:])[:n].reshape(*dims, *y.shape[2:]), out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mapped(fn, tiled, consts):
    """``fn(*tile, *consts)`` over ``tiled`` (``[tiles, tile, ...]`` each) with
    ``lax.map``."""
    return jax.lax.map(lambda t: fn(*t, *consts), tiled)


def _mapped_fwd(fn, tiled, consts):
    return _mapped(fn, tiled, consts), (tiled, consts)


def _mapped_bwd(fn, res, dout):
    tiled, consts = res

    def whole(tiled, consts):  # every tile at once: one large matmul per op
        return jax.vmap(lambda *t: fn(*t, *consts))(*tiled)

    _, vjp = jax.vjp(whole, tiled, consts)
    return vjp(dout)


_mapped.defvjp(_mapped_fwd, _mapped_bwd)


def pad_rows(x: jax.Array, rows: int, value=0) -> jax.Array:
    """``x`` ``[n, ...]`` padded with ``value`` to ``rows`` rows."""
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1),
                   constant_values=value)


def head_logprobs(lm_head, hidden: jax.Array, labels: jax.Array, keep, *, temperature,
                  bucket: int | None = None, with_entropy: bool = True
                  ) -> jaxhead.HeadOutput:
    """The head's float32 log-probs (and entropy) of ``labels``, computed the one way both
    the trainer (``Transformer.token_logprobs``) and the sampler
    (``models.generate.api.draw``) compute them under ``numerics="invariant"``.

    The rows are flattened and padded to a multiple of ``ROW_TILE`` (padding rows not
    kept), ``bucket`` is rounded up to a multiple of it, and ``jaxhead.token_logprobs``
    runs with ``impl="xla"`` and ``XlaConfig(token_chunk=ROW_TILE, vocab_chunk=
    VOCAB_CHUNK)``: the kept rows are compacted into the bucket (a gather, also when every
    row is kept) and go through ``[ROW_TILE, H] x [H, VOCAB_CHUNK]`` tiles, whatever the
    batch, the bucket or the row they sit in. The entropy is always computed (its flag
    changes the compiled tile) and returned only ``with_entropy``.

    Args:
      lm_head: the model's ``jaxhead.LMHead``.
      hidden: ``[..., H]``; labels: int ``[...]``; keep: bool ``[...]`` or None (all).
      temperature: scalar or float ``[...]`` (> 0).
      bucket: as ``jaxhead.token_logprobs`` (None: chosen on the host from a concrete
        ``keep``); rounded up to a multiple of ``ROW_TILE``.

    Returns:
      ``jaxhead.HeadOutput`` float32 ``[...]`` (0 where not kept).

    Raises:
      ValueError / TypeError: as ``jaxhead.token_logprobs``.
    """
    shape = labels.shape
    n = math.prod(shape)
    dtype = lm_head.dtype or hidden.dtype
    rows = -(-max(n, 1) // ROW_TILE) * ROW_TILE
    h = pad_rows(hidden.reshape(n, hidden.shape[-1]).astype(dtype), rows)
    y = pad_rows(labels.reshape(n), rows)
    # always a keep mask: the rows reach the head through jaxhead's compaction (a gather
    # at indices computed at run time), never as a padded array the compiler could narrow
    keep = jnp.ones(shape, bool) if keep is None else keep
    k = pad_rows(keep.reshape(n), rows, False)
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), shape).reshape(n)
    t = pad_rows(t, rows, 1.0)
    if bucket is None:
        try:
            bucket = jaxhead.bucket_size(int(np.count_nonzero(np.asarray(k))), rows)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            bucket = rows
    bucket = min(-(-int(bucket) // ROW_TILE) * ROW_TILE, rows)
    out = jaxhead.token_logprobs(
        h, lm_head.weight(h.dtype), y, k, temperature=t, softcap=lm_head.softcap,
        with_entropy=True, bucket=bucket, impl="xla",
        config=jaxhead.XlaConfig(token_chunk=ROW_TILE, vocab_chunk=VOCAB_CHUNK),
        weight_layout=lm_head.weight_layout, ignore_index=None)
    logp = out.logprobs[:n].reshape(shape)
    ent = out.entropy[:n].reshape(shape) if with_entropy else None
    return jaxhead.HeadOutput(logp, ent)
