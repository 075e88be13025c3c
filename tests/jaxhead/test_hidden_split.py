"""``token_logprobs(weight_hidden_axes=...)``: a head weight whose hidden dimension is split
over devices (FSDP's layout), each vocab chunk all-gathered where it is used.

``jax.vmap`` with an axis name stands in for the mesh axis (its collectives are
``shard_map``'s: ``all_gather`` and ``psum_scatter`` over the mapped axis): each of
``DEVICES`` "devices" holds ``H / DEVICES`` of the weight's hidden dimension and every
token. Log-probs and entropy are
the whole-weight head's bit for bit (the same ``[T, H] @ [H, C]`` tiles), and both loop
orders are the same bits. The gradients need ``jax.shard_map`` (a custom VJP's backward
does not see a ``vmap`` axis name): on 4 CPU devices in a subprocess, against the float64
reference, the split weight's gradient split like it. A real 8-device mesh runs it under ``numerics="invariant"``
(``tests/models/test_invariant_mesh.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from harness.oracle import head_inputs, ref64
from tests.support.multidevice import run_case

N, H, V = 40, 48, 300  # a ragged last vocab chunk; H splits over 4 devices, 12 rows each
DEVICES = 4
CONFIG = jaxhead.XlaConfig(token_chunk=16, vocab_chunk=96)


def _inputs(dtype, layout):
    hidden, weight, labels = head_inputs(0, N, H, V, dtype)
    keep = jnp.asarray(np.random.default_rng(1).random(N) < 0.7)
    temperature = jnp.asarray(np.random.default_rng(2).uniform(0.6, 1.3, N), jnp.float32)
    min_logit = jnp.where(jnp.arange(N) % 3 == 0, -1.0, -jnp.inf)  # some rows truncated
    labels = labels.at[:4].set(labels[0])  # repeated labels
    if layout == "vh":
        weight = weight.T
    return hidden, weight, labels, keep, temperature, min_logit


def _split(weight, layout):
    """``[N, H / N, V]`` (``"hv"``) or ``[N, V, H / N]`` (``"vh"``): each device's rows."""
    axis = 0 if layout == "hv" else 1
    return jnp.stack(jnp.split(weight, DEVICES, axis=axis))


def _split_head(hidden, weight, labels, keep, temperature, min_logit, layout, impl="xla",
                config=CONFIG):
    def one(w):
        out = jaxhead.token_logprobs(
            hidden, w, labels, keep, temperature=temperature, min_logit=min_logit,
            softcap=20.0, impl=impl, config=config, weight_layout=layout, bucket=32,
            weight_hidden_axes="fsdp")
        return out.logprobs, out.entropy

    logp, ent = jax.vmap(one, axis_name="fsdp")(_split(weight, layout))
    return logp, ent


# by default each dtype once and each layout once; the other two pairings in the slow set
@pytest.mark.parametrize("dtype, layout", [
    (jnp.float32, "vh"), (jnp.bfloat16, "hv"),
    pytest.param(jnp.float32, "hv", marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, "vh", marks=pytest.mark.slow)])
def test_split_weight_gives_the_whole_weights_bits(dtype, layout):
    hidden, weight, labels, keep, temperature, min_logit = _inputs(dtype, layout)
    logp, ent = jax.jit(_split_head, static_argnums=(6,))(
        hidden, weight, labels, keep, temperature, min_logit, layout)
    for device in range(1, DEVICES):  # every device computes every token
        np.testing.assert_array_equal(logp[device], logp[0])
    outer = jaxhead.XlaConfig(token_chunk=16, vocab_chunk=96, vocab_outer=True)
    for config in (outer, CONFIG):  # one device, each loop order
        whole = jax.jit(lambda *a, config=config: jaxhead.token_logprobs(
            *a[:4], temperature=a[4], min_logit=a[5], softcap=20.0, impl="xla",
            config=config, weight_layout=layout, bucket=32))(
            hidden, weight, labels, keep, temperature, min_logit)
        np.testing.assert_array_equal(logp[0], whole.logprobs)
        np.testing.assert_array_equal(ent[0], whole.entropy)
    w64 = weight if layout == "hv" else weight.T
    want_logp, want_ent = ref64(hidden, w64, labels, keep, temperature=temperature,
                                softcap=20.0, min_logit=min_logit)
    tol = 1e-5 if dtype == jnp.float32 else 1e-4  # the bf16 inputs are the reference's too
    np.testing.assert_allclose(logp[0], want_logp, atol=tol * 30)
    np.testing.assert_allclose(ent[0], want_ent, atol=tol * 30)


def test_split_weight_gradients_match_float64():
    """Both gradients against float64 autodiff of the full-logits head, on 4 devices each
    with its own tokens and ``H / 4`` rows of the weight (``hidden_split_cases``): the
    weight's gradient comes back split like the weight, summed over every device's
    tokens; fused and two-pass backward, both layouts, ``xla``, ``xla_cpu`` and
    ``reference``."""
    results = run_case("tests.jaxhead.hidden_split_cases:gradient_case", DEVICES)
    # an invalid kept label on one device: NaN in every device's part of dW (jaxhead's
    # rule: both gradients NaN, never a silently wrong step)
    invalid = results.pop("invalid_label")
    assert invalid == {"dweight_parts_all_nan": [True] * DEVICES, "dhidden_nan": True}
    assert len(results) == 10
    for name, r in results.items():
        assert r["dhidden"] < 1e-5 and r["dweight"] < 1e-5, (name, r)
        want = "P('fsdp',)" if name.endswith("hv") else "P(None, 'fsdp')"
        assert r["dweight_spec"] == want, (name, r)
        # the chunks (96 columns, the ragged 12 last), never the whole [48, 300] weight;
        # the reference implementation gathers it whole
        chunks = {"[48,96]", "[48,12]"} if name.endswith("hv") else {"[96,48]", "[12,48]"}
        whole = "[48,300]" if name.endswith("hv") else "[300,48]"
        if name.startswith("reference"):
            assert whole in r["gathered"], (name, r)
        else:
            assert set(r["gathered"]) == chunks, (name, r)


def test_hidden_axes_outside_shard_map_or_named_twice_are_refused():
    hidden, weight, labels, *_ = _inputs(jnp.float32, "hv")
    with pytest.raises(ValueError, match=r"weight_hidden_axes=\('fsdp',\): 'fsdp' is not a "
                                         r"manual mesh axis"):
        jaxhead.token_logprobs(hidden, weight, labels, weight_hidden_axes="fsdp")
    with pytest.raises(ValueError, match=r"\('fsdp', 'fsdp'\) names an axis twice"):
        jaxhead.sample(hidden, weight, jax.random.key(0),
                       weight_hidden_axes=("fsdp", "fsdp"))


def test_a_weight_of_the_wrong_part_size_is_named():
    hidden, _, labels, *_ = _inputs(jnp.float32, "hv")

    def one(w):
        return jaxhead.token_logprobs(hidden, w, labels, weight_hidden_axes="fsdp").logprobs

    with pytest.raises(ValueError, match=r"split over 4 devices .* H / 4 = 12 of its hidden"):
        jax.vmap(one, axis_name="fsdp")(jnp.zeros((DEVICES, 10, V)))


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_triton"])
def test_kernels_refuse_a_split_weight(impl):
    hidden, weight, labels, *_ = _inputs(jnp.float32, "hv")

    def one(w):
        with jaxhead.pallas_interpret():
            return jaxhead.token_logprobs(hidden, w, labels, impl=impl,
                                          weight_hidden_axes="fsdp").logprobs

    with pytest.raises(jaxhead.KernelUnsupported, match="no hidden-split one"):
        jax.vmap(one, axis_name="fsdp")(_split(weight, "hv"))
