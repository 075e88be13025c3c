"""jaxhead.sample_from_logits: the draw of ``jaxhead.sample`` from given logits draws the
same tokens from bitwise the same logits, follows the float64 softmax, and never draws an
id whose logit is ``-inf``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from harness.oracle import head_inputs
from tests.support.sampling import TRUNCATIONS, chi_square_ok

_from_logits = jax.jit(jaxhead.sample_from_logits, static_argnames=(
    "num_valid", "vocab_chunk", "top_k", "top_p", "min_p"))
_sample = jax.jit(jaxhead.sample, static_argnames=(
    "num_valid", "vocab_chunk", "top_k", "top_p", "min_p"))


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=str)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_the_same_draw_as_sample_from_the_same_logits(truncation, temperature):
    # exact_dot: every float32 tiling of hidden @ weight gives the same logits, so both
    # calls see bitwise the same numbers
    hidden, weight, _ = head_inputs(3, 64, 32, 1000, exact_dot=True)
    kw = dict(temperature=temperature, num_valid=990, vocab_chunk=256, **truncation)
    key = jax.random.key(7)
    ref = _sample(hidden, weight, key, **kw)
    out = _from_logits(hidden @ weight, key, **kw)
    for name, a, b in zip(ref._fields, out, ref, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert len(np.unique(np.asarray(out.tokens))) > (1 if temperature == 0 else 10)


def test_the_draw_follows_the_float64_softmax_chi_square():
    """40,000 draws from one bf16 row of 1,000 logits spread over ~12 nats, a quarter of
    them ``-inf``, temperature 1.3: per id against the float64 softmax; a ``-inf`` id is
    never drawn, and each log-prob is the float64 one."""
    rng = np.random.default_rng(0)
    row = rng.normal(0.0, 3.0, 1000).astype(jnp.bfloat16)
    row[rng.permutation(1000)[:250]] = -np.inf
    draws, t = 40_000, 1.3
    out = _from_logits(jnp.broadcast_to(jnp.asarray(row), (draws, 1000)), jax.random.key(2),
                       temperature=t, vocab_chunk=384)
    l = row.astype(np.float64) / t
    p = np.exp(l - l.max())
    p /= p.sum()
    tokens = np.asarray(out.tokens)
    assert np.all(np.isfinite(row[tokens]))
    chi_square_ok(np.bincount(tokens, minlength=1000), p, "ids")
    np.testing.assert_allclose(np.asarray(out.logprobs), np.log(p[tokens]), atol=2e-5)


def test_bad_arguments_raise():
    logits = jnp.ones((4, 20))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"logits must be \[B, V\], got shape \(4, 1, 20\)"):
        jaxhead.sample_from_logits(logits[:, None], key)
    with pytest.raises(ValueError, match="logits must be floating point, got int32"):
        jaxhead.sample_from_logits(jnp.ones((4, 20), jnp.int32), key)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, V=20\]"):
        jaxhead.sample_from_logits(logits, key, top_k=21)
    with pytest.raises(ValueError, match="num_valid must be in"):
        jaxhead.sample_from_logits(logits, key, num_valid=0)
    with pytest.raises(ValueError, match="vocab_chunk must be an integer >= 1 known on the host, got 0"):
        jaxhead.sample_from_logits(logits, key, vocab_chunk=0)
    with pytest.raises(ValueError, match="at least one row, got B = 0"):
        jaxhead.sample_from_logits(logits[:0], key)
    with pytest.raises(ValueError, match="temperature must be finite and >= 0, got inf"):
        jaxhead.sample_from_logits(logits, key, temperature=float("inf"))
    with pytest.raises(ValueError, match=r"top_k must be an int .* got np.float32\(3.0\)"):
        jaxhead.sample_from_logits(logits, key, top_k=np.float32(3))
    # a nested list is an array like any other
    out = jaxhead.sample_from_logits([[0.0, 5.0, -np.inf]], key, temperature=0.0)
    assert int(out.tokens[0]) == 1
