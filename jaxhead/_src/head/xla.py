"""The chunked head on plain XLA, for every backend: an online log-sum-exp over vocab chunks
(``jaxhead._src.head.math``), never ``[N, V]``, with a backward pass that recomputes each
logit tile. The baseline the Pallas kernels are tested against; with a ``vocab_axis`` it is
also the vocab-parallel head.

Forward: for each token chunk ``[T, H]`` (a scan), for each vocab chunk ``[H, C]`` (``[C,
H]`` of a ``"vh"`` weight, contracted on its H dimension: ``jaxhead._src.head.layout``; a
scan; a ragged last chunk runs once more at its own width, so no padded column exists),
``u = h @ w_c`` in float32, then ``math.update``. Residuals: the inputs, ``m``, ``log s``
and the entropy (``[B]`` float32 each).

Backward (``math.dlogits`` per recomputed tile; ``du`` is cast to the input dtype for the two
matmuls, which accumulate in float32, as in Liger-Kernel and Cut Cross-Entropy). Two loop
orders:

* fused (vocab outer, tokens inner): one recompute; ``dh`` accumulates in a float32
  ``[B, H]`` buffer and each ``dw`` chunk in a float32 ``[H, C]`` (``[C, H]``) one. Used while that
  ``[B, H]`` buffer is at most ``XlaConfig.fused_backward_max_bytes``.
* two-pass: tokens outer for ``dh`` (float32 ``[T, H]`` per chunk), then vocab outer for
  ``dw``: one more recompute, but temporaries independent of B, so memory stays flat as
  the number of tokens grows.

Neither ever holds a float32 copy of all of ``w``.

Hidden-split weight (``HeadSpec.hidden_axes``, inside ``jax.shard_map``: FSDP's layout,
each device holding ``H / n`` rows of ``[H, V]``): each vocab chunk is all-gathered over
those axes just before its tiles (``[H, C]``, one chunk at a time, never the whole weight),
the forward runs vocab chunks outer so that each chunk is gathered once per call, and each
``dw`` chunk is summed over the axes and cut back to the device's rows (``psum_scatter``).
A tile's arithmetic is the one-device arithmetic: the same ``[T, H] @ [H, C]`` products.

Vocab-parallel (``HeadSpec.vocab_axis``, inside ``jax.shard_map``): device ``k`` of the axis
holds columns ``[k V/n, (k+1) V/n)`` and the same rows; it scans its own columns and the
statistics are combined over the axis (``math.combine`` with ``pmax`` / ``psum``), as in
Megatron-LM's vocab-parallel cross-entropy (``megatron/core/tensor_parallel/
cross_entropy.py``; Shoeybi et al. 2019). Its backward recomputes its own tiles with the
global ``m`` and ``log s``: its own ``dw`` columns exactly and a partial ``dh``, summed over
the axis in float32. Communication: four ``[B]`` float32 vectors forward, one ``[B, H]``
float32 ``psum`` backward; nothing of size V.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from jaxhead._src.head import layout
from jaxhead._src.head import math as hm
from jaxhead._src.head import scan as sc
from jaxhead._src.head.base import HeadSpec, Implementation, differentiable

_ROW_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """Settings of the ``"xla"`` implementation.

    Attributes:
      token_chunk: rows per token chunk (shrunk to cover the rows in as few chunks, in
        multiples of 8).
      vocab_chunk: columns per vocab chunk (V need not be a multiple of it).
      fused_backward_max_bytes: the fused backward runs while its float32 ``[B, H]``
        accumulator fits in this many bytes; above, the two-pass backward.
      vocab_outer: the forward's loop order: vocab chunks outer, token chunks inner (each
        weight chunk read, or gathered, once per call; the running statistics of every
        row carried, four float32 ``[B]`` vectors), rather than tokens outer. A row's
        arithmetic is the same in both orders (the same tiles folded in the same chunk
        order). Always on when the weight's hidden dimension is split
        (``token_logprobs(weight_hidden_axes=...)``).

    Raises:
      ValueError: a size below 1 (named).
    """

    token_chunk: int = 512
    vocab_chunk: int = 8192
    fused_backward_max_bytes: int = 256 * 2**20
    vocab_outer: bool = False

    def __post_init__(self):
        for name in ("token_chunk", "vocab_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"XlaConfig.{name} must be an int >= 1, got {value!r}")
        if self.fused_backward_max_bytes < 0:
            raise ValueError("XlaConfig.fused_backward_max_bytes must be >= 0, got "
                             f"{self.fused_backward_max_bytes!r}")


@dataclasses.dataclass(frozen=True)
class XlaPlan:
    """The resolved static settings of one call (hashable: a ``custom_vjp`` static arg)."""

    spec: HeadSpec
    token_chunk: int
    vocab_chunk: int
    fused_backward: bool
    tuning: sc.Tuning
    vocab_outer: bool = False


def padded_rows(num_rows: int, token_chunk: int) -> tuple[int, int]:
    """``(padded, chunk)``: ``num_rows`` padded to whole token chunks, the chunk shrunk to
    the smallest multiple of 8 that covers the rows in the same number of chunks (padding
    is less than ``8 * chunks`` rows). ``(0, 8)`` for no rows."""
    if num_rows == 0:
        return 0, _ROW_ALIGN
    n = math.ceil(num_rows / token_chunk)
    chunk = math.ceil(math.ceil(num_rows / n) / _ROW_ALIGN) * _ROW_ALIGN
    return n * chunk, chunk


def make_plan(config: XlaConfig, spec: HeadSpec, tuning: sc.Tuning) -> tuple[XlaPlan, int]:
    """``(XlaPlan, padded rows)`` for ``spec`` with ``config`` and ``tuning``."""
    padded, chunk = padded_rows(spec.rows, config.token_chunk)
    acc_bytes = padded * spec.hidden_size * 4
    limit = max(config.fused_backward_max_bytes, chunk * spec.hidden_size * 4)
    plan = XlaPlan(spec, chunk, min(config.vocab_chunk, spec.local_vocab),
                   fused_backward=acc_bytes <= limit, tuning=tuning,
                   vocab_outer=config.vocab_outer or spec.hidden_shards > 1)
    return plan, padded


# ----------------------------------------------------------------------------- forward


def _min_logit(plan: XlaPlan, ml_t):
    """``[T, 1]`` thresholds of a truncated call, else None (no mask at all)."""
    return ml_t[:, None] if plan.spec.truncated else None


def _chunk_stats(plan: XlaPlan, h_t, w, y_t, temperature_t, ml_t) -> hm.Stats:
    """``Stats`` ``[T, 1]`` of the rows ``h_t`` over the columns of ``w``."""

    def step(stats, w_c, off):
        return _tile_update(plan, stats, h_t, w_c, off, y_t, temperature_t, ml_t)

    init = hm.init_stats((h_t.shape[0], 1))
    return sc.scan_vocab(plan.tuning, plan.vocab_chunk, step, init, w,
                         vary=(h_t, y_t, temperature_t, ml_t), axis=_vocab_dim(plan),
                         fetch=_fetch(plan))


def _tile_update(plan: XlaPlan, stats: hm.Stats, h_t, w_c, off, y_t, temperature_t, ml_t
                 ) -> hm.Stats:
    """``stats`` ``[T, 1]`` with the tile ``h_t @ w_c`` (columns from ``off``) folded in."""
    spec = plan.spec
    inv_temperature = 1.0 / temperature_t[:, None]
    z, _ = hm.logits(layout.logits(h_t, w_c, spec.weight_layout), spec.softcap)
    hit = (lax.broadcasted_iota(jnp.int32, z.shape, 1) + off) == y_t[:, None]
    valid = hm.support(z, inv_temperature, _min_logit(plan, ml_t), hit)
    return hm.update(stats, z, inv_temperature, valid, hit, spec.with_entropy)


def _vocab_dim(plan: XlaPlan) -> int:
    return layout.vocab_dim(plan.spec.weight_layout)


def _fetch(plan: XlaPlan):
    """The ``scan_vocab`` fetch of a weight split over ``hidden_axes`` (else None)."""
    spec = plan.spec
    if spec.hidden_shards == 1:
        return None
    return sc.gather_hidden(spec.hidden_axes, 1 - _vocab_dim(plan))


def _scatter_dw(plan: XlaPlan, dw_c):
    """A float32 ``dw`` chunk of the whole hidden dimension, summed over ``hidden_axes``
    and cut to this device's part (``psum_scatter``); as it is without them."""
    spec = plan.spec
    if spec.hidden_shards == 1:
        return dw_c
    dim = plan.tuning.dw_hidden_dim(spec.weight_layout)
    return lax.psum_scatter(dw_c, spec.hidden_axes, scatter_dimension=dim, tiled=True)


def _local_labels(plan: XlaPlan, labels, w):
    """Labels as vocab indices of this device's ``w`` (outside ``[0, V/n)``: not here)."""
    if plan.spec.vocab_axis is None:
        return labels
    return labels - lax.axis_index(plan.spec.vocab_axis) * w.shape[_vocab_dim(plan)]


def _forward(plan: XlaPlan, h, w, labels, temperature, min_logit) -> hm.Rows:
    tc, tuning = plan.token_chunk, plan.tuning
    dtype = tuning.tile_dtype(h.dtype)
    steps = jnp.arange(h.shape[0] // tc)
    local = _local_labels(plan, labels, w)
    xs = (steps, *sc.chunks(tc, local, temperature, min_logit))
    if plan.vocab_outer:
        stats = _stats_vocab_outer(plan, xs, h, w)
    else:
        def body(_, x, h, w):
            i, *per_row = x
            return None, _chunk_stats(plan, sc.rows(h, i, tc, dtype), w, *per_row)

        _, stats = sc.scan(tuning, body, None, xs, (h, w))
    stats = hm.Stats(*(s.reshape(labels.shape) for s in stats))
    inv_temperature = 1.0 / temperature
    axis = plan.spec.vocab_axis
    if axis is not None:
        stats = hm.combine(stats, inv_temperature, plan.spec.with_entropy,
                           lambda x: lax.pmax(x, axis), lambda x: lax.psum(x, axis))
    return hm.finalize(stats, inv_temperature, plan.spec.with_entropy)


def _stats_vocab_outer(plan: XlaPlan, xs, h, w) -> hm.Stats:
    """``Stats`` ``[B / T, T, 1]`` of every row: vocab chunks outer (each fetched once),
    token chunks inner, each token chunk's statistics carried between vocab chunks."""
    tc, tuning = plan.token_chunk, plan.tuning
    dtype = tuning.tile_dtype(h.dtype)

    def vocab_step(stats, w_c, off, h):
        def token_step(_, x, h, w_c):
            i, y_t, temperature_t, ml_t, *st = x
            h_t = sc.rows(h, i, tc, dtype)
            return None, _tile_update(plan, hm.Stats(*st), h_t, w_c, off, y_t,
                                      temperature_t, ml_t)

        _, stats = sc.scan(tuning, token_step, None, (*xs, *stats), (h, w_c))
        return hm.Stats(*stats)

    init = hm.init_stats((h.shape[0] // tc, tc, 1))
    return sc.scan_vocab(tuning, plan.vocab_chunk, vocab_step, init, w, (h,), vary=xs,
                         axis=_vocab_dim(plan), fetch=_fetch(plan))


# ----------------------------------------------------------------------------- backward


def _du_tile(plan: XlaPlan, h_t, w_c, off, y_t, temperature_t, ml_t, m_t, ls_t, ent_t, g_t,
             e_t):
    """``dL/du`` of one ``[T, C]`` tile, in the tile dtype, ready for the two matmuls."""
    spec = plan.spec
    inv_temperature = 1.0 / temperature_t[:, None]
    z, th = hm.logits(layout.logits(h_t, w_c, spec.weight_layout), spec.softcap)
    hit = (lax.broadcasted_iota(jnp.int32, z.shape, 1) + off) == y_t[:, None]
    valid = hm.support(z, inv_temperature, _min_logit(plan, ml_t), hit)
    per_row = (m_t, ls_t, ent_t, g_t, e_t)
    du = hm.dlogits(z, th, inv_temperature, *(x[:, None] for x in per_row), valid, hit,
                    spec.with_entropy)
    return du.astype(h_t.dtype)


def _backward_fused(plan: XlaPlan, xs, h, w, dh_dtype):
    """Vocab outer, tokens inner: one recompute, float32 ``dh [B, H]`` accumulator."""
    tc, tuning, lay = plan.token_chunk, plan.tuning, plan.spec.weight_layout
    dtype = tuning.tile_dtype(h.dtype)

    def vocab_step(carry, w_c, off, h):
        dh_acc, dw = carry

        def token_step(inner, x, h, w_c):
            dw_c, dh_acc = inner
            h_t = sc.rows(h, x[0], tc, dtype)
            du = _du_tile(plan, h_t, w_c, off, *x[1:])
            dh_t = sc.rows(dh_acc, x[0], tc) + layout.dhidden(du, w_c, lay)
            return (dw_c + tuning.dw_tile(h_t, du, lay), sc.put_rows(dh_acc, x[0], dh_t)), None

        init = (jnp.zeros(tuning.dw_chunk_shape(w_c.shape, lay), jnp.float32), dh_acc)
        (dw_c, dh_acc), _ = sc.scan(tuning, token_step, init, xs, (h, w_c))
        return dh_acc, out.write(dw, _scatter_dw(plan, dw_c), off)

    out = tuning.dw_buffer(w, lay)
    init = (jnp.zeros(h.shape, jnp.float32), out.init)
    dh, dw = sc.scan_vocab(tuning, plan.vocab_chunk, vocab_step, init, w, (h,), vary=xs,
                           axis=_vocab_dim(plan), fetch=_fetch(plan))
    return dh.astype(dh_dtype), out.finish(dw)


def _backward_two_pass(plan: XlaPlan, xs, h, w, dh_dtype):
    """Tokens outer for ``dh``, then vocab outer for ``dw``: temporaries independent of B."""
    tc, tuning, lay = plan.token_chunk, plan.tuning, plan.spec.weight_layout
    dtype, axis = tuning.tile_dtype(h.dtype), _vocab_dim(plan)

    def dh_chunk(dh, x, h, w):
        h_t = sc.rows(h, x[0], tc, dtype)

        def step(acc, w_c, off):
            return acc + layout.dhidden(_du_tile(plan, h_t, w_c, off, *x[1:]), w_c, lay)

        init = jnp.zeros(h_t.shape, jnp.float32)
        acc = sc.scan_vocab(tuning, plan.vocab_chunk, step, init, w, vary=(h_t, x), axis=axis,
                            fetch=_fetch(plan))
        return sc.put_rows(dh, x[0], acc), None

    dh, _ = sc.scan(tuning, dh_chunk, jnp.zeros(h.shape, dh_dtype), xs, (h, w))

    def dw_step(dw, w_c, off, h):
        def token_step(acc, x, h, w_c):
            h_t = sc.rows(h, x[0], tc, dtype)
            return acc + tuning.dw_tile(h_t, _du_tile(plan, h_t, w_c, off, *x[1:]), lay), None

        init = jnp.zeros(tuning.dw_chunk_shape(w_c.shape, lay), jnp.float32)
        acc, _ = sc.scan(tuning, token_step, init, xs, (h, w_c))
        return out.write(dw, _scatter_dw(plan, acc), off)

    out = tuning.dw_buffer(w, lay)
    dw = sc.scan_vocab(tuning, plan.vocab_chunk, dw_step, out.init, w, (h,), vary=xs,
                       axis=axis, fetch=_fetch(plan))
    return dh, out.finish(dw)


def _backward(plan: XlaPlan, h, w, labels, temperature, min_logit, m, log_s, ent, g, e):
    """``(dh, dw)`` of ``sum(g * logp) + sum(e * entropy)`` by recomputing each tile."""
    per_row = (_local_labels(plan, labels, w), temperature, min_logit, m, log_s, ent, g, e)
    xs = (jnp.arange(h.shape[0] // plan.token_chunk), *sc.chunks(plan.token_chunk, *per_row))
    run = _backward_fused if plan.fused_backward else _backward_two_pass
    axis = plan.spec.vocab_axis
    if axis is None:
        return run(plan, xs, h, w, h.dtype)
    dh, dw = run(plan, xs, h, w, jnp.float32)  # partial dh: summed unrounded
    return lax.psum(dh, axis).astype(h.dtype), dw


chunked_head = differentiable(_forward, _backward)


#: ``impl="xla"``: the backend-neutral chunked scan (``XlaConfig``).
XLA = Implementation(XlaConfig, lambda config, spec: make_plan(config or XlaConfig(), spec,
                                                               sc.Tuning()), chunked_head)
