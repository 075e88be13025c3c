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
cancel two large numbers, and ``s`` is stored as ``r = s - 1`` (the max element's exact
``exp(0) = 1`` never added): for a peaked row ``s = 1 + 0.003`` would keep only 4 digits
of the 0.003 in float32, and ``log s`` and the entropy would lose them. A vocab size that is not a multiple of the chunk is handled by a
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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

DEFAULT_TOKEN_CHUNK = 512
DEFAULT_VOCAB_CHUNK = 8192
FUSED_BACKWARD_MAX_BYTES = 256 * 2**20
DW_BITS_MAX_BYTES = 512 * 2**20
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
      matmul_dtype: operand dtype of the tile matmuls (accumulation is always float32):
        the input dtype, or float32 for 16-bit inputs on a CPU without bf16 matrix units.
      cpu_layout: materialise ``h_t^T`` before ``h_t^T @ du`` (XLA's CPU dot runs a
        transposed-operand product at about half speed).
      dw_as_bits: write the 16-bit ``dw`` chunks into a ``uint16`` view (see ``_DwBuffer``).
    """

    softcap: float | None
    with_entropy: bool
    token_chunk: int
    vocab_chunk: int
    fused_backward: bool
    matmul_dtype: str = "float32"
    cpu_layout: bool = False
    dw_as_bits: bool = False


def _cpu_has_bf16_matmul() -> bool:
    """True if this x86 CPU has AMX or AVX512-BF16 (XLA then runs bf16 dots natively)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


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
    dtype,
    *,
    softcap: float | None,
    with_entropy: bool,
    token_chunk: int,
    vocab_chunk: int,
) -> tuple[ChunkConfig, int]:
    """The ``ChunkConfig`` for ``num_rows`` rows of ``dtype``, and the padded row count.

    Tile matmul operands stay in ``dtype`` except on a CPU without bf16 matrix units,
    where 16-bit tiles are widened to float32 (faster there, and exact).

    Raises:
      ValueError: a chunk size below 1.
    """
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(
            f"token_chunk and vocab_chunk must be >= 1, got {token_chunk} and {vocab_chunk}"
        )
    padded, chunk = padded_rows(num_rows, token_chunk)
    limit = max(FUSED_BACKWARD_MAX_BYTES, chunk * hidden_size * 4)
    on_cpu = jax.default_backend() == "cpu"
    narrow = jnp.dtype(dtype).itemsize == 2
    upcast = narrow and on_cpu and not _cpu_has_bf16_matmul()
    cfg = ChunkConfig(
        softcap=softcap,
        with_entropy=with_entropy,
        token_chunk=chunk,
        vocab_chunk=min(vocab_chunk, vocab_size),
        fused_backward=padded * hidden_size * 4 <= limit,
        matmul_dtype="float32" if upcast else jnp.dtype(dtype).name,
        cpu_layout=on_cpu,
        dw_as_bits=on_cpu and narrow and hidden_size * vocab_size * 2 <= DW_BITS_MAX_BYTES,
    )
    return cfg, padded


# ----------------------------------------------------------------------------- loops


def _vary_like(carry, refs):
    """``carry`` made to vary over every mesh axis that an array of ``refs`` varies over.

    Inside ``jax.shard_map`` a scan carry must keep its type, but an initial value such as
    ``jnp.zeros(...)`` is invariant while the body mixes in per-shard inputs. Adding a
    zero scalar derived from every ref (``zeros_like`` keeps the varying axes) fixes the
    type with public ops only; outside ``shard_map`` (or when nothing varies) the added
    zeros are constants that XLA folds away.
    """
    refs = jax.tree.leaves(refs)
    if not refs:
        return carry
    zero = sum(jnp.zeros_like(r, dtype=jnp.float32, shape=()) for r in refs)

    def add(c):
        return c | (zero != 0) if c.dtype == jnp.bool_ else c + zero.astype(c.dtype)

    return jax.tree.map(add, carry)


def _scan(body, carry, xs, pinned, vary=()):
    """``lax.scan`` whose body also receives the large loop-invariant arrays ``pinned``.

    ``pinned`` (the hidden states and the head weight) travel in the carry behind an
    ``optimization_barrier``, so XLA cannot hoist a whole-array op on them out of the loop.
    Without it, XLA's CPU compiler, which moves bf16 through slices as float32, converts
    all of ``w`` (2.3 GB at Qwen3 scale) before the loop instead of one chunk per step.
    ``body(carry, x, *pinned) -> (carry, y)``. ``vary``: arrays the body reads from its
    closure (see ``_vary_like``; ``xs`` and ``pinned`` are counted already).
    """
    carry = _vary_like(carry, (xs, pinned, vary))

    def step(c, x):
        c, p = c
        p = tuple(lax.optimization_barrier(a) for a in p)  # one each: keeps their types
        c, y = body(c, x, *p)
        return (c, p), y

    (carry, _), ys = lax.scan(step, (carry, pinned), xs)
    return carry, ys


def _scan_vocab(cfg: ChunkConfig, step, carry, w, pinned=(), vary=()):
    """Apply ``carry = step(carry, w_c, offset, *pinned)`` to every vocab chunk ``w_c`` of
    ``w`` (cast to the matmul dtype). ``vary``: arrays ``step`` reads from its closure.

    Full chunks run in a scan; a ragged remainder runs once more with its own (narrower,
    static) width, so no padded vocab column exists.
    """
    chunk, dtype = cfg.vocab_chunk, cfg.matmul_dtype
    n_full, tail = divmod(w.shape[1], chunk)

    def body(c, i, w, *pinned):
        w_c = lax.dynamic_slice_in_dim(w, i * chunk, chunk, axis=1).astype(dtype)
        return step(c, w_c, i * chunk, *pinned), None

    if n_full:
        carry, _ = _scan(body, carry, jnp.arange(n_full), (w, *pinned), vary)
    if tail:
        carry = step(carry, w[:, n_full * chunk :].astype(dtype), n_full * chunk, *pinned)
    return carry


def _matmul(a, b, dims):
    return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _chunks(chunk, *xs):
    """``[B, ...]`` arrays as ``[B // chunk, chunk, ...]`` (scan inputs)."""
    return tuple(x.reshape((x.shape[0] // chunk, chunk) + x.shape[1:]) for x in xs)


def _rows(x, i, chunk, dtype=None):
    """Rows ``[i * chunk, (i + 1) * chunk)`` of ``x``, cast to ``dtype`` if given."""
    rows = lax.dynamic_slice_in_dim(x, i * chunk, chunk)
    return rows if dtype is None else rows.astype(dtype)


def _put_rows(out, i, rows_f32):
    """``out`` with rows ``i * T ...`` replaced by ``rows_f32 [T, ...]`` cast to its dtype."""
    chunk = rows_f32.shape[0]
    return lax.dynamic_update_slice_in_dim(out, rows_f32.astype(out.dtype), i * chunk, 0)


class _DwBuffer:
    """The ``dw [H, V]`` output written one vocab chunk at a time.

    XLA's CPU compiler widens a bf16 dynamic-update-slice to float32 over the *whole*
    operand, so each chunk write costs a full pass over ``dw``. With ``cfg.dw_as_bits`` the
    chunks go into a ``uint16`` view instead (an in-place integer update) and one bitcast at
    the end makes the bf16 result: fast, at the price of one ``dw``-sized temporary, so it
    is used only while ``dw`` is at most ``DW_BITS_MAX_BYTES``.
    """

    def __init__(self, cfg: ChunkConfig, w):
        self.bits, self.dtype = cfg.dw_as_bits, w.dtype
        self.init = jnp.zeros(w.shape, jnp.uint16 if self.bits else w.dtype)

    def write(self, dw, dw_c, off):
        update = dw_c.astype(self.dtype)
        if self.bits:
            update = lax.bitcast_convert_type(update, jnp.uint16)
        return lax.dynamic_update_slice_in_dim(dw, update, off, 1)

    def finish(self, dw):
        return lax.bitcast_convert_type(dw, self.dtype) if self.bits else dw


# ----------------------------------------------------------------------------- tiles


def _logits_tile(h, w_c, inv_temp, softcap):
    """float32 ``(l, tanh(u / c) or None)`` for one ``[T, C]`` tile (operands already in
    the matmul dtype)."""
    u = _matmul(h, w_c, ((1,), (0,)))
    if softcap is None:
        return u * inv_temp[:, None], None
    th = jnp.tanh(u * (1.0 / softcap))
    return (softcap * th) * inv_temp[:, None], th


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


def _dw_tile(cfg: ChunkConfig, h_t, du):
    """float32 ``h_t^T @ du`` ``[H, C]``."""
    if cfg.cpu_layout:
        return _matmul(lax.optimization_barrier(h_t.T), du, ((1,), (0,)))
    return _matmul(h_t, du, ((0,), (0,)))


# ----------------------------------------------------------------------------- forward


class PartialStats(NamedTuple):
    """Per-row online log-sum-exp statistics of the logits over some vocab columns, float32
    ``[B]`` each (see the module docstring): ``m`` running max, ``r = s - 1`` with
    ``s = sum exp(l - m)``, ``t = sum exp(l - m) (l - m)`` (zeros without entropy), ``zy``
    the label logit (0 if the label is not among the columns), ``found`` whether it is.

    A vocab-parallel head (``jaxhead.vocab_parallel``) computes them per vocab shard and
    combines them across shards; ``finish`` turns them into ``(logZ, logp, entropy)``.
    """

    m: jax.Array
    r: jax.Array
    t: jax.Array
    zy: jax.Array
    found: jax.Array


def _partial_chunk(cfg: ChunkConfig, h_t, w, y_t, it_t) -> PartialStats:
    rows = h_t.shape[0]
    f32 = jnp.float32
    init = (
        jnp.full((rows,), -jnp.inf, f32),  # running max m
        jnp.zeros((rows,), f32),  # r = sum exp(l - m) - 1 (the max term excluded)
        jnp.zeros((rows,), f32),  # t = sum exp(l - m) (l - m)
        jnp.zeros((rows,), f32),  # label logit
        jnp.zeros((rows,), bool),  # label seen
    )

    def step(carry, w_c, off):
        m, r, t, zy, found = carry
        l, _ = _logits_tile(h_t, w_c, it_t, cfg.softcap)
        m_c = l.max(axis=1)
        m_new = jnp.maximum(m, m_c)
        moved = m_c > m  # the max element of the row is in this chunk (always at first)
        a = jnp.where(moved, jnp.exp(m - m_new), 1.0)  # exp(-inf) = 0 at the first chunk
        at_max = l == m_new[:, None]
        e = jnp.exp(l - m_new[:, None])
        rest = jnp.where(at_max, 0.0, e).sum(axis=1)
        ties = at_max.sum(axis=1).astype(f32)  # each contributes exactly exp(0) = 1
        # r' = a (1 + r) + ties + rest - 1 if the max moved, else r + ties + rest; the
        # "1 +" is never formed, so r keeps full float32 precision when it is tiny
        r_new = jnp.where(moved, (a * r + rest) + (a + (ties - 1.0)), r + (ties + rest))
        if cfg.with_entropy:
            d = jnp.where(moved & (a > 0), m - m_new, 0.0)  # 0 at the first chunk
            rescaled = a * ((t + d * r) + d)  # = a (t + (m - m') (1 + r))
            t = jnp.where(moved, rescaled, t) + (e * (l - m_new[:, None])).sum(axis=1)
        hit = (lax.broadcasted_iota(jnp.int32, l.shape, 1) + off) == y_t[:, None]
        zy = zy + jnp.where(hit, l, 0.0).sum(axis=1)
        found = found | hit.any(axis=1)
        return m_new, r_new, t, zy, found

    return PartialStats(*_scan_vocab(cfg, step, init, w, vary=(h_t, y_t, it_t)))


def partial_stats(cfg: ChunkConfig, h, w, labels, inv_temp) -> PartialStats:
    """``PartialStats`` of the rows of ``h [B, H]`` over the columns of ``w [H, V']``.

    ``labels`` int32 ``[B]`` index the columns of ``w``: a label outside ``[0, V')`` is
    simply not found (a vocab shard passes the global labels minus its column offset).
    ``B`` must be a multiple of ``cfg.token_chunk``.
    """
    tc = cfg.token_chunk

    def body(_, x, h, w):
        i, y_t, it_t = x
        return None, _partial_chunk(cfg, _rows(h, i, tc, cfg.matmul_dtype), w, y_t, it_t)

    steps = jnp.arange(h.shape[0] // tc)
    _, outs = _scan(body, None, (steps, *_chunks(tc, labels, inv_temp)), (h, w))
    return PartialStats(*(o.reshape(labels.shape) for o in outs))


def finish(stats: PartialStats, with_entropy: bool):
    """float32 ``(logZ, logp, entropy)`` from the statistics of *all* vocab columns:
    ``logZ = m + log1p(r)``, ``logp = zy - logZ`` (NaN where the label was not found),
    ``entropy = log1p(r) - t / (1 + r)`` (zeros without entropy)."""
    log_s = jnp.log1p(stats.r)
    logz = stats.m + log_s
    logp = jnp.where(stats.found, (stats.zy - stats.m) - log_s, jnp.nan)
    ent = log_s - stats.t / (1.0 + stats.r) if with_entropy else jnp.zeros_like(logz)
    return logz, logp, ent


def _forward(cfg: ChunkConfig, h, w, labels, inv_temp):
    return finish(partial_stats(cfg, h, w, labels, inv_temp), cfg.with_entropy)


# ----------------------------------------------------------------------------- backward


def _backward_fused(cfg, xs, h, w, dh_dtype):
    """Vocab outer, tokens inner: one recompute, float32 ``dh [B, H]`` accumulator."""
    tc = cfg.token_chunk

    def vocab_step(carry, w_c, off, h):
        dh_acc, dw = carry

        def token_step(inner, x, h, w_c):
            dw_c, dh_acc = inner
            i = x[0]
            h_t = _rows(h, i, tc, cfg.matmul_dtype)
            du = _dlogits_tile(cfg, h_t, w_c, off, *x[1:])
            dw_c = dw_c + _dw_tile(cfg, h_t, du)
            dh_t = _rows(dh_acc, i, tc) + _matmul(du, w_c, ((1,), (1,)))
            return (dw_c, _put_rows(dh_acc, i, dh_t)), None

        init = (jnp.zeros(w_c.shape, jnp.float32), dh_acc)
        (dw_c, dh_acc), _ = _scan(token_step, init, xs, (h, w_c))
        return dh_acc, out.write(dw, dw_c, off)

    out = _DwBuffer(cfg, w)
    init = (jnp.zeros(h.shape, jnp.float32), out.init)
    dh_acc, dw = _scan_vocab(cfg, vocab_step, init, w, (h,), vary=xs)
    return dh_acc.astype(dh_dtype), out.finish(dw)


def _backward_two_pass(cfg, xs, h, w, dh_dtype):
    """Tokens outer for ``dh``, then vocab outer for ``dw``: temporaries independent of B."""
    tc = cfg.token_chunk

    def dh_chunk(dh, x, h, w):
        h_t = _rows(h, x[0], tc, cfg.matmul_dtype)

        def step(acc, w_c, off):
            du = _dlogits_tile(cfg, h_t, w_c, off, *x[1:])
            return acc + _matmul(du, w_c, ((1,), (1,)))

        acc = _scan_vocab(cfg, step, jnp.zeros(h_t.shape, jnp.float32), w, vary=(h_t, x))
        return _put_rows(dh, x[0], acc), None

    dh, _ = _scan(dh_chunk, jnp.zeros(h.shape, dh_dtype), xs, (h, w))

    def dw_step(dw, w_c, off, h):
        def token_step(acc, x, h, w_c):
            h_t = _rows(h, x[0], tc, cfg.matmul_dtype)
            du = _dlogits_tile(cfg, h_t, w_c, off, *x[1:])
            return acc + _dw_tile(cfg, h_t, du), None

        acc, _ = _scan(token_step, jnp.zeros(w_c.shape, jnp.float32), xs, (h, w_c))
        return out.write(dw, acc, off)

    out = _DwBuffer(cfg, w)
    return dh, out.finish(_scan_vocab(cfg, dw_step, out.init, w, (h,), vary=xs))


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_head(cfg: ChunkConfig, h, w, labels, inv_temp):
    """float32 ``(logZ, logp, entropy)``, each ``[B]``, for the rows of ``h``.

    Args:
      cfg: static settings; ``B`` must be a multiple of ``cfg.token_chunk`` (see
        ``make_config``).
      h: ``[B, H]`` hidden rows (bf16 or f32): the compacted kept tokens, padding rows zero.
      w: ``[H, V]`` head weight, same dtype as ``h``.
      labels: int32 ``[B]`` in ``[0, V)`` (a label outside gives ``logp = NaN``).
      inv_temp: float32 ``[B]``, ``1 / temperature`` (no gradient flows to it).

    Returns:
      ``(logZ, logp, entropy)`` float32 ``[B]``; ``entropy`` is zeros when
      ``cfg.with_entropy`` is false. Differentiable w.r.t. ``h`` and ``w`` through ``logp``
      and ``entropy`` (the cotangent of ``logZ``, returned for diagnostics, is ignored).
    """
    return _forward(cfg, h, w, labels, inv_temp)


def _chunked_head_fwd(cfg, h, w, labels, inv_temp):
    logz, logp, ent = _forward(cfg, h, w, labels, inv_temp)
    return (logz, logp, ent), (h, w, labels, inv_temp, logz, ent)


def backward(cfg: ChunkConfig, h, w, labels, inv_temp, logz, ent, g, e, dh_dtype=None):
    """``(dh, dw)`` of ``sum(g * logp) + sum(e * entropy)`` by recomputing each logit tile.

    Args:
      cfg, h, w, labels, inv_temp: as ``chunked_head`` (``labels`` index the columns of
        ``w``: a vocab shard passes its local labels, see ``partial_stats``).
      logz, ent: float32 ``[B]`` of the forward over *all* vocab columns.
      g, e: ``[B]`` cotangents of ``logp`` and ``entropy``.
      dh_dtype: dtype of ``dh`` (default ``h.dtype``); a vocab shard asks for float32 so
        that the sum of the shards' partial ``dh`` is not rounded first.

    Returns:
      ``dh [B, H]`` in ``dh_dtype`` and ``dw [H, V']`` in ``w.dtype`` (for the columns of
      ``w`` only; ``dh`` is this shard's partial sum over them).
    """
    f32 = jnp.float32
    steps = jnp.arange(h.shape[0] // cfg.token_chunk)
    xs = (steps, *_chunks(cfg.token_chunk, labels, inv_temp, logz, ent, g.astype(f32),
                          e.astype(f32)))
    run = _backward_fused if cfg.fused_backward else _backward_two_pass
    return run(cfg, xs, h, w, h.dtype if dh_dtype is None else dh_dtype)


def _chunked_head_bwd(cfg, res, cts):
    _, g, e = cts
    h, w, labels, inv_temp, logz, ent = res
    dh, dw = backward(cfg, h, w, labels, inv_temp, logz, ent, g, e)
    return dh, dw, None, None


chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)
