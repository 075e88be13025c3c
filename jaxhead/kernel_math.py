"""Tile formulas shared by the Pallas kernels (``pallas_tpu``, ``pallas_triton``).

Plain ``jax.numpy`` on values already loaded from fast memory, so the same code lowers
through Mosaic (TPU) and Triton (GPU) and runs in interpret mode. Shapes: a logit tile is
float32 ``[T, C]`` (T rows, C vocab columns); per-row values are float32 ``[T, 1]``; masks
are bool and broadcast against the tile (``valid`` is ``[1, C]`` or ``[T, C]``, ``hit`` is
``[T, C]``). The formulas are those of ``jaxhead.xla`` (DESIGN.md, steps 3 and 4):

    l = z * inv_temp,  z = u  or  c * tanh(u / c)
    m' = max(m, max_j l_j);  a = exp(m - m')   (0 before the first tile)
    s' = a s + sum_j exp(l_j - m')
    t' = a (t + (m - m') s) + sum_j exp(l_j - m') (l_j - m')
    logZ = m + log s;  logp = (l_y - m) - log s;  entropy = log s - t / s
    dl = g (onehot_y - p) - e p (log p + entropy);  du = dl * inv_temp * (1 - tanh^2)

Columns outside the vocabulary (``valid`` false) enter the statistics as ``-inf`` logits,
contribute nothing, and get exactly zero ``du`` whatever garbage the tile held there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

RowStats = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # (m, s, t, label logit)


def matmul(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """float32 ``a . b`` contracting dim ``contract[0]`` of ``a`` with ``contract[1]`` of
    ``b`` (2-D operands). float32 operands use full float32 precision (no TF32 / bf16
    passes); narrower ones multiply exactly and accumulate in float32."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def logits(u: jax.Array, inv_temp: jax.Array, softcap: float | None):
    """``(l, tanh(u / c) or None)`` from the float32 tile ``u [T, C]``; ``inv_temp [T, 1]``."""
    if softcap is None:
        return u * inv_temp, None
    th = jnp.tanh(u * (1.0 / softcap))
    return (softcap * th) * inv_temp, th


def init_stats(rows: int) -> RowStats:
    """``[rows, 1]`` statistics before the first tile: ``m = -inf``, ``s = t = zy = 0``."""
    zeros = jnp.zeros((rows, 1), jnp.float32)
    return jnp.full((rows, 1), -jnp.inf, jnp.float32), zeros, zeros, zeros


def update_stats(stats: RowStats, l, valid, hit, with_entropy: bool) -> RowStats:
    """Fold one tile ``l [T, C]`` into the running ``(m, s, t, label logit)``.

    ``valid`` (None: every column valid) masks columns past the vocabulary; ``hit`` marks
    the label column of each row (already false on invalid columns).
    """
    m, s, t, zy = stats
    if valid is not None:
        l = jnp.where(valid, l, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(l, axis=1, keepdims=True))
    seen = s > 0
    a = jnp.where(seen, jnp.exp(m - m_new), 0.0)
    e = jnp.exp(l - m_new)
    s_new = a * s + jnp.sum(e, axis=1, keepdims=True)
    if with_entropy:
        shift = jnp.where(seen, (m - m_new) * s, 0.0)
        el = e * (l - m_new)
        if valid is not None:
            el = jnp.where(valid, el, 0.0)
        t = a * (t + shift) + jnp.sum(el, axis=1, keepdims=True)
    zy = zy + jnp.sum(jnp.where(hit, l, 0.0), axis=1, keepdims=True)
    return m_new, s_new, t, zy


def combine_stats(stats: RowStats) -> RowStats:
    """Merge partial statistics stacked on axis 0 (one per disjoint vocab range) into one.

    Each range must have seen at least one valid column (finite ``m``, ``s > 0``).
    """
    m, s, t, zy = stats
    m_all = jnp.max(m, axis=0)
    a = jnp.exp(m - m_all)
    s_all = jnp.sum(a * s, axis=0)
    t_all = jnp.sum(a * (t + (m - m_all) * s), axis=0)
    return m_all, s_all, t_all, jnp.sum(zy, axis=0)


def finalize(stats: RowStats, with_entropy: bool):
    """float32 ``(logZ, logp, entropy)`` from the statistics over the whole vocabulary;
    entropy is zeros without ``with_entropy``."""
    m, s, t, zy = stats
    log_s = jnp.log(s)
    ent = log_s - t / s if with_entropy else jnp.zeros_like(s)
    return m + log_s, (zy - m) - log_s, ent


def dlogits(l, th, inv_temp, logz, ent, g, e, valid, hit, with_entropy: bool) -> jax.Array:
    """float32 ``dL/du [T, C]`` of one recomputed tile; exactly 0 on invalid columns.

    Per-row ``[T, 1]``: ``inv_temp``, ``logz``, ``ent`` (forward results), ``g = dL/dlogp``,
    ``e = dL/dentropy``. ``th`` is ``tanh(u / c)`` or None without a soft-cap.
    """
    logp = l - logz
    p = jnp.exp(logp)
    dl = g * (jnp.where(hit, 1.0, 0.0) - p)
    if with_entropy:
        dl = dl - e * p * (logp + ent)
    du = dl * inv_temp
    if th is not None:
        du = du * (1.0 - th * th)
    if valid is not None:
        du = jnp.where(valid, du, 0.0)
    return du
