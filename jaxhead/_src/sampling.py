"""Sampling from the head: the token, its log-prob under the distribution it was drawn
from, and that distribution's support, in float32 with the head's own tile math.

Untruncated: over the vocabulary scan (never ``[B, V]``), a block of ``SAMPLE_BLOCK`` ids
by Gumbel-max over the blocks' log-masses, then an id inside it by inverse CDF; truncated
(``top_k`` / ``top_p`` / ``min_p``): the full float32 logits of the rows, one support
threshold ``min_logit`` found by bisection and a Gumbel-max per id. The noise is a bounded
counter hash of the row's seed and a counter (``_uniform``). The derivation, the noise's
bounds and why a hash: docs/design.md, "Sampling".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxhead._src.head import layout, validation
from jaxhead._src.head import math as hm
from jaxhead._src.head import scan as sc
from jaxhead._src.head.layout import WeightLayout
from jaxhead._src.types import Sample

DEFAULT_VOCAB_CHUNK = 8192


def _static(x) -> bool:
    """A Python number (checked and branched on at trace time), not an array."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_settings(rows, vocab, num_valid, temperature, top_k, top_p, min_p,
                    vocab_chunk) -> int:
    """``num_valid`` (V when None) after checking the draw's settings against ``vocab``."""
    if rows < 1:
        raise ValueError(f"sampling needs at least one row, got B = {rows}")
    validation.static_int(vocab_chunk, "vocab_chunk", 1)
    num_valid = vocab if num_valid is None else validation.static_int(num_valid, "num_valid")
    if not 0 < num_valid <= vocab:
        raise ValueError(f"num_valid must be in [1, V={vocab}], got {num_valid}")
    if _static(temperature) and not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if jnp.ndim(temperature) != 0:
        raise ValueError(f"temperature must be a scalar (one for the whole batch), got "
                         f"shape {jnp.shape(temperature)}")
    if (not jnp.issubdtype(jnp.result_type(top_k), jnp.integer)  # bool and float too
            or (_static(top_k) and not 0 <= top_k <= vocab)):
        raise ValueError(f"top_k must be an int in [0, V={vocab}] (0: off), got "
                         f"{validation.short(top_k)}")
    if _static(top_p) and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
    if _static(min_p) and not 0 <= min_p < 1:
        raise ValueError(f"min_p must be in [0, 1) (0: off), got {min_p!r}")
    return num_valid


class _Source(NamedTuple):
    """Where a draw's logits come from: ``tile(w_c, *pinned)`` is the float32 ``[B, C]``
    logits of the vocab chunk ``w_c`` of ``scanned`` (sliced along ``axis``); ``full()``
    all ``[B, V]`` of them."""

    rows: int
    vocab: int
    scanned: jax.Array
    axis: int
    pinned: tuple
    tile: Callable
    fetch: Callable | None = None  # applied to each chunk of ``scanned`` (scan_vocab's)

    def full(self):
        scanned = self.scanned if self.fetch is None else self.fetch(self.scanned)
        return self.tile(scanned, *self.pinned)


def _head_source(hidden, weight, weight_layout, softcap, hidden_axes=()) -> _Source:
    """The logits ``softcap(hidden @ weight)``, a tile per chunk of the weight (a weight
    split over ``hidden_axes``: each chunk all-gathered where it is used)."""

    def tile(w_c, h):
        return hm.logits(layout.logits(h, w_c, weight_layout), softcap)[0]

    axis = layout.vocab_dim(weight_layout)
    return _Source(hidden.shape[0], weight.shape[axis], weight, axis, (hidden,), tile,
                   sc.gather_hidden(hidden_axes, 1 - axis))


def _logits_source(logits) -> _Source:
    """Given logits ``[B, V]``, a tile per column chunk (in float32)."""
    return _Source(logits.shape[0], logits.shape[1], logits, 1, (),
                   lambda z_c: z_c.astype(jnp.float32))


def _row_temperature(temperature, rows: int):
    """``(temperature, sampled)``: float32 ``[rows, 1]`` and bool; greedy
    (``temperature == 0``) scores at temperature 1."""
    temperature = jnp.asarray(temperature, jnp.float32)
    sampled = temperature > 0
    return jnp.full((rows, 1), jnp.where(sampled, temperature, 1.0)), sampled


def _mix(x: jax.Array) -> jax.Array:
    """A bijective 32-bit integer hash ("lowbias32", C. Wellons' hash-prospector):
    xor-shift / multiply rounds with good avalanche; uint32 in, uint32 out."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniform_from_bits(bits: jax.Array) -> jax.Array:
    """float32 uniforms from uint32 ``bits``: the top 23 bits ``k`` give
    ``u = (k + 1/2) 2^-23`` in ``[2^-24, 1 - 2^-24]``, each exact in float32, never 0 or 1."""
    return ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_from_bits(bits: jax.Array) -> jax.Array:
    """float32 standard Gumbel noise ``-log(-log(u))`` of ``uniform_from_bits``: always
    finite, in ``[-2.82, 16.64]``."""
    return -jnp.log(-jnp.log(uniform_from_bits(bits)))


def _uniform(seeds: jax.Array, ids: jax.Array) -> jax.Array:
    """Uniforms for each (row, vocab id): a counter hash of the row's ``seeds`` (uint32
    ``[B, 2]``) and the ``ids`` (int32 ``[B, C]``)."""
    return uniform_from_bits(_mix(_mix(ids.astype(jnp.uint32) ^ seeds[:, 1:]) ^ seeds[:, :1]))


def _gumbel(seeds: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise for each (row, vocab id) (``-log(-log(_uniform))``)."""
    return -jnp.log(-jnp.log(_uniform(seeds, ids)))


def _noise(seeds, ids, sampled):
    """``_gumbel`` noise of the tile ``ids`` (zeros, and no hashing, when greedy)."""
    return lax.cond(sampled, lambda: _gumbel(seeds, ids),
                    lambda: jnp.zeros(ids.shape, jnp.float32))


def _first_argmax(x):
    """``(jnp.argmax(x, axis=1), max)`` (the first index among ties) of a ``[B, C]`` array
    with no NaN, by two plain reductions: XLA:CPU's variadic arg-max reduce over a wide row
    costs more than the matmul that made it."""
    top = jnp.max(x, axis=1, keepdims=True)
    cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.min(jnp.where(x == top, cols, x.shape[1] - 1), axis=1), top[:, 0]


def _pick(z, g, inv_temperature, eligible):
    """Per row: ``(index, z, g, eligible)`` of the arg-max of
    ``(z - max z) * inv_temperature + g`` over the ``eligible`` columns of the tile (the
    first index among ties)."""
    m = jnp.max(jnp.where(eligible, z, -jnp.inf), axis=1, keepdims=True)
    score = jnp.where(eligible, (z - m) * inv_temperature + g, -jnp.inf)
    j = _first_argmax(score)[0][:, None]

    def at(x):
        return jnp.take_along_axis(x, j, axis=1)[:, 0]

    return j[:, 0].astype(jnp.int32), at(z), at(g), at(eligible)


#: Vocabulary ids per block of the untruncated draw: one Gumbel variate per block, an
#: inverse-CDF draw inside the winning block.
SAMPLE_BLOCK = 128


def _within(e, u):
    """Per row, the index ``j`` of ``e [B, K]`` (non-negative) drawn with probability
    ``e_j / sum(e)`` by inverse CDF: the first ``j`` whose running sum exceeds
    ``u * sum(e)`` (``u [B]`` uniform in (0, 1)). A column that does not raise the running
    sum (``e_j = 0``, or too small to change it in float32) is never drawn, also where
    ``u * sum`` rounds up to the sum itself (then: the last column that raised it)."""
    run = jnp.cumsum(e, axis=1)
    j = jnp.sum((run <= (u * run[:, -1])[:, None]).astype(jnp.int32), axis=1)
    raises = run > jnp.pad(run[:, :-1], ((0, 0), (1, 0)))
    last = e.shape[1] - 1 - jnp.argmax(raises[:, ::-1], axis=1).astype(jnp.int32)
    return jnp.minimum(j, last)


def _chunked(source, seeds, temperature, sampled, num_valid, vocab_chunk):
    """The untruncated path, a two-level draw over blocks of ``SAMPLE_BLOCK`` ids: a block
    ``b`` by Gumbel-max over the blocks' log-masses ``log sum_{v in b} exp(l_v)`` (the
    running arg-max across chunks), then an id inside it by inverse CDF. Exact: the block
    with probability ``Z_b / Z``, the id with ``p_v / (Z_b / Z)`` given the block. Per
    column only the ``exp`` the log-sum-exp needs; noise, logarithms and the inverse CDF
    are per block or per row. Greedy (``temperature == 0``): the arg-max of the logits,
    the lowest id among ties. ``source``: where the tiles' logits come from (``_Source``)."""
    rows = source.rows
    f32 = jnp.float32
    inv_temperature = 1.0 / temperature  # [B, 1]
    # running: the statistics, the token, its logit, and the winning block's tile max and
    # score relative to it (log-mass + Gumbel; the logit itself when greedy)
    init = (hm.init_stats((rows, 1)), jnp.zeros((rows,), jnp.int32),
            jnp.full((rows,), -jnp.inf, f32), jnp.full((rows,), -jnp.inf, f32),
            jnp.zeros((rows,), f32))
    chunk = min(-(-vocab_chunk // SAMPLE_BLOCK) * SAMPLE_BLOCK, source.vocab)

    def draw(z, e, live, m, off):
        """``(index in the tile, score relative to m)`` of the tile's candidate."""
        width = -(-z.shape[1] // SAMPLE_BLOCK) * SAMPLE_BLOCK
        blocks = jnp.pad(e, ((0, 0), (0, width - z.shape[1]))).reshape(rows, -1, SAMPLE_BLOCK)
        mass = jnp.sum(blocks, axis=2)  # [B, blocks], relative to the tile max
        block_ids = lax.broadcasted_iota(jnp.int32, mass.shape, 1) + off // SAMPLE_BLOCK
        gumbel = -jnp.log(-jnp.log(_uniform(seeds, 2 * block_ids)))
        score = jnp.where(mass > 0, jnp.log(mass) + gumbel, -jnp.inf)
        b = jnp.argmax(score, axis=1)
        picked = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
        u = _uniform(seeds, 2 * (b + off // SAMPLE_BLOCK)[:, None] + 1)[:, 0]
        return b.astype(jnp.int32) * SAMPLE_BLOCK + _within(picked, u), \
            jnp.take_along_axis(score, b[:, None], axis=1)[:, 0]

    def greedy(z, e, live, m, off):
        j, zj = _first_argmax(jnp.where(live, z, -jnp.inf))
        return j, jnp.where(zj > -jnp.inf, zj - m[:, 0], -jnp.inf)  # temperature 1

    def step(carry, w_c, off, *pinned):
        stats, tok, z_tok, best_m, best_score = carry
        z = source.tile(w_c, *pinned)
        ids = lax.broadcasted_iota(jnp.int32, z.shape, 1) + off
        # the log-sum-exp over every id (as the trainer's token_logprobs scores the token);
        # the draw over the ids below num_valid
        terms = hm.tile_exp(z, inv_temperature, None)
        m, _, e, live = terms
        stats = hm.merge(stats, hm.tile_stats(z, inv_temperature, None, None, False, terms),
                         inv_temperature, False)
        valid = ids < num_valid
        j, score = lax.cond(sampled, draw, greedy, z, jnp.where(valid, e, 0.0), live & valid,
                            m, off)
        # the candidate beats the best so far (ties keep the earlier, lower id); nearby
        # numbers are subtracted first, so a low temperature does not round the noise away
        first = best_m == -jnp.inf
        gain = jnp.where(first, 0.0, (m[:, 0] - best_m) * inv_temperature[:, 0])
        take = (score > -jnp.inf) & (first | (gain + (score - best_score) > 0))
        cz = jnp.take_along_axis(z, j[:, None], axis=1)[:, 0]
        return (stats, jnp.where(take, j + off, tok), jnp.where(take, cz, z_tok),
                jnp.where(take, m[:, 0], best_m), jnp.where(take, score, best_score))

    tuning = sc.Tuning()
    stats, tok, z_tok, _, _ = sc.scan_vocab(tuning, chunk, step, init, source.scanned,
                                            source.pinned, axis=source.axis,
                                            fetch=source.fetch)
    logp = (z_tok - stats.m[:, 0]) * inv_temperature[:, 0] - jnp.log1p(stats.r[:, 0])
    ninf = jnp.full((rows,), -jnp.inf, f32)
    return Sample(tok, logp, ninf, jnp.zeros((rows,), f32))


def _ordered(x):
    """float32 -> uint32 keys in the same order (``-inf < ... < 0 < ... < inf``)."""
    bits = lax.bitcast_convert_type(x + 0.0, jnp.uint32)  # + 0.0: -0 becomes +0
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_threshold(l, weight, target):
    """Per row, the largest logit ``tau`` of ``l [B, V]`` with
    ``sum(weight[l >= tau]) >= target [B, 1]`` (``weight >= 0``; where no logit qualifies
    the smallest one). Bisection on the ordered integer keys of ``l``: 32 masked sums over
    ``[B, V]`` and no sort (XLA:CPU sorts or takes the top-k of a 151,936-wide row 20-100x
    slower); exact, the answer is one of the row's logits."""
    keys = _ordered(l)
    lo = jnp.min(keys, axis=1, keepdims=True)
    hi = jnp.max(keys, axis=1, keepdims=True)

    def step(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)  # the upper middle, no overflow
        ok = jnp.sum(jnp.where(keys >= mid, weight, 0.0), axis=1, keepdims=True) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = lax.fori_loop(0, 32, step, (lo, hi))
    return jnp.max(jnp.where(keys <= lo, l, -jnp.inf), axis=1, keepdims=True)


def _threshold(l, eligible, top_k, top_p, min_p):
    """Per-row ``tau`` ``[B, 1]`` of the tempered logits ``l`` (see the module docstring).
    The three settings may be traced: a disabled one costs nothing (``lax.cond``)."""
    masked = jnp.where(eligible, l, -jnp.inf)
    top_k, top_p = jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)
    min_p = jnp.asarray(min_p, jnp.float32)
    none = jnp.full((l.shape[0], 1), -jnp.inf, jnp.float32)
    alive = (masked > -jnp.inf).astype(jnp.float32)
    tau = lax.cond(top_k > 0, lambda: _largest_threshold(masked, alive, top_k.astype(jnp.float32)),
                   lambda: none)
    m = jnp.max(masked, axis=1, keepdims=True)

    def nucleus():
        p = jnp.where(masked >= tau, jnp.exp(masked - m), 0.0)  # the top-k set
        target = top_p * jnp.sum(p, axis=1, keepdims=True)
        return jnp.maximum(tau, _largest_threshold(masked, p, target))

    tau = lax.cond(top_p < 1, nucleus, lambda: tau)
    return jnp.where(min_p > 0, jnp.maximum(tau, m + jnp.log(min_p)), tau)


def _truncated(z, seeds, temperature, sampled, num_valid, top_k, top_p, min_p):
    """The truncated path on the float32 logits ``z [B, V]`` of every row."""
    inv_temperature = 1.0 / temperature  # [B, 1]
    l = z * inv_temperature
    ids = lax.broadcasted_iota(jnp.int32, z.shape, 1)
    eligible = (ids < num_valid) & (z > -jnp.inf)
    tau = jnp.where(sampled, _threshold(l, eligible, top_k, top_p, min_p), -jnp.inf)
    support = (l >= tau) | jnp.isnan(l)  # a NaN logit makes the log-probs NaN, as untruncated
    # record the threshold halfway to the largest logit left out: the same support, but a
    # trainer whose logits round a little differently (another matmul tiling, a full
    # forward instead of the KV cache) still sees the boundary ids on the same side
    below = jnp.max(jnp.where(support, -jnp.inf, l), axis=1, keepdims=True)
    tau = jnp.where(below > -jnp.inf, tau + 0.5 * (below - tau), -jnp.inf)
    g = _noise(seeds, ids, sampled)
    tok, _, _, _ = _pick(z, g, inv_temperature, eligible & support)
    hit = ids == tok[:, None]
    rows = hm.finalize(hm.tile_stats(z, inv_temperature, support | hit, hit, False),
                       inv_temperature, False)
    full = hm.finalize(hm.tile_stats(z, inv_temperature, None, hit, False), inv_temperature,
                       False)
    return Sample(tok, rows.logp[:, 0], tau[:, 0], full.logp[:, 0] - rows.logp[:, 0])


def _row_seeds(key, rows: int, row_ids, num_rows) -> jax.Array:
    """uint32 ``[rows, 2]``: two seed words per row drawn from ``key``; with ``row_ids``
    the words of rows ``row_ids`` of a ``num_rows``-row draw (``jax.random.bits`` numbers
    its elements by their index, so a row's words do not depend on the rows drawn).
    ``key`` of shape ``[rows]``: row ``b`` draws from ``key[b]`` as a call with that key
    alone would draw for its row (``row_ids[b]`` of ``num_rows``, or row 0 of one)."""
    key = jnp.asarray(key)
    batch = key.shape if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape[:-1]
    per_row = batch != ()
    if per_row and batch != (rows,):
        raise ValueError(f"key must be one key or one per row ([{rows}]), got keys of "
                         f"shape {batch}")
    if row_ids is None:
        if num_rows is not None:
            raise ValueError(f"num_rows={num_rows} needs row_ids")
        if per_row:
            return jax.vmap(lambda k: jax.random.bits(k, (1, 2), jnp.uint32)[0])(key)
        return jax.random.bits(key, (rows, 2), jnp.uint32)
    if num_rows is None or not isinstance(num_rows, int) or num_rows < 1:
        raise ValueError(f"row_ids needs num_rows, a positive static int; got {num_rows!r}")
    row_ids = jnp.asarray(row_ids)
    if row_ids.shape != (rows,) or not jnp.issubdtype(row_ids.dtype, jnp.integer):
        raise ValueError(f"row_ids must be integer [B] = [{rows}], got {row_ids.dtype} "
                         f"{row_ids.shape}")

    def words(k, ids):
        return jnp.take(jax.random.bits(k, (num_rows, 2), jnp.uint32), ids, axis=0,
                        mode="clip")

    return jax.vmap(words)(key, row_ids) if per_row else words(key, row_ids)


def _draw(source, key, num_valid, temperature, top_k, top_p, min_p, vocab_chunk,
          row_ids=None, num_rows=None) -> Sample:
    """The draw: the chunked untruncated path when every truncation setting is off, else
    the full-logits one. The values decide, not how they arrive: with a traced setting
    both paths are compiled and ``lax.cond`` picks by the values, so a draw depends only
    on the key, the rows (``row_ids``: their global indices) and the settings' values."""
    temperature, sampled = _row_temperature(temperature, source.rows)
    seeds = _row_seeds(key, source.rows, row_ids, num_rows)

    def chunked():
        return _chunked(source, seeds, temperature, sampled, num_valid, vocab_chunk)

    def truncated():
        return _truncated(source.full(), seeds, temperature, sampled, num_valid, top_k, top_p,
                          min_p)

    if all(_static(x) for x in (top_k, top_p, min_p)):
        return truncated() if (top_k or top_p < 1 or min_p) else chunked()
    off = ((jnp.asarray(top_k) <= 0) & (jnp.asarray(top_p) >= 1)  # as _threshold reads them
           & (jnp.asarray(min_p) <= 0))
    return lax.cond(off, chunked, truncated)


def sample(
    hidden: jax.Array,
    weight: jax.Array,
    key: jax.Array,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    softcap: float | None = None,
    num_valid: int | None = None,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    weight_layout: WeightLayout = "hv",
    row_ids: jax.Array | None = None,
    num_rows: int | None = None,
    weight_hidden_axes: str | Sequence[str] = (),
) -> Sample:
    """Draw one token per row from ``softmax(z / temperature)``, optionally truncated.

    Args:
      hidden: ``[B, H]`` final hidden states (bf16 / f32) of the positions to sample from.
      weight: the head weight, same dtype as ``hidden``: ``[H, V]``
        (``weight_layout="hv"``) or ``[V, H]`` (``"vh"``, e.g. a tied embedding table,
        used as it is: vocab chunks are its row blocks, no transposed copy).
      key: a JAX PRNG key: two 32-bit seed words per row are drawn from it (see the module
        docstring for the noise and what a draw depends on); or ``[B]`` keys, one per row:
        row ``b`` then draws what a call with ``key[b]`` alone draws for it (with
        ``row_ids``: as row ``row_ids[b]`` of that call; a decoder whose rows are at
        different decode steps, each folded into its key, keeps every row's draw so).
      temperature: float ``>= 0``, a Python number or a traced scalar (one compiled
        function then serves greedy and sampled decoding); 0 means greedy (the arg-max of
        the logits, the lowest id among ties; no truncation applies).
      top_k: keep the ``top_k`` most likely ids (ties at the k-th included); 0: off.
      top_p: keep the smallest most-likely set whose mass reaches ``top_p`` (ids tied with
        the least likely one kept are kept too); 1: off.
      min_p: keep ids at least ``min_p`` times as likely as the most likely; 0: off.
        Each of the three is a Python number or a traced scalar: when all three say off
        the chunked untruncated path runs, otherwise the full-logits one. Their values
        decide, not whether they are traced (a traced setting compiles both paths and
        picks one at run time, so one compiled function serves every truncation setting
        and draws what Python numbers of the same values draw). Only Python numbers
        are range-checked (nothing can raise under ``jit``): a traced ``temperature < 0``
        draws greedily, a traced ``top_p <= 0`` keeps the most likely ids, a traced
        ``top_k`` outside ``[1, V]`` is off.
      softcap: soft-cap ``c`` of the head (``z = c tanh(u / c)``) or None.
      num_valid: only ids ``< num_valid`` are drawn (None: all V).
      vocab_chunk: vocabulary entries per tile of the untruncated path (rounded up to a
        multiple of ``SAMPLE_BLOCK`` = 128; a draw does not depend on it).
      weight_layout: ``"hv"`` or ``"vh"``: both draw the same tokens from the same key.
      row_ids: optional int ``[B]``, with ``num_rows`` (a static int): row ``b`` draws with
        the seed words that row ``row_ids[b]`` of a ``num_rows``-row call with the same key
        draws with (ids are clipped to ``[0, num_rows)``). A decoder that drops finished
        rows from its batch keeps every row's draw so (``models.generate``). None: row
        ``b`` is row ``b``.
      weight_hidden_axes: inside ``jax.shard_map``, the manual mesh axes ``weight``'s
        hidden dimension is split over (as ``jaxhead.token_logprobs``): the untruncated
        path all-gathers one vocab chunk at a time, the truncated path (full logits) the
        whole weight. ``()``: the weight is whole.

    Returns:
      ``Sample(tokens, logprobs, min_logit, logmass)``, ``[B]`` each (see ``Sample``).

    Raises:
      TypeError: ``hidden`` / ``weight`` not arrays, not floating or of different dtypes
        (as ``jaxhead.token_logprobs``; both named).
      ValueError: bad shapes (a weight that does not match ``H`` in ``weight_layout``: the
        layout named), an unknown ``weight_layout``, no rows, ``temperature`` negative,
        infinite or not a scalar, ``num_valid`` outside ``[1, V]``, ``top_k`` not an integer,
        ``top_k`` / ``top_p`` / ``min_p`` outside their ranges, ``vocab_chunk`` not a
        positive int, or ``row_ids`` without a positive int ``num_rows`` or not of shape
        ``[B]``, ``key`` neither one key nor ``[B]`` keys (the value named).
    """
    validation.check_float_pair(validation.dtype_of(hidden, "hidden"),
                                validation.dtype_of(weight, "weight"))
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be [B, H], got shape {hidden.shape}")
    hidden_axes, hidden_shards = validation.hidden_shards(weight_hidden_axes)
    validation.check_weight(hidden.shape, weight.shape, weight_layout, hidden_shards)
    vocab = layout.sizes(weight.shape, weight_layout)[1]
    num_valid = _check_settings(hidden.shape[0], vocab, num_valid, temperature, top_k,
                                top_p, min_p, vocab_chunk)
    return _draw(_head_source(hidden, weight, weight_layout, softcap, hidden_axes), key,
                 num_valid, temperature, top_k, top_p, min_p, vocab_chunk, row_ids, num_rows)


def sample_from_logits(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    num_valid: int | None = None,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    row_ids: jax.Array | None = None,
    num_rows: int | None = None,
) -> Sample:
    """``jaxhead.sample``'s draw from logits a model has already computed.

    For a decoder whose decode step returns ``[B, V]`` logits (such as the samplers of other
    stacks): the same two-level draw as ``sample`` (one Gumbel variate per block of
    ``SAMPLE_BLOCK`` ids and one uniform per row, instead of one variate per id as in
    ``jax.random.categorical``; at V = 151,936 most of a decode step's sampling cost is
    that noise), the same truncation, the same ``Sample``. Given the same key and
    bitwise the same logits it draws what ``sample`` draws from the hidden states and weight
    those logits came from.

    Args:
      logits: ``[B, V]`` pre-temperature logits, any float dtype (read in float32);
        ``-inf`` marks an id that cannot be drawn. NaN and ``+inf`` are not checked (a row
        holding one draws an unspecified token with a ``-inf`` or NaN log-prob).
      key: a JAX PRNG key (as ``sample``).
      temperature, top_k, top_p, min_p, num_valid, vocab_chunk, row_ids, num_rows: as
        ``sample``.

    Returns:
      ``Sample(tokens, logprobs, min_logit, logmass)``, ``[B]`` each (see ``Sample``).

    Raises:
      ValueError: ``logits`` not 2-D or not floating point (its shape / dtype named), or a
        setting out of range (as ``sample``, the value named).
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    num_valid = _check_settings(logits.shape[0], logits.shape[1], num_valid, temperature,
                                top_k, top_p, min_p, vocab_chunk)
    return _draw(_logits_source(logits), key, num_valid, temperature, top_k, top_p, min_p,
                 vocab_chunk, row_ids, num_rows)
