"""``weight_layout="vh"``: a ``[V, H]`` head weight (a tied embedding table) used in place.

Every implementation that runs on CPU (the kernels in Pallas interpret mode) gives with
``W.T`` and ``"vh"`` what it gives with ``W`` and ``"hv"``, forward and both gradients (the
weight's in ``[V, H]``): bf16 bit for bit; float32 within 1e-6 of the largest magnitude
(XLA:CPU's float32 dot accumulates a transposed operand in another order, so the last bit
of a logit may differ). With soft-cap, per-token temperatures, a truncated support on some
rows, a keep mask (compaction, padding rows) and repeated labels; against the float64
reference; the sharded head on 8 CPU devices (a subprocess), token- and vocab-parallel;
``sample``'s tokens; the bad-value errors; and the tied ``LMHead``'s compiled temporaries
(no transposed copy of the table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import jaxhead
from harness.oracle import grads64, head_inputs, ref64, rel_err, to64, weighted_loss
from tests.support.multidevice import run_case

N, H, V = 48, 40, 300  # ragged vocab tiles everywhere; H = 40 is not a multiple of K = 16
SOFTCAP = 20.0
MIB = 2**20
IMPLS = ("xla", "xla_cpu", "pallas_tpu", "pallas_triton", "reference")
CONFIGS = {
    "xla": jaxhead.XlaConfig(token_chunk=16, vocab_chunk=96),
    "xla_cpu": jaxhead.XlaCpuConfig(token_chunk=16, vocab_chunk=96),
    "pallas_tpu": jaxhead.PallasTpuConfig(block_tokens=16, block_vocab=128),
    "pallas_triton": jaxhead.PallasTritonConfig(block_tokens=16, block_vocab=64, block_hidden=16,
                                                backward_vocab_chunk=128),
    "reference": None,
}


def _case(dtype):
    """``(hidden, weight [H, V], labels, keep, kw, g, e)``: a third of the rows not kept
    (compacted away: the bucket has padding rows), labels repeated across rows, per-token
    temperatures, soft-cap, every other row truncated to about 20 logits."""
    hidden, weight, labels = head_inputs(0, N, H, V, jnp.float32)
    rng = np.random.default_rng(0)
    labels = np.array(labels)
    labels[1::4] = labels[0]  # one token repeated on a quarter of the rows
    keep = rng.random(N) < 0.67
    temperature = rng.uniform(0.6, 1.4, N).astype(np.float32)
    z = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64)
    l = np.sort(SOFTCAP * np.tanh(z / SOFTCAP) / temperature[:, None], axis=-1)
    min_logit = np.where(np.arange(N) % 2 == 0, -np.inf, (l[:, -20] + l[:, -21]) / 2)
    kw = {"temperature": temperature, "softcap": SOFTCAP,
          "min_logit": min_logit.astype(np.float32)}
    g = (rng.standard_normal(N) / keep.sum()).astype(np.float32)
    e = (rng.standard_normal(N) / keep.sum()).astype(np.float32)
    return (hidden.astype(dtype), weight.astype(dtype), jnp.asarray(labels), jnp.asarray(keep),
            kw, g, e)


def _value_and_grads(impl, weight_layout, hidden, weight, labels, keep, kw, g, e):
    def loss(h, w):
        out = jaxhead.token_logprobs(h, w, labels, keep, impl=impl, config=CONFIGS[impl],
                                     weight_layout=weight_layout, **kw)
        return jnp.sum(g * out.logprobs) + jnp.sum(e * out.entropy), out

    with jaxhead.pallas_interpret():
        (_, out), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(hidden, weight)
    return out.logprobs, out.entropy, *grads


# float32 is slow-marked: test_vh_matches_the_float64_reference keeps float32 vh against
# float64 for every implementation, the bfloat16 case here vh against hv bit for bit
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_vh_with_the_transpose_equals_hv(impl, dtype):
    hidden, weight, labels, keep, kw, g, e = _case(jnp.dtype(dtype))
    hv = _value_and_grads(impl, "hv", hidden, weight, labels, keep, kw, g, e)
    vh = _value_and_grads(impl, "vh", hidden, weight.T, labels, keep, kw, g, e)
    assert vh[3].shape == (V, H) and vh[3].dtype == weight.dtype
    names = ("logprobs", "entropy", "dhidden", "dweight")
    for name, a, b in zip(names, hv, (*vh[:3], vh[3].T), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if dtype == "bfloat16":
            np.testing.assert_array_equal(b, a, err_msg=name)
        else:
            assert np.max(np.abs(b - a)) <= 1e-6 * np.max(np.abs(a)), (name, rel_err(b, a))
    assert np.all(np.asarray(vh[0])[~np.asarray(keep)] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_vh_matches_the_float64_reference(impl):
    hidden, weight, labels, keep, kw, g, e = _case(jnp.float32)
    logp, ent, dh, dw = _value_and_grads(impl, "vh", hidden, weight.T, labels, keep, kw, g, e)
    ref_lp, ref_ent = ref64(hidden, weight, labels, keep, **kw)
    np.testing.assert_allclose(logp, ref_lp, atol=2e-5, rtol=0)
    np.testing.assert_allclose(ent, ref_ent, atol=2e-5, rtol=1e-5)
    loss = weighted_loss(jaxhead.reference_token_logprobs, g, e, temperature=to64(
        kw["temperature"]), softcap=SOFTCAP, min_logit=to64(kw["min_logit"]),
        weight_layout="vh")
    dh64, dw64 = grads64(loss, hidden, weight.T, labels, keep)
    assert rel_err(dh, dh64) <= 1e-5 and rel_err(dw, dw64) <= 1e-5, (rel_err(dh, dh64),
                                                                      rel_err(dw, dw64))


def test_sharded_vh_matches_hv_on_one_device():
    results = run_case("tests.jaxhead.sharding_cases:weight_layout_case")
    # under jit an invalid kept label is NaN in the loss and in both gradients
    assert results.pop("invalid_label") == {"loss_nan": True, "dhidden_nan": True,
                                            "dweight_all_nan": True}
    assert set(results) == {"tokens", "vocab_parallel"}
    for name, r in results.items():
        for key in ("logprobs", "entropy", "dhidden", "dweight"):
            assert r[key] <= 1e-5, f"{name}: max |{key} vh - hv| = {r[key]:.3g}"
        assert r["dweight_shape"] == [2048, 64], (name, r)
    assert results["vocab_parallel"]["dweight_spec"] == "P('expert',)"  # split along V


def test_sharded_vh_checks_the_vocab_dimension():
    mesh = AbstractMesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    hidden = np.zeros((8, 4, 32), np.float32)
    labels = np.zeros((8, 4), np.int32)
    with pytest.raises(ValueError, match=r"vocab size 250 is not divisible by the 4 devices"):
        jaxhead.sharded_token_logprobs(hidden, np.zeros((250, 32), np.float32), labels,
                                       mesh=mesh, token_axes=("data",), vocab_axis="expert",
                                       weight_layout="vh")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("truncation", [{}, {"top_k": 20}, {"top_p": 0.9, "min_p": 0.01}],
                         ids=["chunked", "top_k", "top_p+min_p"])
def test_sample_draws_the_same_tokens_in_both_layouts(dtype, truncation):
    hidden, weight, _ = head_inputs(1, 64, H, V, jnp.dtype(dtype), peaked_fraction=0.0)
    key = jax.random.key(7)
    kw = {"temperature": 0.8, "softcap": SOFTCAP, "vocab_chunk": 96, **truncation}
    hv = jaxhead.sample(hidden, weight, key, **kw)
    vh = jaxhead.sample(hidden, weight.T, key, weight_layout="vh", **kw)
    np.testing.assert_array_equal(vh.tokens, hv.tokens)
    atol = 0 if dtype == "bfloat16" else 1e-5
    for name in ("logprobs", "min_logit", "logmass"):
        np.testing.assert_allclose(getattr(vh, name), getattr(hv, name), atol=atol, rtol=0,
                                   err_msg=name)


@pytest.mark.parametrize("bad", ["HV", "v h", None, 0])
def test_an_unknown_layout_is_named(bad):
    hidden, weight, labels = (np.zeros((4, 8), np.float32), np.zeros((8, 16), np.float32),
                              np.zeros(4, np.int32))
    mesh = AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,))
    match = rf"weight_layout must be 'hv' \(\[H, V\]\) or 'vh' .*got {bad!r}"
    calls = [
        lambda: jaxhead.token_logprobs(hidden, weight, labels, weight_layout=bad),
        lambda: jaxhead.reference_token_logprobs(hidden, weight, labels, weight_layout=bad),
        lambda: jaxhead.sharded_token_logprobs(hidden, weight, labels, mesh=mesh,
                                               token_axes=("data",), weight_layout=bad),
        lambda: jaxhead.sample(hidden, weight, jax.random.key(0), weight_layout=bad),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()


def test_sample_names_the_layout_of_a_mismatched_weight():
    hidden = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match=r"weight \[8, 16\] with weight_layout='vh' does not "
                       r"match hidden size 8 .*needs weight_layout='hv'"):
        jaxhead.sample(hidden, np.zeros((8, 16), np.float32), jax.random.key(0),
                       weight_layout="vh")


class _Tied(nnx.Module):
    def __init__(self, vocab, hidden, config=None):
        self.embed = nnx.Embed(vocab, hidden, rngs=nnx.Rngs(0))
        self.head = jaxhead.LMHead(hidden, vocab, tied_embedding=self.embed, config=config)


def test_tied_lm_head_reads_the_table_in_place():
    model = _Tied(V, H, CONFIGS["xla"])
    hidden, _, labels = head_inputs(2, N, H, V)
    keep = jnp.arange(N) % 3 != 0
    assert model.head.weight_layout == "vh"
    assert model.head.weight() is model.embed.embedding[...]

    def loss(model, transposed):
        if transposed:  # what LMHead did before: the head on the table transposed
            out = jaxhead.token_logprobs(hidden, model.embed.embedding[...].T, labels, keep,
                                         config=CONFIGS["xla"])
        else:
            out = model.head(hidden, labels, keep)
        return jnp.sum(out.logprobs) + 0.3 * jnp.sum(out.entropy)

    got = nnx.grad(lambda m: loss(m, False))(model).embed.embedding[...]
    want = nnx.grad(lambda m: loss(m, True))(model).embed.embedding[...]
    assert got.shape == (V, H)
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))
    np.testing.assert_allclose(model.head.logits(hidden),
                               hidden @ model.embed.embedding[...].T, rtol=1e-5, atol=1e-5)


def _tied_temporaries(transposed: bool) -> int:
    """Compiled temporaries of forward + backward of a tied Qwen3-0.6B head (float32 table
    ``[151936, 1024]``: 594 MiB) on 1024 tokens (``impl="auto"``: xla_cpu)."""
    vocab, hidden_size, n = 151936, 1024, 1024
    graphdef, state = nnx.split(nnx.eval_shape(lambda: _Tied(vocab, hidden_size)))

    def loss(state, hidden, labels):
        model = nnx.merge(graphdef, state)
        if transposed:
            out = jaxhead.token_logprobs(hidden, model.embed.embedding[...].T, labels)
        else:
            out = model.head(hidden, labels)
        return jnp.sum(out.logprobs) + jnp.sum(out.entropy)

    args = (state, jax.ShapeDtypeStruct((n, hidden_size), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_tied_lm_head_holds_no_transposed_copy_of_the_table():
    table = 151936 * 1024 * 4
    in_place, transposed = _tied_temporaries(False), _tied_temporaries(True)
    # measured (XLA:CPU, jax 0.10.2): 165 MiB in place, 743 MiB through the transpose
    assert in_place < table / 2, in_place / MIB
    assert transposed - in_place > 0.9 * table, (in_place / MIB, transposed / MIB)
