"""Vocab-parallel chunked head: the vocabulary split over one mesh axis, inside ``shard_map``.

Each of the ``n`` devices of the vocab axis holds the columns ``[k V/n, (k+1) V/n)`` of
the head weight and the same (replicated) hidden rows. As in Megatron-LM's vocab-parallel
cross-entropy (``VocabParallelCrossEntropy``, Shoeybi et al. 2019), no device forms a
logit outside its shard: each runs the XLA chunked scan (``jaxhead.xla.partial_stats``)
over its own columns and the per-row statistics are combined across the axis.

Forward, with ``m_k, r_k, t_k, zy_k`` the statistics of shard ``k`` (``jaxhead.xla``)::

    M = pmax(m_k);  a_k = exp(m_k - M)
    r = psum(r_k if m_k == M else a_k (1 + r_k)) + (psum(m_k == M) - 1)   (= S - 1)
    t = psum(a_k (t_k + (m_k - M)(1 + r_k)))                              (relative to M)
    zy = psum(zy_k)   (only the shard owning the label has it)

so ``r`` keeps the float32 precision of a tiny ``S - 1`` exactly as the single-device
scan does (the max shard's ``exp(0) = 1`` is never added). Backward (``custom_vjp``):
each shard recomputes its own logit tiles with the *global* ``logZ`` and entropy
(``jaxhead.xla.backward`` on its local labels), which gives its own ``dW`` columns
exactly and a partial ``dh``; ``dh = psum(partial dh)`` in float32 over the axis.
Communication per call: a few ``[B]`` float32 vectors forward, one ``[B, H]`` float32
``psum`` backward; nothing of size V.

Source: Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxhead import xla


def combine(stats: xla.PartialStats, axis: str, with_entropy: bool) -> xla.PartialStats:
    """The statistics of all vocab columns from each shard's ``stats`` (inside
    ``shard_map``, over mesh axis ``axis``); every shard returns the same values."""
    big = lax.pmax(stats.m, axis)
    at_max = stats.m == big
    a = jnp.exp(stats.m - big)
    own = jnp.where(at_max, stats.r, a * (1.0 + stats.r))
    r = lax.psum(own, axis) + (lax.psum(at_max.astype(jnp.float32), axis) - 1.0)
    if with_entropy:
        t = lax.psum(a * (stats.t + (stats.m - big) * (1.0 + stats.r)), axis)
    else:
        t = jnp.zeros_like(r)
    zy = lax.psum(stats.zy, axis)
    found = lax.psum(stats.found.astype(jnp.int32), axis) > 0
    return xla.PartialStats(big, r, t, zy, found)


def _local_labels(labels, w_local, axis):
    """Global label ids minus this shard's first column (outside ``[0, V/n)``: not here)."""
    return labels - lax.axis_index(axis) * w_local.shape[1]


def _forward(cfg: xla.ChunkConfig, axis: str, h, w_local, labels, inv_temp):
    local = _local_labels(labels, w_local, axis)
    stats = xla.partial_stats(cfg, h, w_local, local, inv_temp)
    return xla.finish(combine(stats, axis, cfg.with_entropy), cfg.with_entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked_head(cfg: xla.ChunkConfig, axis: str, h, w_local, labels, inv_temp):
    """float32 ``(logZ, logp, entropy)``, each ``[B]``, with the vocab split over ``axis``.

    Call inside ``jax.shard_map`` (``jaxhead.sharded_token_logprobs`` does).

    Args:
      cfg: ``jaxhead.xla.ChunkConfig`` made for the *local* vocab size ``V / n``.
      axis: the mesh axis the vocabulary is split over (``n`` devices).
      h: ``[B, H]`` hidden rows, the same on every device of ``axis``.
      w_local: ``[H, V / n]`` this device's columns, shard ``k = axis_index(axis)``.
      labels: int32 ``[B]`` global label ids in ``[0, V)`` (outside: ``logp = NaN``).
      inv_temp: float32 ``[B]``, ``1 / temperature`` (no gradient).

    Returns:
      ``(logZ, logp, entropy)`` float32 ``[B]``, equal on every device of ``axis``.
      Differentiable w.r.t. ``h`` (gradient summed over the axis) and ``w_local`` (this
      shard's columns).
    """
    return _forward(cfg, axis, h, w_local, labels, inv_temp)


def _fwd(cfg, axis, h, w_local, labels, inv_temp):
    logz, logp, ent = _forward(cfg, axis, h, w_local, labels, inv_temp)
    return (logz, logp, ent), (h, w_local, labels, inv_temp, logz, ent)


def _bwd(cfg, axis, res, cts):
    _, g, e = cts
    h, w_local, labels, inv_temp, logz, ent = res
    local = _local_labels(labels, w_local, axis)
    dh, dw = xla.backward(cfg, h, w_local, local, inv_temp, logz, ent, g, e,
                          dh_dtype=jnp.float32)
    return lax.psum(dh, axis).astype(h.dtype), dw, None, None


chunked_head.defvjp(_fwd, _bwd)
