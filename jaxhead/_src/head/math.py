"""The head's tile math, shared by every implementation: the XLA scan, both Pallas kernels,
the vocab-parallel head and the sampler.

Plain ``jax.numpy`` on values already in fast memory, so the same code lowers through XLA,
Mosaic (TPU) and Triton (GPU) and runs in Pallas interpret mode. Shapes: a tile is float32
``[T, C]`` (T rows, C vocab columns); per-row values are float32 ``[T, 1]`` (or any shape
that broadcasts against the tile: the combine and finalise steps are elementwise).

A row's logits are ``l = z * inv_temperature`` with ``z = u`` or, with a soft-cap ``c``,
``z = c tanh(u/c)`` (Gemma 2), ``u = h . w`` accumulated in float32 and
``inv_temperature = 1 / temperature``, the float32 ``[T, 1]`` multiplier every function here
takes (each implementation forms it from the rows' temperatures with one XLA division: in
its scan bodies, or before a Pallas call). The online statistics of the columns seen so far
(docs/design.md, step 3) are kept as::

    m   = max_v z_v                                (pre-temperature; -inf before any column)
    r   = s - 1,  s = sum_v exp(d_v)               (-1 before any column)
    d_v = (z_v - m) * inv_temperature
    t   = sum_v exp(d_v) d_v                       (0 without entropy)
    zy  = z of the label column (0 while it is not among the columns)

and at the end ``log s = log1p(r)``, ``logZ = m * inv_temperature + log s``,
``logp = (zy - m) * inv_temperature - log s``, ``entropy = log s - t / s``.

Three choices keep float32 exact where it matters:

* ``s`` is stored as ``r = s - 1``: the maximum's own ``exp(0) = 1`` is never added, so a
  peaked row's ``s = 1 + 0.003`` keeps all the digits of ``0.003`` (and ``log s``, the
  entropy and every probability with them).
* The maximum is taken on ``z``, before the temperature, and every exponent is
  ``(z - m) * inv_temperature``: the difference is exact or nearly (Sterbenz) and only then
  scaled, so a temperature of 0.01 (logits ~1e4) or a large common shift of the logits costs
  no digits beyond the matmul's own rounding of ``u``.
* The backward pass rebuilds ``p_v = exp(d_v - log s)`` from ``m`` and ``log s`` (both
  saved), never from a rounded ``logZ``: with ``z = [512, 511]`` a float32 ``logZ`` is off by
  half an ulp of 512 (3e-5) and so would be every probability and gradient.

Columns outside the vocabulary or outside a truncated support (``valid`` false), and columns
whose logit is ``-inf``, count as probability 0: they add nothing to the statistics, their
``0 * log 0`` entropy term is 0, and their ``du`` is exactly 0 whatever the tile held there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Stats(NamedTuple):
    """Online log-sum-exp statistics of some vocab columns (see the module docstring):
    ``m`` (max of z), ``r`` (s - 1), ``t`` and ``zy``, float32, one value per row."""

    m: jax.Array
    r: jax.Array
    t: jax.Array
    zy: jax.Array


class Rows(NamedTuple):
    """Per-row results of a finished scan, float32: ``logp``, ``entropy`` (0 without
    entropy), and the backward pass's residuals ``m`` (max of z) and ``log_s``."""

    logp: jax.Array
    entropy: jax.Array
    m: jax.Array
    log_s: jax.Array


def matmul(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """float32 ``a . b`` contracting dim ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``
    (2-D operands). float32 operands use full float32 precision (no TF32 / bf16 passes);
    narrower ones multiply exactly and accumulate in float32."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def logits(u: jax.Array, softcap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """``(z, tanh(u / c) or None)``: the pre-temperature logits of the float32 tile ``u``."""
    if softcap is None:
        return u, None
    th = jnp.tanh(u * (1.0 / softcap))
    return softcap * th, th


def init_stats(shape) -> Stats:
    """Statistics of no columns: ``m = -inf``, ``r = -1``, ``t = zy = 0``."""
    zeros = jnp.zeros(shape, jnp.float32)
    return Stats(jnp.full(shape, -jnp.inf, jnp.float32), zeros - 1.0, zeros, zeros)


def _live(z, valid):
    """Columns with probability > 0 possible: valid and not ``-inf`` (NaN stays live, so it
    propagates)."""
    live = z != -jnp.inf
    return live if valid is None else live & valid


def support(z, inv_temperature, min_logit, hit, valid=None):
    """The columns of a tile that are in the distribution: ``valid`` (None: all) and, when
    ``min_logit`` (``[T, 1]``) is given, in the truncated support ``{l >= min_logit}`` with
    ``l = z * inv_temperature``, the label column always included (so that a token sampled from the
    support is scored there even when the trainer's logits round it just below the
    threshold). Returns None when every column is in."""
    if min_logit is None:
        return valid
    inside = (z * inv_temperature >= min_logit) | hit
    return inside if valid is None else inside & valid


def tile_exp(z, inv_temperature, valid):
    """``(m, d, e, live)`` of one tile: the max ``m`` ``[T, 1]`` of ``z`` over its live
    columns (``valid`` and not ``-inf``), ``d = (z - m) * inv_temperature`` and
    ``e = exp(d)``, both ``-inf`` / 0 on dead columns."""
    live = _live(z, valid)
    m = jnp.max(jnp.where(live, z, -jnp.inf), axis=-1, keepdims=True)
    d = jnp.where(live, (z - m) * inv_temperature, -jnp.inf)
    return m, d, jnp.exp(d), live


def tile_stats(z, inv_temperature, valid, hit, with_entropy: bool, terms=None) -> Stats:
    """``Stats`` of one tile ``z [T, C]`` (``inv_temperature [T, 1]``; ``valid`` bool
    broadcasting to the tile or None: every column; ``hit`` bool ``[T, C]``: the label
    column, or None). ``terms``: ``tile_exp(z, inv_temperature, valid)`` when the caller has
    it already."""
    m, d, e, live = tile_exp(z, inv_temperature, valid) if terms is None else terms
    at_max = live & (z == m)
    ties = jnp.sum(at_max.astype(jnp.float32), axis=-1, keepdims=True)
    rest = jnp.sum(jnp.where(at_max, 0.0, e), axis=-1, keepdims=True)
    t = jnp.zeros_like(m)
    if with_entropy:
        t = jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=-1, keepdims=True)
    zy = jnp.zeros_like(m) if hit is None else jnp.sum(jnp.where(hit, z, 0.0), axis=-1,
                                                         keepdims=True)
    return Stats(m, rest + (ties - 1.0), t, zy)


def _relative(m, r, t, big, inv_temperature, with_entropy: bool):
    """A part's contributions to ``s - 1`` and ``t`` of a union whose max is ``big``, and
    whether it holds that max (1.0 / 0.0). Parts at the max contribute ``r`` exactly; the
    others ``a (1 + r)`` with ``a = exp((m - big) inv_temperature)`` (0 for an empty part)."""
    at = m == big
    shift = jnp.where(at, 0.0, (m - big) * inv_temperature)
    a = jnp.exp(shift)
    r_part = jnp.where(at, r, a * r + a)
    t_part = jnp.zeros_like(r)
    if with_entropy:
        t_part = a * (t + jnp.where(a > 0, shift, 0.0) * (r + 1.0))
    return r_part, t_part, at.astype(jnp.float32)


def merge(x: Stats, y: Stats, inv_temperature, with_entropy: bool) -> Stats:
    """The statistics of the union of two disjoint column sets."""
    big = jnp.maximum(x.m, y.m)
    rx, tx, nx = _relative(x.m, x.r, x.t, big, inv_temperature, with_entropy)
    ry, ty, ny = _relative(y.m, y.r, y.t, big, inv_temperature, with_entropy)
    return Stats(big, (rx + ry) + (nx + ny - 1.0), tx + ty, x.zy + y.zy)


def combine(parts: Stats, inv_temperature, with_entropy: bool,
            reduce_max: Callable[[jax.Array], jax.Array],
            reduce_sum: Callable[[jax.Array], jax.Array]) -> Stats:
    """The statistics of the union of many disjoint column sets whose ``parts`` are reduced
    by ``reduce_max`` / ``reduce_sum``: over a stacked axis (``lambda x: x.max(0)``) or
    over a mesh axis (``lambda x: lax.pmax(x, axis)``, Megatron-LM's vocab-parallel
    cross-entropy, Shoeybi et al. 2019). Every part sees the same result."""
    big = reduce_max(parts.m)
    r, t, n = _relative(parts.m, parts.r, parts.t, big, inv_temperature, with_entropy)
    return Stats(big, reduce_sum(r) + (reduce_sum(n) - 1.0), reduce_sum(t),
                 reduce_sum(parts.zy))


def update(stats: Stats, z, inv_temperature, valid, hit, with_entropy: bool) -> Stats:
    """Fold one tile into the running statistics (``tile_stats`` then ``merge``)."""
    tile = tile_stats(z, inv_temperature, valid, hit, with_entropy)
    return merge(stats, tile, inv_temperature, with_entropy)


def finalize(stats: Stats, inv_temperature, with_entropy: bool) -> Rows:
    """``Rows`` from the statistics of the whole vocabulary (or support)."""
    log_s = jnp.log1p(stats.r)
    logp = (stats.zy - stats.m) * inv_temperature - log_s
    ent = log_s - stats.t / (stats.r + 1.0) if with_entropy else jnp.zeros_like(log_s)
    return Rows(logp, ent, stats.m, log_s)


def dlogits(z, th, inv_temperature, m, log_s, ent, g, e, valid, hit,
            with_entropy: bool) -> jax.Array:
    """float32 ``dL/du`` of one recomputed tile for ``L = sum g logp + sum e entropy``.

    ``dl_v = g (onehot_v - p_v) - e p_v (log p_v + entropy)``, then through the temperature
    and the soft-cap (``th = tanh(u / c)`` or None): ``du = dl * inv_temperature *
    (1 - th^2)``. Per-row ``[T, 1]``: ``inv_temperature``, ``m``, ``log_s``, ``ent`` (forward
    results), ``g``, ``e``. Exactly 0 on columns that are not ``valid``, on ``-inf`` logits
    (except the label's own ``g`` term), and on rows whose cotangents are both 0 (padding
    rows: whatever their logits, e.g. ``0 * -inf`` of a zero row against a ``-inf`` weight,
    they add nothing to ``dw``).
    """
    live = _live(z, valid)
    logp = jnp.where(live, (z - m) * inv_temperature - log_s, -jnp.inf)
    p = jnp.exp(logp)
    dl = g * (jnp.where(hit, 1.0, 0.0) - p)
    if with_entropy:
        dl = dl - e * jnp.where(p > 0, p * (logp + ent), 0.0)
    du = dl * inv_temperature
    if th is not None:
        du = du * (1.0 - th * th)
    read = (g != 0) | (e != 0)
    return jnp.where(read if valid is None else read & valid, du, 0.0)
