"""Sampling from the head without ``[B, V]`` logits: a chunked Gumbel-max in float32.

For each row the vocabulary is scanned in the chunks of ``jaxhead.xla`` (same tile
function, same float32 accumulation and soft-cap) and two things are carried:

* the running arg-max of ``l_v + g_v`` with ``l = z / tau`` and ``g_v`` i.i.d. standard
  Gumbel noise: by the Gumbel-max trick, ``argmax_v (l_v + g_v)`` is a draw from
  ``softmax(l)`` (Gumbel 1954; Maddison, Tarlow & Minka, "A* Sampling", 2014);
* the online log-sum-exp ``m, s`` of ``l`` over *all* V columns, so that the returned
  ``log p(token) = l_token - logZ`` is the very number ``jaxhead.token_logprobs`` gives
  for that token at temperature ``tau`` (sampler and trainer agree by construction).

Columns ``>= num_valid`` (ids a tokenizer never produces, e.g. the padding rows of
Qwen3's 151,936-entry embedding beyond its 151,669 real tokens) are never drawn: they
take part in ``logZ`` (the trainer's normaliser) but not in the arg-max, so the draw
follows ``softmax(l)`` restricted to the valid ids. For a trained model their mass is
negligible; the difference is ``log(1 - p(invalid))`` per token.

The noise is drawn as ``g_v = -log(E_v)`` with ``E_v = -log(u_v)`` exponential, and
within a chunk the arg-max is taken as ``argmax exp(l_v - m) / E_v`` (the same order),
reusing the ``exp`` the log-sum-exp computes anyway; ``u_v`` comes from a counter-based
hash of a per-row seed and the vocab id (cheap next to a Threefry block per element).

Memory is one ``[B, C]`` float32 tile, never ``[B, V]``. ``temperature == 0`` is greedy
(arg-max of ``l`` at temperature 1, no noise). ``top_p_sample`` is the full-logits path
for nucleus sampling.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxhead import xla

#: Names of the two sampling paths, as reported in training metrics.
PATH_GUMBEL = "chunked_gumbel_max"
PATH_TOP_P = "full_logits_top_p"


class Sample(NamedTuple):
    """Result of a sampling call.

    Attributes:
      tokens: int32 ``[B]`` sampled ids, each ``< num_valid``.
      logprobs: float32 ``[B]`` ``log p(token)`` under ``softmax(z / tau)`` over all V
        columns (``tau = 1`` for greedy), as ``jaxhead.token_logprobs`` computes it.
    """

    tokens: jax.Array
    logprobs: jax.Array


def _check(hidden, weight, num_valid):
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[0]:
        raise ValueError(
            f"hidden must be [B, H] and weight [H, V] with matching H, got {hidden.shape} "
            f"and {weight.shape}"
        )
    vocab = weight.shape[1]
    num_valid = vocab if num_valid is None else int(num_valid)
    if not 0 < num_valid <= vocab:
        raise ValueError(f"num_valid must be in [1, V={vocab}], got {num_valid}")
    return num_valid


def sample(
    hidden: jax.Array,
    weight: jax.Array,
    key: jax.Array,
    *,
    temperature=1.0,
    softcap: float | None = None,
    num_valid: int | None = None,
    vocab_chunk: int = xla.DEFAULT_VOCAB_CHUNK,
) -> Sample:
    """Draw one token per row from ``softmax(z / temperature)`` by a chunked Gumbel-max.

    Args:
      hidden: ``[B, H]`` final hidden states (bf16 / f32) of the positions to sample from.
      weight: ``[H, V]`` head weight, same dtype as ``hidden``.
      key: a JAX PRNG key: it draws one 32-bit seed per row, and the noise of vocab id
        ``v`` in that row is a counter-based hash of (seed, v) (``_uniform``), so a draw
        depends on nothing but the key (not on the chunking).
      temperature: float ``>= 0``, a Python number or a traced scalar (one compiled
        function then serves greedy and sampled decoding); 0 means greedy.
      softcap: soft-cap ``c`` of the head (``z = c tanh(u / c)``) or None.
      num_valid: only ids ``< num_valid`` are drawn (None: all V).
      vocab_chunk: columns per tile (as ``jaxhead.token_logprobs``'s).

    Returns:
      ``Sample(tokens int32 [B], logprobs float32 [B])``.

    Raises:
      ValueError: bad shapes, ``temperature < 0``, ``num_valid`` outside ``[1, V]``.
    """
    num_valid = _check(hidden, weight, num_valid)
    if isinstance(temperature, (int, float)) and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    rows, vocab = hidden.shape[0], weight.shape[1]
    cfg, _ = xla.make_config(
        rows, weight.shape[0], vocab, hidden.dtype, softcap=softcap, with_entropy=False,
        token_chunk=max(rows, 1), vocab_chunk=vocab_chunk,
    )
    h = hidden.astype(cfg.matmul_dtype)
    f32 = jnp.float32
    temperature = jnp.asarray(temperature, f32)
    sampled = temperature > 0
    inv_temp = jnp.full((rows,), jnp.where(sampled, 1.0 / jnp.where(sampled, temperature, 1.0),
                                           1.0))
    row_seed = _mix(jax.random.bits(key, (rows,), jnp.uint32))[:, None]
    init = (
        jnp.full((rows,), -jnp.inf, f32),  # running max of l (log-sum-exp)
        jnp.zeros((rows,), f32),  # sum exp(l - m)
        jnp.full((rows,), -jnp.inf, f32),  # best score l + g
        jnp.zeros((rows,), jnp.int32),  # best token
        jnp.zeros((rows,), f32),  # l of the best token
    )

    def step(carry, w_c, off, h):
        m, s, best, tok, l_tok = carry
        l, _ = xla._logits_tile(h, w_c, inv_temp, cfg.softcap)
        m_new = jnp.maximum(m, l.max(axis=1))
        e = jnp.exp(l - m_new[:, None])
        s = s * jnp.exp(m - m_new) + e.sum(axis=1)
        ids = lax.broadcasted_iota(jnp.int32, l.shape, 1) + off
        # Gumbel-max in the exponential domain: argmax_v (l_v + g_v) with
        # g_v = -log(E_v), E_v ~ Exp(1), is argmax_v exp(l_v - m) / E_v.
        expo = jnp.where(sampled, -jnp.log(_uniform(row_seed, ids)), 1.0)
        race = jnp.where(ids < num_valid, e / expo, -1.0)
        j = jnp.argmax(race, axis=1)
        c_l = jnp.take_along_axis(l, j[:, None], axis=1)[:, 0]
        c_e = jnp.take_along_axis(expo, j[:, None], axis=1)[:, 0]
        c_best = c_l - jnp.log(c_e)  # = l_j + g_j
        better = (c_best > best) & (j.astype(jnp.int32) + off < num_valid)
        return (m_new, s, jnp.where(better, c_best, best),
                jnp.where(better, j.astype(jnp.int32) + off, tok),
                jnp.where(better, c_l, l_tok))

    m, s, _, tok, l_tok = xla._scan_vocab(cfg, step, init, weight, (h,))
    return Sample(tok, l_tok - (m + jnp.log(s)))


def _mix(x: jax.Array) -> jax.Array:
    """A bijective 32-bit integer hash ("lowbias32", C. Wellons' hash-prospector):
    xor-shift / multiply rounds with good avalanche; uint32 in, uint32 out."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _uniform(row_seed: jax.Array, ids: jax.Array) -> jax.Array:
    """float32 uniforms in ``(0, 1)`` for ``(row, vocab id)``: a counter-based hash of the
    row's random seed and the id (``mix(mix(id) ^ seed)``), 24 random bits. A few integer
    operations per element instead of a Threefry block: the noise of a 151,936-entry
    vocabulary would otherwise cost more than the head's matmul on a CPU."""
    bits = _mix(_mix(ids.astype(jnp.uint32)) ^ row_seed)
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def top_p_sample(
    hidden: jax.Array,
    weight: jax.Array,
    key: jax.Array,
    *,
    temperature,
    top_p: float,
    softcap: float | None = None,
    num_valid: int | None = None,
) -> Sample:
    """Nucleus sampling (Holtzman et al., 2020) from full float32 logits ``[B, V]``.

    Draws from the smallest set of valid ids whose probability under
    ``softmax(z / temperature)`` reaches ``top_p``, renormalised. This path holds the
    ``[B, V]`` logits (sorting needs them); ``sample`` is the one without.

    Returns:
      ``Sample``; ``logprobs`` are under the full (untruncated) ``softmax(z / temperature)``
      over all V columns, the distribution the trainer scores.

    Raises:
      ValueError: bad shapes, ``temperature <= 0``, ``top_p`` outside ``(0, 1]``.
    """
    num_valid = _check(hidden, weight, num_valid)
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"top-p sampling needs temperature > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    u = lax.dot_general(hidden, weight, (((1,), (0,)), ((), ())),
                        preferred_element_type=jnp.float32)
    z = u if softcap is None else softcap * jnp.tanh(u / softcap)
    l = z / temperature
    logp_all = jax.nn.log_softmax(l, axis=-1)
    valid = jnp.arange(l.shape[1]) < num_valid
    masked = jnp.where(valid, l, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass of strictly better ids
    keep_sorted = before < top_p
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(l.shape[0])[:, None], order].set(keep_sorted)
    tok = jax.random.categorical(key, jnp.where(keep, masked, -jnp.inf), axis=-1)
    tok = tok.astype(jnp.int32)
    return Sample(tok, jnp.take_along_axis(logp_all, tok[:, None], axis=1)[:, 0])
