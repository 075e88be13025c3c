"""jaxhead.sample: draws follow the (truncated) softmax, never a token of probability 0, and
their log-probs are the head's (``jaxhead.token_logprobs`` with the draw's ``min_logit``)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from harness.oracle import head_inputs
from jaxhead._src import sampling
from tests.support.sampling import TRUNCATIONS, chi_square_ok

# one compiled function per static setting, shared by the tests (compiles dominate here)
_sample = jax.jit(jaxhead.sample, static_argnames=(
    "softcap", "num_valid", "vocab_chunk", "top_k", "top_p", "min_p"))
_head = jax.jit(lambda h, w, y, t, ml, softcap: jaxhead.token_logprobs(
    h, w, y, temperature=t, softcap=softcap, min_logit=ml,
    config=jaxhead.XlaConfig(vocab_chunk=256)).logprobs, static_argnames="softcap")
@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=str)
@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.6, None), (1.3, 5.0)])
def test_logprobs_equal_token_logprobs_on_the_support(truncation, temperature, softcap):
    # exact_dot: every float32 matmul tiling gives the same logits, so the sampler's full
    # [B, V] product and the head's tiles agree to the bit and 2e-6 measures the head
    hidden, weight, _ = head_inputs(0, 64, 32, 1000, exact_dot=True)
    out = _sample(hidden, weight, jax.random.key(1), temperature=temperature,
                  softcap=softcap, vocab_chunk=256, **truncation)
    ref = _head(hidden, weight, out.tokens, temperature, out.min_logit, softcap=softcap)
    assert out.tokens.dtype == jnp.int32 and out.logprobs.dtype == jnp.float32
    np.testing.assert_allclose(out.logprobs, ref, atol=2e-6, rtol=0)
    assert len(np.unique(np.asarray(out.tokens))) > 10  # not a degenerate draw
    # the log-prob under the untruncated softmax is logprobs + logmass
    full = _head(hidden, weight, out.tokens, temperature, None, softcap=softcap)
    np.testing.assert_allclose(out.logprobs + out.logmass, full, atol=2e-6, rtol=0)
    truncated = bool(truncation)
    assert bool(np.all(np.isfinite(np.asarray(out.min_logit)))) == truncated
    assert np.all(np.asarray(out.logmass) <= 0)
    assert bool(np.any(np.asarray(out.logmass) < 0)) == truncated


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=str)
def test_draws_follow_the_truncated_softmax_chi_square(truncation):
    # One row repeated: 20,000 draws over 120 ids (8 vocab chunks, a ragged last one).
    hidden, weight, _ = head_inputs(3, 1, 16, 120)
    weight = weight * 0.5
    draws = 20_000
    rows = jnp.broadcast_to(hidden, (draws, 16))
    t = 0.9
    out = _sample(rows, weight, jax.random.key(7), temperature=t, vocab_chunk=16, **truncation)
    l = np.asarray(hidden @ weight, np.float64)[0] / t
    tau = float(out.min_logit[0])
    assert np.all(np.asarray(out.min_logit) == tau)  # one row, one support
    support = l >= tau
    tokens = np.asarray(out.tokens)
    assert support[tokens].all(), "a token outside the support was drawn"
    p = np.where(support, np.exp(l - l.max()), 0.0)
    chi_square_ok(np.bincount(tokens, minlength=120), p / p.sum(), truncation)
    if list(truncation) == ["top_k"]:
        assert support.sum() == 50
    if list(truncation) == ["top_p"]:  # the nucleus: smallest most-likely set reaching p
        q = np.exp(l - l.max())
        q = np.sort(q / q.sum())[::-1]
        n = support.sum()
        assert q[:n].sum() >= 0.8 - 1e-6 > q[: n - 1].sum()


@pytest.mark.parametrize("vocab_chunk", [256, 8192])
def test_the_two_level_draw_follows_the_softmax_chi_square(vocab_chunk):
    """The untruncated draw picks a block of ``SAMPLE_BLOCK`` ids by Gumbel-max over their
    log-masses, then an id inside it by inverse CDF: 40,000 draws over 1,000 ids (7 full
    blocks and a ragged one; chunks of 2 blocks or one chunk), ``num_valid = 900``,
    temperature 0.7, logits spread over ~12 nats so every block carries mass; against the
    float64 softmax over the valid ids, per id and per block."""
    hidden, weight, _ = head_inputs(5, 1, 16, 1000)
    weight = weight * 1.5
    draws, t = 40_000, 0.7
    rows = jnp.broadcast_to(hidden, (draws, 16))
    out = _sample(rows, weight, jax.random.key(11), temperature=t, num_valid=900,
                  vocab_chunk=vocab_chunk)
    l = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)
    l = l[0] / t
    p = np.where(np.arange(1000) < 900, np.exp(l - l.max()), 0.0)
    p /= p.sum()
    tokens = np.asarray(out.tokens)
    assert tokens.max() < 900
    counts = np.bincount(tokens, minlength=1000)
    chi_square_ok(counts, p, "ids")
    block = sampling.SAMPLE_BLOCK
    chi_square_ok(np.add.reduceat(counts, np.arange(0, 1000, block)),
                  np.add.reduceat(p, np.arange(0, 1000, block)), "blocks")
    # the log-prob is under the softmax over every id (as token_logprobs scores it)
    full = l - np.log(np.exp(l - l.max()).sum()) - l.max()
    np.testing.assert_allclose(np.asarray(out.logprobs), full[tokens], atol=2e-5)


def test_a_peaked_row_only_ever_draws_its_certain_token():
    """The reported case: token 0 has probability 1 - 1.5e-39; over 4,000 draws (2 keys x
    2,000 rows, 6e8 noise values) of the chunked sampler every draw is token 0 with
    log-prob 0 (a hash noise rounding to 1.0 drew tokens of log-prob -100). The truncated
    paths get the same check on fewer draws (their bisection costs 32 passes over the
    row)."""
    vocab = 151936
    weight = jnp.zeros((1, vocab), jnp.float32).at[0, 0].set(100.0)
    for k, rows, kw in [(k, 2000, {}) for k in range(2)] + [(10, 200, {"top_p": 0.9})]:
        out = _sample(jnp.ones((rows, 1)), weight, jax.random.key(k), temperature=1.0, **kw)
        assert np.all(np.asarray(out.tokens) == 0), np.unique(np.asarray(out.tokens))
        assert np.all(np.asarray(out.logprobs) == 0.0)


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=str)
def test_never_a_token_of_probability_zero(truncation):
    """Rows with ``-inf`` logits and logits 100 nats below the max (float64 probability
    < 1e-30): over 5 x 10^5 draws at T = 1 and T = 0.3 none is drawn."""
    vocab = 64
    rng = np.random.default_rng(0)
    w = rng.normal(0.0, 1.0, (1, vocab))
    w[0, ::7] = -np.inf
    w[0, 3::7] = -100.0
    weight = jnp.asarray(w, jnp.float32)
    hidden = jnp.ones((250_000, 1), jnp.float32)
    z = w[0]
    for t in (1.0, 0.3):
        p = np.exp((z - z.max()) / t)
        impossible = p / p.sum() < 1e-30
        out = _sample(hidden, weight, jax.random.key(0), temperature=t, vocab_chunk=16,
                      **truncation)
        assert not impossible[np.asarray(out.tokens)].any()
        assert np.all(np.isfinite(np.asarray(out.logprobs)))


def test_the_noise_is_finite_over_its_whole_range():
    """Every one of the 2^23 values the conversion reads gives a uniform strictly inside
    (0, 1) and a finite Gumbel value; the extremes are the documented bounds."""
    k = jnp.arange(1 << 23, dtype=jnp.uint32)
    low_bits = jnp.uint32(0x1FF)
    for bits in (k << 9, (k << 9) | low_bits):
        g = np.asarray(jax.jit(sampling.gumbel_from_bits)(bits))
        assert np.all(np.isfinite(g))
        assert np.all(np.diff(g) > 0)  # strictly increasing in k: no two values collide
        assert -2.82 < g.min() < -2.81 and 16.63 < g.max() < 16.64


def test_the_noise_is_uniform_and_independent():
    """Kolmogorov-Smirnov distance of 2^20 Gumbel values from the Gumbel CDF, and the
    correlation of neighbouring ids and of rows whose seeds differ in one bit."""
    seeds = jax.random.bits(jax.random.key(0), (4, 2), jnp.uint32)
    seeds = seeds.at[1].set(seeds[0] ^ jnp.uint32(1))  # row 1: one bit from row 0
    ids = jnp.broadcast_to(jnp.arange(1 << 18, dtype=jnp.int32), (4, 1 << 18))
    g = np.asarray(sampling._gumbel(seeds, ids), np.float64)
    x = np.sort(g.ravel())
    cdf = np.exp(-np.exp(-x))
    ks = np.max(np.abs(cdf - np.arange(1, x.size + 1) / x.size))
    assert ks < 1.63 / np.sqrt(x.size) * 1.5  # the 1% critical value, with margin
    u = np.exp(-np.exp(-g))
    assert abs(np.corrcoef(u[0, :-1], u[0, 1:])[0, 1]) < 0.01
    assert abs(np.corrcoef(u[0], u[1])[0, 1]) < 0.01


def test_invalid_ids_never_drawn_and_greedy_is_argmax():
    hidden, weight, _ = head_inputs(5, 64, 32, 1000)
    # make the largest logits sit in the invalid tail
    weight = weight.at[:, 900:].multiply(4.0)
    for kw in ({}, {"top_k": 20}):
        out = _sample(hidden, weight, jax.random.key(0), temperature=2.0, num_valid=900,
                      vocab_chunk=256, **kw)
        assert int(out.tokens.max()) < 900
    greedy = _sample(hidden, weight, jax.random.key(0), temperature=0.0, num_valid=900,
                     vocab_chunk=256)
    logits = np.asarray(hidden @ weight)
    np.testing.assert_array_equal(greedy.tokens, logits[:, :900].argmax(axis=1))
    # the log-prob is under the full distribution (the trainer's), temperature 1
    ref = _head(hidden, weight, greedy.tokens, 1.0, None, softcap=None)
    np.testing.assert_allclose(greedy.logprobs, ref, atol=2e-6)


def test_greedy_ties_take_the_lowest_id():
    weight = jnp.zeros((1, 40), jnp.float32).at[0, jnp.array([7, 23, 31])].set(3.0)
    out = _sample(jnp.ones((4, 1)), weight, jax.random.key(0), temperature=0.0,
                  vocab_chunk=16)
    np.testing.assert_array_equal(out.tokens, 7)


def test_greedy_and_sampled_share_one_function():
    hidden, weight, _ = head_inputs(6, 64, 32, 1000)
    key = jax.random.key(3)
    greedy = _sample(hidden, weight, key, temperature=jnp.float32(0.0), vocab_chunk=256)
    np.testing.assert_array_equal(greedy.tokens, np.asarray(hidden @ weight).argmax(axis=1))
    hot = _sample(hidden, weight, key, temperature=jnp.float32(3.0), vocab_chunk=256)
    assert np.mean(np.asarray(hot.tokens) != np.asarray(greedy.tokens)) > 0.5


def test_a_draw_does_not_depend_on_the_chunking():
    hidden, weight, _ = head_inputs(10, 32, 16, 1000)
    outs = [_sample(hidden, weight, jax.random.key(4), temperature=1.0, vocab_chunk=c)
            for c in (128, 1000)]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)


@pytest.mark.parametrize("truncation", [{}, {"top_p": 0.9}], ids=str)
def test_row_ids_draw_the_rows_of_the_whole_batch(truncation):
    # a decoder that drops finished rows passes each kept row's index in the whole batch:
    # the kept rows then draw exactly what they draw in the whole batch
    hidden, weight, _ = head_inputs(12, 16, 16, 500)
    key = jax.random.key(8)
    whole = jaxhead.sample(hidden, weight, key, temperature=1.0, **truncation)
    ids = jnp.array([13, 2, 2, 7, 15], jnp.int32)
    part = jax.jit(lambda h, i: jaxhead.sample(h, weight, key, temperature=1.0, row_ids=i,
                                               num_rows=16, **truncation))(hidden[ids], ids)
    pick = np.asarray(ids)
    np.testing.assert_array_equal(part.tokens, np.asarray(whole.tokens)[pick])
    for got, want in zip(part[1:], whole[1:]):  # float rounding of another batch shape
        np.testing.assert_allclose(got, np.asarray(want)[pick], atol=1e-6, rtol=0)
    unnumbered = jaxhead.sample(hidden[ids], weight, key, temperature=1.0, **truncation)
    assert not np.array_equal(unnumbered.tokens, part.tokens)  # the ids do matter
    with pytest.raises(ValueError, match="row_ids needs num_rows"):
        jaxhead.sample(hidden, weight, key, row_ids=jnp.arange(16))
    with pytest.raises(ValueError, match=r"row_ids must be integer \[B\] = \[16\]"):
        jaxhead.sample(hidden, weight, key, row_ids=jnp.arange(3), num_rows=16)
    with pytest.raises(ValueError, match="num_rows=16 needs row_ids"):
        jaxhead.sample(hidden, weight, key, num_rows=16)


@pytest.mark.parametrize("truncation", [{}, {"top_k": 20}], ids=str)
def test_per_row_keys_draw_what_each_key_draws_alone(truncation):
    # a decoder whose rows are at different steps gives each row its step's key: row b
    # then draws what row row_ids[b] of a whole-batch call with key[b] draws
    hidden, weight, _ = head_inputs(16, 16, 16, 500)
    key = jax.random.key(8)
    steps = jnp.array([0, 3, 3, 1, 7], jnp.int32)
    ids = jnp.array([13, 2, 5, 7, 15], jnp.int32)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, steps)
    got = jax.jit(lambda h, k: jaxhead.sample(h, weight, k, temperature=1.0, row_ids=ids,
                                              num_rows=16, **truncation))(hidden[ids], keys)
    for b, (step, row) in enumerate(zip(np.asarray(steps), np.asarray(ids))):
        whole = jaxhead.sample(hidden, weight, jax.random.fold_in(key, step),
                               temperature=1.0, **truncation)
        assert got.tokens[b] == whole.tokens[row], (b, step, row)
        np.testing.assert_allclose(got.logprobs[b], whole.logprobs[row], atol=1e-6, rtol=0)
    alone = jaxhead.sample(hidden[:3], weight, keys[:3], temperature=1.0)  # no row_ids
    for b in range(3):
        want = jaxhead.sample(hidden[b:b + 1], weight, keys[b], temperature=1.0)
        assert alone.tokens[b] == want.tokens[0]
    with pytest.raises(ValueError, match=r"one per row \(\[16\]\), got keys of shape \(5,\)"):
        jaxhead.sample(hidden, weight, keys, row_ids=jnp.arange(16), num_rows=16)


def test_bad_arguments_raise():
    hidden, weight, _ = head_inputs(9, 4, 8, 20)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="num_valid"):
        jaxhead.sample(hidden, weight, key, num_valid=21)
    with pytest.raises(ValueError, match="temperature"):
        jaxhead.sample(hidden, weight, key, temperature=-1.0)
    with pytest.raises(ValueError, match=r"temperature must be a scalar .* shape \(4,\)"):
        jaxhead.sample(hidden, weight, key, temperature=np.full(4, 0.7, np.float32))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] \(1: off\), got 0.0"):
        jaxhead.sample(hidden, weight, key, top_p=0.0)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, V=20\]"):
        jaxhead.sample(hidden, weight, key, top_k=21)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\)"):
        jaxhead.sample(hidden, weight, key, min_p=1.0)
    with pytest.raises(ValueError, match="hidden"):
        jaxhead.sample(hidden[:, :4], weight, key)
    # dtypes as token_logprobs checks them (issue 36: these were accepted)
    with pytest.raises(TypeError, match="hidden and weight must be floating, got int32"):
        jaxhead.sample(hidden.astype(jnp.int32), weight.astype(jnp.int32), key)
    with pytest.raises(TypeError, match="hidden dtype bfloat16 != weight dtype float32"):
        jaxhead.sample(hidden.astype(jnp.bfloat16), weight, key)
    with pytest.raises(ValueError, match=r"vocab_chunk must be an integer >= 1 .* got 2.0"):
        jaxhead.sample(hidden, weight, key, vocab_chunk=2.0)


_traced = jax.jit(lambda h, w, key, top_k, top_p, min_p: jaxhead.sample(
    h, w, key, top_k=top_k, top_p=top_p, min_p=min_p, vocab_chunk=256))


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=str)
def test_traced_settings_draw_what_python_numbers_draw(truncation):
    """Issue 36: with the same key, ``top_p=1.0`` as a Python number and as a traced value
    took different paths (1.3% of 2,000 rows agreed). The values decide, not the tracing."""
    hidden, weight, _ = head_inputs(0, 64, 32, 1000, exact_dot=True)
    key = jax.random.key(1)
    static = _sample(hidden, weight, key, temperature=1.0, softcap=None, vocab_chunk=256,
                     **truncation)
    settings = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **truncation}
    traced = _traced(hidden, weight, key, np.int32(settings["top_k"]),
                     np.float32(settings["top_p"]), np.float32(settings["min_p"]))
    np.testing.assert_array_equal(traced.tokens, static.tokens)
    chex.assert_trees_all_close(traced, static, atol=1e-6)


def test_a_nan_logit_is_nan_in_the_logprob_with_truncation_too():
    """Issue 36: a NaN logit with truncation gave a finite log-prob (it fell outside the
    support); untruncated it was NaN already. Only the row holding it is NaN."""
    logits = jax.random.normal(jax.random.key(0), (4, 300)).at[1, 7].set(jnp.nan)
    draw = jax.jit(lambda top_k, top_p, min_p: jaxhead.sample_from_logits(
        logits, jax.random.key(1), top_k=top_k, top_p=top_p, min_p=min_p))
    for truncation in TRUNCATIONS:
        settings = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **truncation}
        out = draw(np.int32(settings["top_k"]), np.float32(settings["top_p"]),
                   np.float32(settings["min_p"]))
        logp = np.asarray(out.logprobs)
        assert np.isnan(logp[1]), truncation
        assert np.isfinite(np.delete(logp, 1)).all(), truncation
