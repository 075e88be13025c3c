"""Under ``jit`` an invalid kept token (a label outside ``[0, V)``, or more kept tokens
than the bucket holds) is NaN in the log-prob *and* in both gradients, in every
implementation and in the reference, so that a guard on the gradient (the trainer's,
``optax.apply_if_finite``) sees it; a valid call's gradients stay finite."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from harness.oracle import head_inputs
from jaxhead._src.head.invalid import invalid_kept

N, H, V = 24, 16, 200


@pytest.fixture(scope="module")
def data():
    hidden, weight, labels = head_inputs(31, N, H, V)
    keep = jnp.asarray(np.random.default_rng(0).random(N) < 0.5).at[0].set(True)
    return hidden, weight, labels, keep


@functools.cache
def _grad_fn(fn):
    def loss(h, w, y, k):
        out = fn(h, w, y, k)
        return jnp.sum(jnp.where(k, out.logprobs + 0.1 * out.entropy, 0.0)), out.logprobs

    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


def _grads(fn, hidden, weight, labels, keep):
    (_, logp), (dh, dw) = _grad_fn(fn)(hidden, weight, labels, keep)
    return np.asarray(logp), np.asarray(dh), np.asarray(dw)


@functools.cache
def _heads(bucket):
    heads = {impl: functools.partial(jaxhead.token_logprobs, bucket=bucket, impl=impl)
             for impl in ("xla", "xla_cpu", "reference")}
    heads["reference_token_logprobs"] = jaxhead.reference_token_logprobs
    return heads


@pytest.mark.parametrize("name", list(_heads(16)))
def test_a_kept_label_out_of_range_is_nan_in_value_and_both_gradients(data, name):
    hidden, weight, labels, keep = data
    fn = _heads(16)[name]
    logp, dh, dw = _grads(fn, hidden, weight, labels, keep)
    assert np.isfinite(logp).all() and np.isfinite(dh).all() and np.isfinite(dw).all()
    for bad_label in (V, -7, 10**6):
        logp, dh, dw = _grads(fn, hidden, weight, labels.at[0].set(bad_label), keep)
        assert np.isnan(logp[0]), (name, bad_label)
        assert np.isnan(dh).any() and np.isnan(dw).all(), (name, bad_label)


@pytest.mark.parametrize("impl", ["xla", "xla_cpu", "reference"])
def test_a_bucket_overflow_is_nan_in_value_and_both_gradients(data, impl):
    hidden, weight, labels, keep = data
    fn = _heads(4)[impl]  # a traced keep with more kept tokens than 4 slots
    logp, dh, dw = _grads(fn, hidden, weight, labels, keep)
    assert np.isnan(logp[np.asarray(keep)]).any()
    assert np.isnan(dh).any() and np.isnan(dw).all()


def test_an_unkept_invalid_label_changes_nothing(data):
    hidden, weight, labels, keep = data
    off = int(np.flatnonzero(~np.asarray(keep))[0])
    logp, dh, dw = _grads(_heads(16)["xla"], hidden, weight, labels.at[off].set(-100), keep)
    assert np.isfinite(logp).all() and np.isfinite(dh).all() and np.isfinite(dw).all()


def test_invalid_kept_counts_per_shard():
    keep = jnp.array([True, True, True, False, False, False])
    labels = jnp.zeros(6, jnp.int32)
    assert not bool(invalid_kept(labels, keep, 10, 3))
    assert bool(invalid_kept(labels, keep, 10, 2, shards=2))  # shard 0 keeps 3 > 2
    assert not bool(invalid_kept(labels, keep, 10, 3, shards=2))
    assert bool(invalid_kept(labels.at[4].set(10), None, 10, 6))
