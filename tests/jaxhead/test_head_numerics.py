"""Forward and gradient accuracy of the chunked head against a float64 oracle, for the
backend-neutral XLA path (``impl="xla"``) and the XLA:CPU-tuned one (``impl="xla_cpu"``)."""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from harness.oracle import grads64, head_inputs, ref64, rel_err, weighted_loss

QWEN_VOCAB = 151936
CONFIGS = {"xla": jaxhead.XlaConfig, "xla_cpu": jaxhead.XlaCpuConfig}
impls = pytest.mark.parametrize("impl", list(CONFIGS))


def covering(values: list, default: set) -> list:
    """Every combination of ``values`` (one list per parameter) as a ``pytest.param``; those
    not in ``default`` (a covering subset) are marked slow."""
    return [pytest.param(*case, marks=() if case in default else pytest.mark.slow,
                         id="-".join(map(str, case)))
            for case in itertools.product(*values)]


def _kw(impl, **config):
    """``token_logprobs`` keywords selecting ``impl`` with ``config`` fields."""
    return {"config": CONFIGS[impl](**config)}


def _fwd(hidden, weight, labels, impl, config=None, **kw):
    kw.update(_kw(impl, **(config or {})))
    return jax.jit(lambda h, w, y: jaxhead.token_logprobs(h, w, y, **kw))(hidden, weight, labels)


@impls
def test_f32_qwen_vocab_matches_float64(impl):
    hidden, weight, labels = head_inputs(0, 128, 256, QWEN_VOCAB, exact_dot=True)
    out = _fwd(hidden, weight, labels, impl)
    ref_lp, ref_ent = ref64(hidden, weight, labels)
    chex.assert_trees_all_equal_dtypes(out.logprobs, out.entropy, jnp.zeros((), jnp.float32))
    assert np.max(np.abs(np.asarray(out.logprobs) - ref_lp)) <= 2e-6
    assert np.max(np.abs(np.asarray(out.entropy) - ref_ent) / np.abs(ref_ent)) <= 1e-5
    assert np.any(ref_lp > -0.1) and np.any(ref_ent < 1.0)  # peaked rows are exercised


@impls
def test_f32_error_is_bounded_by_matmul_rounding(impl):
    """General float32 data: the only error beyond 2e-6 is the matmul's own rounding of
    the logits (measured here on the same inputs), which every implementation shares."""
    hidden, weight, labels = head_inputs(10, 256, 256, 32768)
    out = _fwd(hidden, weight, labels, impl)
    ref_lp, _ = ref64(hidden, weight, labels)
    logits64 = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)
    dot_err = np.max(np.abs(np.asarray(jnp.dot(hidden, weight)) - logits64))
    assert dot_err > 0  # the data does exercise matmul rounding
    assert np.max(np.abs(np.asarray(out.logprobs) - ref_lp)) <= 2e-6 + 2 * dot_err


@impls
def test_bf16_qwen_vocab_matches_float64_on_same_values(impl):
    hidden, weight, labels = head_inputs(1, 128, 256, QWEN_VOCAB, jnp.bfloat16)
    out = _fwd(hidden, weight, labels, impl)
    ref_lp, ref_ent = ref64(hidden, weight, labels)
    assert out.logprobs.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(out.logprobs) - ref_lp)) <= 1e-4
    assert np.max(np.abs(np.asarray(out.entropy) - ref_ent)) <= 1e-4


#: (vocab_chunk, vocab, impl): every pair of values once; the other 4 run with -m slow
RAGGED_PAIRWISE = {(128, 1000, "xla"), (4096, 50257, "xla"), (4096, 1000, "xla_cpu"),
                   (128, 50257, "xla_cpu")}


@pytest.mark.parametrize("vocab_chunk, vocab, impl", covering(
    [[128, 4096], [1000, 50257], list(CONFIGS)], RAGGED_PAIRWISE))
def test_ragged_vocab_adds_no_padding_mass(impl, vocab, vocab_chunk):
    hidden, weight, labels = head_inputs(2, 96, 64, vocab, exact_dot=True)
    out = _fwd(hidden, weight, labels, impl, {"vocab_chunk": vocab_chunk, "token_chunk": 32})
    ref_lp, ref_ent = ref64(hidden, weight, labels)
    np.testing.assert_allclose(out.logprobs, ref_lp, atol=2e-6, rtol=0)
    # near-deterministic rows have entropies ~1e-3: float32 log(s) at s ~ 1 is good to ~1e-7
    np.testing.assert_allclose(out.entropy, ref_ent, rtol=1e-5, atol=1e-6)


@impls
def test_temperature_and_softcap_forward(impl):
    hidden, weight, labels = head_inputs(3, 80, 48, 1000, exact_dot=True)
    temp = jax.random.uniform(jax.random.key(9), (80,), minval=0.3, maxval=2.0)
    out = _fwd(hidden, weight, labels, impl, {"vocab_chunk": 256}, temperature=temp,
               softcap=7.5)
    ref_lp, ref_ent = ref64(hidden, weight, labels, temperature=temp, softcap=7.5)
    # temperatures down to 0.3 triple the logits: allow their float32 rounding (1e-7 rel)
    np.testing.assert_allclose(out.logprobs, ref_lp, atol=2e-6, rtol=1e-7)
    np.testing.assert_allclose(out.entropy, ref_ent, rtol=1e-5, atol=1e-6)


def test_batch_shape_is_preserved():
    hidden, weight, labels = head_inputs(4, 2 * 3 * 16, 32, 500)
    h3, y3 = hidden.reshape(2, 3, 16, 32), labels.reshape(2, 3, 16)
    config = jaxhead.XlaConfig(vocab_chunk=128)
    out = jaxhead.token_logprobs(h3, weight, y3, config=config)
    flat = jaxhead.token_logprobs(hidden, weight, labels, config=config)
    chex.assert_shape([out.logprobs, out.entropy], (2, 3, 16))
    chex.assert_trees_all_close(out.logprobs.reshape(-1), flat.logprobs, atol=0, rtol=0)


COTANGENTS = {"logp": (True, False), "entropy": (False, True), "both": (True, True)}
#: (variant, cotangent, backward, impl): a pairwise covering set of the 36 combinations
#: (every pair of values of any two parameters once at least); the others run with
#: ``pytest -m slow``
PAIRWISE = {("plain", "logp", "fused", "xla"), ("plain", "entropy", "two_pass", "xla_cpu"),
            ("plain", "both", "fused", "xla_cpu"), ("per_token_temp", "logp", "two_pass", "xla_cpu"),
            ("per_token_temp", "entropy", "fused", "xla"),
            ("per_token_temp", "both", "two_pass", "xla"), ("softcap", "logp", "two_pass", "xla"),
            ("softcap", "entropy", "fused", "xla_cpu"), ("softcap", "both", "fused", "xla")}


@pytest.mark.parametrize("variant, cotangent, backward, impl", covering(
    [["plain", "per_token_temp", "softcap"], list(COTANGENTS), ["fused", "two_pass"],
     list(CONFIGS)], PAIRWISE))
def test_gradients_match_float64_autodiff(variant, cotangent, backward, impl):
    fused_max = 0 if backward == "two_pass" else 256 * 2**20
    n, h, v = 72, 40, 1000
    hidden, weight, labels = head_inputs(5, n, h, v)
    kr = jax.random.split(jax.random.key(6), 3)
    kw = {}
    if variant == "per_token_temp":
        kw["temperature"] = jax.random.uniform(kr[0], (n,), minval=0.4, maxval=1.8)
    if variant == "softcap":
        kw.update(softcap=5.0, temperature=0.8)
    use_g, use_e = COTANGENTS[cotangent]
    g = jax.random.normal(kr[1], (n,)) if use_g else None
    e = jax.random.normal(kr[2], (n,)) if use_e else None
    loss = weighted_loss(jaxhead.token_logprobs, g, e, **kw, **_kw(
        impl, token_chunk=24, vocab_chunk=128, fused_backward_max_bytes=fused_max))
    got = jax.jit(jax.grad(loss, (0, 1)))(hidden, weight, labels)
    ref = grads64(weighted_loss(jaxhead.reference_token_logprobs, g, e, **kw),
                  hidden, weight, labels)
    chex.assert_trees_all_equal_dtypes(got, (hidden, weight))
    for x, r in zip(got, ref):
        assert rel_err(x, r) <= 1e-5, rel_err(x, r)


@pytest.mark.parametrize("config", [
    jaxhead.XlaConfig(vocab_chunk=512),
    jaxhead.XlaCpuConfig(vocab_chunk=512),  # dw through uint16 bits
    jaxhead.XlaCpuConfig(vocab_chunk=512, dw_bits_max_bytes=0, bf16_matmul=True),
    jaxhead.XlaCpuConfig(vocab_chunk=512, bf16_matmul=False),  # tiles widened to float32
], ids=["xla", "xla_cpu-bits", "xla_cpu-bf16-tiles", "xla_cpu-f32-tiles"])
def test_bf16_gradients_close_to_float64(config):
    hidden, weight, labels = head_inputs(7, 64, 64, 2000, jnp.bfloat16)
    g = jax.random.normal(jax.random.key(1), (64,))
    e = jax.random.normal(jax.random.key(2), (64,))
    loss = weighted_loss(jaxhead.token_logprobs, g, e, config=config)
    got = jax.grad(loss, (0, 1))(hidden, weight, labels)
    ref = grads64(weighted_loss(jaxhead.reference_token_logprobs, g, e), hidden, weight, labels)
    chex.assert_trees_all_equal_dtypes(got, (hidden, weight))
    for x, r in zip(got, ref):
        assert rel_err(x, r) <= 1e-2  # bf16 gradient outputs: ~3 significant digits


@impls
@pytest.mark.parametrize("second", [5, 700])  # tie inside the first chunk / in a later one
def test_tied_maximum_logits_are_counted_once_each(impl, second):
    hidden, weight, labels = head_inputs(8, 48, 32, 1000, exact_dot=True, peaked_fraction=1.0)
    spike = np.asarray(labels)
    # every row's spike column duplicated: two exactly equal maxima per row
    w = np.asarray(weight).copy()
    w[:, second] = w[:, spike[0]]
    weight = jnp.asarray(w)
    out = _fwd(hidden, weight, labels, impl, {"vocab_chunk": 256})
    ref_lp, ref_ent = ref64(hidden, weight, labels)
    np.testing.assert_allclose(out.logprobs, ref_lp, atol=2e-6, rtol=0)
    np.testing.assert_allclose(out.entropy, ref_ent, rtol=1e-5, atol=1e-6)
    assert ref_lp[0] < -0.6  # row 0 really has two maxima: p(label) <= 1/2
