"""jaxhead.sample: chunked Gumbel-max draws follow the softmax, and their log-probs are
the head's (``jaxhead.token_logprobs``) to float32 precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from tests.support.oracle import head_inputs

# one compiled function per static setting, shared by the tests (compiles dominate here)
_sample = jax.jit(jaxhead.sample, static_argnames=("softcap", "num_valid", "vocab_chunk"))
_logprobs = jax.jit(lambda h, w, y, t, softcap: jaxhead.token_logprobs(
    h, w, y, temperature=t, softcap=softcap, config=jaxhead.XlaConfig(vocab_chunk=256)).logprobs,
    static_argnames="softcap")


@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.7, None), (1.3, 5.0)])
def test_logprobs_equal_token_logprobs(temperature, softcap):
    hidden, weight, _ = head_inputs(0, 64, 32, 1000)
    out = _sample(hidden, weight, jax.random.key(1), temperature=temperature,
                  softcap=softcap, vocab_chunk=256)
    ref = _logprobs(hidden, weight, out.tokens, temperature, softcap=softcap)
    assert out.tokens.dtype == jnp.int32 and out.logprobs.dtype == jnp.float32
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-5, rtol=0)
    assert len(np.unique(np.asarray(out.tokens))) > 10  # not a degenerate draw


def test_draws_follow_the_softmax_chi_square():
    # One row repeated: 20,000 draws over 40 ids (3 vocab chunks, a ragged last one).
    hidden, weight, _ = head_inputs(3, 1, 16, 40)
    weight = weight * 0.5
    draws = 20_000
    rows = jnp.broadcast_to(hidden, (draws, 16))
    out = jax.jit(lambda h, k: jaxhead.sample(h, weight, k, temperature=0.9,
                                               vocab_chunk=16))(rows, jax.random.key(7))
    p = np.asarray(jax.nn.softmax((hidden @ weight)[0] / 0.9), np.float64)
    counts = np.bincount(np.asarray(out.tokens), minlength=40)
    expected = p * draws
    big = expected >= 5  # pool the rare ids into one cell
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    # P(chi2 > dof + 5 sqrt(2 dof)) is below 1e-4 for these dof: a wrong sampler (e.g.
    # the noise of one chunk reused, or temperature ignored) fails by orders of magnitude.
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def test_invalid_ids_never_drawn_and_greedy_is_argmax():
    hidden, weight, _ = head_inputs(5, 64, 32, 1000)
    # make the largest logits sit in the invalid tail
    weight = weight.at[:, 900:].multiply(4.0)
    out = _sample(hidden, weight, jax.random.key(0), temperature=2.0, num_valid=900,
                  vocab_chunk=256)
    assert int(out.tokens.max()) < 900
    greedy = _sample(hidden, weight, jax.random.key(0), temperature=0.0, num_valid=900,
                     vocab_chunk=256)
    logits = np.asarray(hidden @ weight)
    np.testing.assert_array_equal(greedy.tokens, logits[:, :900].argmax(axis=1))
    # the log-prob is under the full distribution (the trainer's), temperature 1
    ref = _logprobs(hidden, weight, greedy.tokens, 1.0, softcap=None)
    np.testing.assert_allclose(greedy.logprobs, ref, atol=1e-5)


def test_greedy_and_sampled_share_one_function():
    hidden, weight, _ = head_inputs(6, 64, 32, 1000)
    key = jax.random.key(3)
    greedy = _sample(hidden, weight, key, temperature=jnp.float32(0.0), vocab_chunk=256)
    np.testing.assert_array_equal(greedy.tokens, np.asarray(hidden @ weight).argmax(axis=1))
    hot = _sample(hidden, weight, key, temperature=jnp.float32(3.0), vocab_chunk=256)
    assert np.mean(np.asarray(hot.tokens) != np.asarray(greedy.tokens)) > 0.5


def test_top_p_draws_only_from_the_nucleus():
    hidden, weight, _ = head_inputs(8, 4, 16, 50)
    rows = jnp.repeat(hidden, 1000, axis=0)
    out = jaxhead.top_p_sample(rows, weight, jax.random.key(2), temperature=1.0, top_p=0.6)
    p = np.asarray(jax.nn.softmax(hidden @ weight), np.float64)
    tokens = np.asarray(out.tokens).reshape(4, 1000)
    for r in range(4):
        order = np.argsort(-p[r])
        before = np.cumsum(p[r][order]) - p[r][order]
        nucleus = set(order[before < 0.6].tolist())
        assert set(np.unique(tokens[r]).tolist()) <= nucleus
    ref = jaxhead.token_logprobs(rows, weight, out.tokens).logprobs
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-5)


def test_bad_arguments_raise():
    hidden, weight, _ = head_inputs(9, 4, 8, 20)
    with pytest.raises(ValueError, match="num_valid"):
        jaxhead.sample(hidden, weight, jax.random.key(0), num_valid=21)
    with pytest.raises(ValueError, match="temperature"):
        jaxhead.sample(hidden, weight, jax.random.key(0), temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        jaxhead.top_p_sample(hidden, weight, jax.random.key(0), temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="hidden"):
        jaxhead.sample(hidden[:, :4], weight, jax.random.key(0))
