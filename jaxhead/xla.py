"""Chunked LM head on plain XLA: float32 online log-sum-exp over vocab chunks, no ``[N, V]``.

This is the default implementation on every backend and the baseline the Pallas kernels are
tested against. Inputs are the *compacted* rows (see ``jaxhead.compaction``): ``h [B, H]``,
``w [H, V]``, ``labels [B]``, ``inv_temp [B]``.

Forward, per token chunk ``[T, H]``, scanning vocab chunks ``[H, C]`` (DESIGN.md, step 3)::

    u = h @ w_c                      (float32 accumulation, never rounded to bf16)
    z = c * tanh(u / c)              (optional soft-cap, Gemma 2)
    l = z * inv_temp                 (temperature)
    m' = max(m, max_j l_j);  a = exp(m - m')
    s = a * s + sum_j exp(l_j - m')
    t = a * (t + (m - m') * s) + sum_j exp(l_j - m') * (l_j - m')
    logZ = m + log s;  logp = l_y - logZ;  entropy = log s - t / s

``t`` is kept relative to the running max so that the entropy of a peaked row does not
cancel two large numbers. A vocab size that is not a multiple of the chunk is handled by a
last, narrower chunk: there are no padded vocab columns, so nothing adds a spurious
``exp(0)`` to ``s``.

Backward recomputes each logit tile (residuals: the inputs, ``logZ`` and ``entropy``, all
``[B]`` besides ``h`` and ``w``). With ``g = dL/dlogp`` and ``e = dL/dentropy``::

    dl = g * (onehot_y - p) - e * p * (log p + entropy)
    du = dl * inv_temp * (1 - tanh(u / c)^2)
    dh = du @ w^T;  dw = h^T @ du

``du`` is cast to the input dtype for the two matmuls, which accumulate in float32 (as in
Liger-Kernel and Cut Cross-Entropy). Two loop orders exist:

* fused (vocab outer, tokens inner): one recompute; ``dh`` accumulates in a float32
  ``[B, H]`` buffer and each ``dw`` chunk in a float32 ``[H, C]`` one. Used while that
  ``[B, H]`` buffer is at most ``FUSED_BACKWARD_MAX_BYTES``.
* two-pass: tokens outer for ``dh`` (float32 ``[T, H]`` per chunk), then vocab outer for
  ``dw``: one more recompute, but temporaries independent of B. Used above the limit, so
  memory stays flat as the number of tokens grows.

Neither ever holds a float32 copy of all of ``w``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_VOCAB_CHUNK = 4096
FUSED_BACKWARD_MAX_BYTES = 256 * 2**20
_ROW_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Static settings of one head call (hashable: a ``custom_vjp`` non-differentiable arg).

    Attributes:
      softcap: soft-cap ``c`` (``z = c tanh(u / c)``) or None.
      with_entropy: compute the entropy (and take its cotangent).
      token_chunk: rows per token chunk ``T``.
      vocab_chunk: columns per vocab chunk ``C``.
      fused_backward: use the single-recompute backward (see the module docstring).
    """

    softcap: float | None
    with_entropy: bool
    token_chunk: int
    vocab_chunk: int
    fused_backward: bool


def padded_rows(num_rows: int, token_chunk: int) -> tuple[int, int]:
    """Rows after padding ``num_rows`` to whole token chunks, and the chunk used.

    The chunk is shrunk to the smallest multiple of 8 that covers ``num_rows`` in the same
    number of chunks, so the padding is less than ``8 * num_chunks`` rows.

    Returns:
      ``(padded, chunk)`` with ``padded % chunk == 0`` and ``padded >= num_rows``.
    """
    if num_rows == 0:
        return 0, _ROW_ALIGN
    n = math.ceil(num_rows / token_chunk)
    chunk = math.ceil(math.ceil(num_rows / n) / _ROW_ALIGN) * _ROW_ALIGN
    return n * chunk, chunk


def make_config(
    num_rows: int,
    hidden_size: int,
    vocab_size: int,
    *,
    softcap: float | None,
    with_entropy: bool,
    token_chunk: int,
    vocab_chunk: int,
) -> tuple[ChunkConfig, int]:
    """The ``ChunkConfig`` for ``num_rows`` rows, and the padded row count it needs.

    Raises:
      ValueError: a chunk size below 1.
    """
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(
            f"token_chunk and vocab_chunk must be >= 1, got {token_chunk} and {vocab_chunk}"
        )
    padded, chunk = padded_rows(num_rows, token_chunk)
    limit = max(FUSED_BACKWARD_MAX_BYTES, chunk * hidden_size * 4)
    cfg = ChunkConfig(
        softcap=softcap,
        with_entropy=with_entropy,
        token_chunk=chunk,
        vocab_chunk=min(vocab_chunk, vocab_size),
        fused_backward=padded * hidden_size * 4 <= limit,
    )
    return cfg, padded


# ----------------------------------------------------------------------------- tiles


def _matmul(a, b, dims):
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _logits_tile(h, w_c, inv_temp, softcap):
    """float32 ``(l, tanh(u / c) or None)`` for one ``[T, C]`` tile."""
    u = _matmul(h, w_c, ((1,), (0,)))
    if softcap is None:
        return u * inv_temp[:, None], None
    th = jnp.tanh(u * (1.0 / softcap))
    return (softcap * th) * inv_temp[:, None], th


def _vocab_chunks(vocab_size: int, chunk: int) -> tuple[int, int]:
    return vocab_size // chunk, vocab_size % chunk


def _scan_vocab(step, carry, w, chunk):
    """Apply ``carry = step(carry, w_c, offset)`` to every vocab chunk of ``w [H, V]``.

    Full chunks run in a ``lax.scan``; a ragged remainder runs once more with its own
    (narrower, static) width, so no padded vocab column exists.
    """
    hidden, vocab = w.shape
    n_full, tail = _vocab_chunks(vocab, chunk)

    def body(c, i):
        off = i * chunk
        w_c = lax.dynamic_slice_in_dim(w, off, chunk, axis=1)
        return step(c, w_c, off), None

    if n_full:
        carry, _ = lax.scan(body, carry, jnp.arange(n_full))
    if tail:
        carry = step(carry, w[:, n_full * chunk :], n_full * chunk)
    return carry


# ----------------------------------------------------------------------------- forward


def _forward_chunk(cfg: ChunkConfig, h_t, w, y_t, it_t):
    rows = h_t.shape[0]
    f32 = jnp.float32
    init = (
        jnp.full((rows,), -jnp.inf, f32),  # running max m
        jnp.zeros((rows,), f32),  # s = sum exp(l - m)
        jnp.zeros((rows,), f32),  # t = sum exp(l - m) (l - m)
        jnp.zeros((rows,), f32),  # label logit
        jnp.zeros((rows,), bool),  # label seen
    )

    def step(carry, w_c, off):
        m, s, t, zy, found = carry
        l, _ = _logits_tile(h_t, w_c, it_t, cfg.softcap)
        m_new = jnp.maximum(m, l.max(axis=1))
        seen = s > 0
        a = jnp.where(seen, jnp.exp(m - m_new), 0.0)
        e = jnp.exp(l - m_new[:, None])
        s_new = a * s + e.sum(axis=1)
        if cfg.with_entropy:
            shift = jnp.where(seen, (m - m_new) * s, 0.0)
            t = a * (t + shift) + (e * (l - m_new[:, None])).sum(axis=1)
        hit = (lax.broadcasted_iota(jnp.int32, l.shape, 1) + off) == y_t[:, None]
        zy = zy + jnp.where(hit, l, 0.0).sum(axis=1)
        found = found | hit.any(axis=1)
        return m_new, s_new, t, zy, found

    m, s, t, zy, found = _scan_vocab(step, init, w, cfg.vocab_chunk)
    log_s = jnp.log(s)
    logz = m + log_s
    logp = jnp.where(found, (zy - m) - log_s, jnp.nan)
    ent = log_s - t / s if cfg.with_entropy else jnp.zeros_like(logz)
    return logz, logp, ent


def _forward(cfg: ChunkConfig, h, w, labels, inv_temp):
    rows, hidden = h.shape
    tc = cfg.token_chunk
    if rows == 0:
        z = jnp.zeros((0,), jnp.float32)
        return z, z, z
    nt = rows // tc
    xs = (h.reshape(nt, tc, hidden), labels.reshape(nt, tc), inv_temp.reshape(nt, tc))

    def body(_, x):
        return None, _forward_chunk(cfg, x[0], w, x[1], x[2])

    _, (logz, logp, ent) = lax.scan(body, None, xs)
    return logz.reshape(rows), logp.reshape(rows), ent.reshape(rows)


# ----------------------------------------------------------------------------- backward


def _dlogits_tile(cfg: ChunkConfig, h_t, w_c, off, y_t, it_t, logz_t, ent_t, g_t, e_t):
    """``dL/du`` for one ``[T, C]`` tile, in the input dtype, ready for the matmuls."""
    l, th = _logits_tile(h_t, w_c, it_t, cfg.softcap)
    logp = l - logz_t[:, None]
    p = jnp.exp(logp)
    hit = (lax.broadcasted_iota(jnp.int32, l.shape, 1) + off) == y_t[:, None]
    dl = g_t[:, None] * (jnp.where(hit, 1.0, 0.0) - p)
    if cfg.with_entropy:
        dl = dl - e_t[:, None] * p * (logp + ent_t[:, None])
    du = dl * it_t[:, None]
    if th is not None:
        du = du * (1.0 - th * th)
    return du.astype(h_t.dtype)


def _backward_fused(cfg, res, g, e):
    """Vocab outer, tokens inner: one recompute, float32 ``dh [B, H]`` accumulator."""
    h, w, labels, inv_temp, logz, ent = res
    rows, hidden = h.shape
    tc = cfg.token_chunk
    nt = rows // tc

    def vocab_step(carry, w_c, off):
        dh_acc, dw = carry
        width = w_c.shape[1]

        def token_step(inner, i):
            dw_c, dh_acc = inner
            r = i * tc
            sl = lambda x: lax.dynamic_slice_in_dim(x, r, tc)  # noqa: E731
            h_t = sl(h)
            du = _dlogits_tile(
                cfg, h_t, w_c, off, sl(labels), sl(inv_temp), sl(logz), sl(ent), sl(g), sl(e)
            )
            dw_c = dw_c + _matmul(h_t, du, ((0,), (0,)))
            dh_t = sl(dh_acc) + _matmul(du, w_c, ((1,), (1,)))
            return (dw_c, lax.dynamic_update_slice_in_dim(dh_acc, dh_t, r, 0)), None

        dw_c0 = jnp.zeros((hidden, width), jnp.float32)
        (dw_c, dh_acc), _ = lax.scan(token_step, (dw_c0, dh_acc), jnp.arange(nt))
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c.astype(w.dtype), off, 1)
        return dh_acc, dw

    init = (jnp.zeros((rows, hidden), jnp.float32), jnp.zeros_like(w))
    dh_acc, dw = _scan_vocab(vocab_step, init, w, cfg.vocab_chunk)
    return dh_acc.astype(h.dtype), dw


def _backward_two_pass(cfg, res, g, e):
    """Tokens outer for ``dh``, then vocab outer for ``dw``: temporaries independent of B."""
    h, w, labels, inv_temp, logz, ent = res
    rows, hidden = h.shape
    tc = cfg.token_chunk
    nt = rows // tc
    chunked = lambda x: x.reshape((nt, tc) + x.shape[1:])  # noqa: E731
    xs = tuple(chunked(x) for x in (h, labels, inv_temp, logz, ent, g, e))

    def dh_chunk(_, x):
        def step(acc, w_c, off):
            du = _dlogits_tile(cfg, x[0], w_c, off, *x[1:])
            return acc + _matmul(du, w_c, ((1,), (1,)))

        acc = _scan_vocab(step, jnp.zeros((tc, hidden), jnp.float32), w, cfg.vocab_chunk)
        return None, acc.astype(h.dtype)

    _, dh = lax.scan(dh_chunk, None, xs)

    def dw_step(dw, w_c, off):
        def token_step(acc, x):
            du = _dlogits_tile(cfg, x[0], w_c, off, *x[1:])
            return acc + _matmul(x[0], du, ((0,), (0,))), None

        acc0 = jnp.zeros((hidden, w_c.shape[1]), jnp.float32)
        acc, _ = lax.scan(token_step, acc0, xs)
        return lax.dynamic_update_slice_in_dim(dw, acc.astype(w.dtype), off, 1)

    dw = _scan_vocab(dw_step, jnp.zeros_like(w), w, cfg.vocab_chunk)
    return dh.reshape(rows, hidden), dw


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_head(cfg: ChunkConfig, h, w, labels, inv_temp):
    """float32 ``(logZ, logp, entropy)``, each ``[B]``, for compacted rows.

    Args:
      cfg: static settings; ``B`` must be a multiple of ``cfg.token_chunk`` (see
        ``make_config`` / ``padded_rows``).
      h: ``[B, H]`` hidden rows (bf16 or f32), padded rows all zero.
      w: ``[H, V]`` head weight, same dtype as ``h``.
      labels: int32 ``[B]`` in ``[0, V)``; a label outside gives ``logp = NaN``.
      inv_temp: float32 ``[B]``, ``1 / temperature`` (no gradient flows to it).

    Returns:
      ``(logZ, logp, entropy)`` float32 ``[B]``; ``entropy`` is zeros when
      ``cfg.with_entropy`` is false. Differentiable w.r.t. ``h`` and ``w`` through
      ``logp`` and ``entropy`` (``logZ`` is returned for diagnostics; its cotangent is
      ignored).
    """
    return _forward(cfg, h, w, labels, inv_temp)


def _chunked_head_fwd(cfg, h, w, labels, inv_temp):
    logz, logp, ent = _forward(cfg, h, w, labels, inv_temp)
    return (logz, logp, ent), (h, w, labels, inv_temp, logz, ent)


def _chunked_head_bwd(cfg, res, cts):
    _, g, e = cts
    h, w = res[0], res[1]
    if h.shape[0] == 0:
        return jnp.zeros_like(h), jnp.zeros_like(w), None, None
    g = g.astype(jnp.float32)
    e = e.astype(jnp.float32)
    backward = _backward_fused if cfg.fused_backward else _backward_two_pass
    dh, dw = backward(cfg, res, g, e)
    return dh, dw, None, None


chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)
