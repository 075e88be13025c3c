"""Sampling from the head without ``[B, V]`` logits: a chunked Gumbel-max in float32.

For each row the vocabulary is scanned in chunks with the head's own tile math
(``jaxhead._src.head.math``: same float32 accumulation, soft-cap and online statistics) and
two things are carried:

* the running arg-max of ``l_v + g_v`` with ``l = z / tau`` and ``g_v`` i.i.d. standard
  Gumbel noise: by the Gumbel-max trick, ``argmax_v (l_v + g_v)`` is a draw from
  ``softmax(l)`` (Gumbel 1954; Maddison, Tarlow & Minka, "A* Sampling", 2014);
* the online log-sum-exp statistics of ``l`` over *all* V columns, so that the returned
  ``log p(token) = (z_token - m) / tau - log s`` is the very number
  ``jaxhead.token_logprobs`` gives for that token at temperature ``tau`` (sampler and
  trainer agree by construction).

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

import jax
import jax.numpy as jnp
from jax import lax

from jaxhead._src.head import math as hm
from jaxhead._src.head import scan as sc
from jaxhead._src.types import Sample

DEFAULT_VOCAB_CHUNK = 8192


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
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
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
      vocab_chunk: columns per tile.

    Returns:
      ``Sample(tokens int32 [B], logprobs float32 [B])``.

    Raises:
      ValueError: bad shapes, ``temperature < 0``, ``num_valid`` outside ``[1, V]``.
    """
    num_valid = _check(hidden, weight, num_valid)
    if isinstance(temperature, (int, float)) and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    rows = hidden.shape[0]
    f32 = jnp.float32
    temperature = jnp.asarray(temperature, f32)
    sampled = temperature > 0
    inv_temp = jnp.where(sampled, 1.0 / jnp.where(sampled, temperature, 1.0), 1.0)
    it = jnp.full((rows, 1), inv_temp)
    row_seed = _mix(jax.random.bits(key, (rows,), jnp.uint32))[:, None]
    init = (
        hm.init_stats((rows, 1)),  # log-sum-exp statistics of z over every column
        jnp.full((rows,), -jnp.inf, f32),  # best score l + g
        jnp.zeros((rows,), jnp.int32),  # best token
        jnp.zeros((rows,), f32),  # z of the best token
    )

    def step(carry, w_c, off, h):
        stats, best, tok, z_tok = carry
        z, _ = hm.logits(hm.matmul(h, w_c, (1, 0)), softcap)
        ids = lax.broadcasted_iota(jnp.int32, z.shape, 1) + off
        stats = hm.update(stats, z, it, None, jnp.zeros(z.shape, bool), False)
        l = z * it
        # Gumbel-max: argmax_v (l_v + g_v) with g_v = -log(E_v), E_v ~ Exp(1)
        expo = jnp.where(sampled, -jnp.log(_uniform(row_seed, ids)), 1.0)
        score = jnp.where(ids < num_valid, l - jnp.log(expo), -jnp.inf)
        j = jnp.argmax(score, axis=1)
        c_best = jnp.take_along_axis(score, j[:, None], axis=1)[:, 0]
        better = c_best > best
        return (stats, jnp.where(better, c_best, best),
                jnp.where(better, j.astype(jnp.int32) + off, tok),
                jnp.where(better, jnp.take_along_axis(z, j[:, None], axis=1)[:, 0], z_tok))

    tuning = sc.Tuning()
    h = hidden.astype(tuning.tile_dtype(hidden.dtype))
    stats, _, tok, z_tok = sc.scan_vocab(tuning, min(vocab_chunk, weight.shape[1]), step, init,
                                         weight, (h,))
    logp = (z_tok - stats.m[:, 0]) * inv_temp - jnp.log1p(stats.r[:, 0])
    return Sample(tok, logp)


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
      over all V columns.

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
