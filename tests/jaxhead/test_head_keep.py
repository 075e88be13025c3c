"""Keep-mask semantics: kept rows equal the no-skip result, skipped rows are inert."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from harness.oracle import head_inputs, weighted_loss

N, H, V = 160, 32, 700
KW = {"config": jaxhead.XlaCpuConfig(token_chunk=32, vocab_chunk=128)}


@pytest.fixture(scope="module")
def data():
    hidden, weight, labels = head_inputs(11, N, H, V)
    keep = jax.random.bernoulli(jax.random.key(12), 0.3, (N,))
    g = jax.random.normal(jax.random.key(13), (N,))
    e = jax.random.normal(jax.random.key(14), (N,))
    return hidden, weight, labels, keep, g, e


def _grads(hidden, weight, labels, keep, g, e, **kw):
    loss = weighted_loss(jaxhead.token_logprobs, g, e, **KW, **kw)
    return jax.grad(loss, (0, 1))(hidden, weight, labels, keep)


def test_kept_rows_equal_full_result_and_skipped_are_zero(data):
    hidden, weight, labels, keep, _g, _e = data
    full = jaxhead.token_logprobs(hidden, weight, labels, **KW)
    out = jaxhead.token_logprobs(hidden, weight, labels, keep, **KW)
    k = np.asarray(keep)
    assert 0 < k.sum() < N
    for got, ref in [(out.logprobs, full.logprobs), (out.entropy, full.entropy)]:
        np.testing.assert_allclose(np.asarray(got)[k], np.asarray(ref)[k], atol=1e-6, rtol=0)
        assert np.all(np.asarray(got)[~k] == 0.0)


def test_gradients_of_skipped_rows_are_exactly_zero(data):
    hidden, weight, labels, keep, g, e = data
    dh, dw = _grads(hidden, weight, labels, keep, g, e)
    # the same gradient as the full computation with the skipped cotangents zeroed
    dh_full, dw_full = _grads(hidden, weight, labels, None, g * keep, e * keep)
    k = np.asarray(keep)
    assert np.all(np.asarray(dh)[~k] == 0.0)
    np.testing.assert_allclose(dh, dh_full, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(dw, dw_full, atol=1e-6, rtol=1e-5)


def test_all_false_keep_gives_zeros_and_zero_gradients(data):
    hidden, weight, labels, _, g, e = data
    keep = jnp.zeros((N,), bool)
    out = jaxhead.token_logprobs(hidden, weight, labels, keep, **KW)
    assert np.all(np.asarray(out.logprobs) == 0) and np.all(np.asarray(out.entropy) == 0)
    dh, dw = _grads(hidden, weight, labels, keep, g, e)
    assert np.all(np.asarray(dh) == 0) and np.all(np.asarray(dw) == 0)


def test_nan_in_skipped_hidden_does_not_reach_kept_tokens(data):
    hidden, weight, labels, keep, g, e = data
    poisoned = jnp.where(keep[:, None], hidden, jnp.nan)
    clean = jaxhead.token_logprobs(hidden, weight, labels, keep, **KW)
    out = jaxhead.token_logprobs(poisoned, weight, labels, keep, **KW)
    chex.assert_trees_all_equal(out, clean)
    dh, dw = _grads(poisoned, weight, labels, keep, g, e)
    dh_ref, dw_ref = _grads(hidden, weight, labels, keep, g, e)
    chex.assert_tree_all_finite((dh, dw))
    chex.assert_trees_all_equal((dh, dw), (dh_ref, dw_ref))


def test_static_bucket_under_jit_matches_eager(data):
    hidden, weight, labels, keep, _g, _e = data
    bucket = jaxhead.bucket_size(int(keep.sum()), N)
    assert bucket < N
    eager = jaxhead.token_logprobs(hidden, weight, labels, keep, **KW)
    jitted = jax.jit(
        lambda h, w, y, k: jaxhead.token_logprobs(h, w, y, k, bucket=bucket, **KW)
    )(hidden, weight, labels, keep)
    chex.assert_trees_all_close(jitted, eager, atol=0, rtol=0)


def test_traced_keep_without_bucket_computes_all_rows(data):
    hidden, weight, labels, keep, _g, _e = data
    eager = jaxhead.token_logprobs(hidden, weight, labels, keep, **KW)
    jitted = jax.jit(lambda k: jaxhead.token_logprobs(hidden, weight, labels, k, **KW))(keep)
    chex.assert_trees_all_close(jitted, eager, atol=1e-6, rtol=0)


def test_bucket_overflow_under_jit_marks_lost_tokens_nan(data):
    hidden, weight, labels, keep, *_ = data
    count = int(keep.sum())
    out = jax.jit(
        lambda k: jaxhead.token_logprobs(hidden, weight, labels, k, bucket=16, **KW)
    )(keep)
    lp = np.asarray(out.logprobs)
    k = np.asarray(keep)
    assert count > 16
    assert np.isnan(lp[k]).sum() == count - 16  # exactly the tokens that did not fit
    assert np.all(lp[~k] == 0)


def test_out_of_range_label_under_jit_is_nan_not_silent(data):
    hidden, weight, labels, _keep, *_ = data
    bad = labels.at[3].set(V + 5)
    out = jax.jit(lambda y: jaxhead.token_logprobs(hidden, weight, y, **KW))(bad)
    lp = np.asarray(out.logprobs)
    assert np.isnan(lp[3]) and np.isfinite(np.delete(lp, 3)).all()


def test_a_zero_bucket_computes_nothing():
    """The reported case: ``bucket=0`` with nothing kept gives zeros (it raised an internal
    TypeError); under ``jit`` a kept token that cannot fit a zero bucket is NaN, and eagerly
    the bucket check names it."""
    hidden, weight = jnp.ones((1, 4)), jnp.ones((4, 8))
    labels = jnp.asarray([0])
    for impl in ("xla", "xla_cpu", "reference"):
        out = jaxhead.token_logprobs(hidden, weight, labels, jnp.asarray([False]), bucket=0,
                                     impl=impl)
        assert float(out.logprobs[0]) == 0.0 and float(out.entropy[0]) == 0.0
        g = jax.grad(lambda h, impl=impl: jaxhead.token_logprobs(
            h, weight, labels, jnp.asarray([False]), bucket=0, impl=impl).logprobs.sum())(hidden)
        assert np.all(np.asarray(g) == 0.0)
    run = jax.jit(lambda k: jaxhead.token_logprobs(hidden, weight, labels, k, bucket=0).logprobs)
    assert np.isnan(float(run(jnp.asarray([True]))[0]))
    with pytest.raises(ValueError, match="bucket=0 is smaller than the 1 kept tokens"):
        jaxhead.token_logprobs(hidden, weight, labels, jnp.asarray([True]), bucket=0)
