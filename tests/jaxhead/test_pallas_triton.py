"""The Triton GPU kernels (``impl="pallas_triton"``) in Pallas interpret mode on CPU,
against the XLA path; their lowering to Triton at the production shape; config errors."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from jaxhead._src.head import pallas_mode, pallas_triton
from jaxhead._src.head.base import HeadSpec
from tests.jaxhead.pallas_cases import (
    CASES,
    TOL,
    Case,
    assert_matches,
    assert_token_logprobs_match,
    head_fn,
    inputs,
    max_errors,
    oracle_results,
    results,
)

# Two vocab ranges per token tile in the forward, backward chunks of 512 columns (two
# chunks and a 488-column tail for V = 1000), K = 64: two steps over H = 128.
BLOCKS = jaxhead.PallasTritonConfig(
    block_tokens=32, block_vocab=256, block_hidden=64, num_warps=4, num_stages=2,
    vocab_splits=2, backward_vocab_chunk=512,
)


def kernel_head(case: Case, config=BLOCKS, hidden=128):
    return head_fn("pallas_triton", case, config, hidden)


def spec(rows, hidden, vocab, dtype, softcap=None):
    return HeadSpec(rows, hidden, vocab, jnp.dtype(dtype).name, softcap, True)


@functools.cache
def kernel_results(case: Case):
    return results(kernel_head(case), *inputs(case))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_xla_path(case):
    assert_matches(kernel_results(case), oracle_results(case), case.dtype)


def test_a_wrong_result_fails_the_check():
    """The comparison is sharp enough to see a soft-cap that was not applied."""
    case = CASES[0]
    got = kernel_results(case)
    want = oracle_results(dataclasses.replace(case, softcap=None))
    assert max(max_errors(got, want).values()) > 100 * TOL[jnp.dtype(case.dtype)]
    with pytest.raises(AssertionError):
        assert_matches(got, want, case.dtype)


def test_hidden_not_a_multiple_of_the_step():
    """H = 100 with K = 64: the second hidden step is masked on both operands."""
    case = Case(40, 300, "float32", softcap=5.0, seed=5)
    h, w, labels, temperature, g, e = inputs(case)
    h, w = h[:, :100], w[:100]
    oracle = head_fn("xla", case, jaxhead.XlaConfig(token_chunk=40, vocab_chunk=128), 100)
    got = results(kernel_head(case, hidden=100), h, w, labels, temperature, g, e)
    want = results(oracle, h, w, labels, temperature, g, e)
    assert_matches(got, want, case.dtype)


def test_label_outside_vocab_gives_nan():
    case = Case(32, 300, "float32")
    h, w, labels, temperature, _, _ = inputs(case)
    labels = labels.at[3].set(300).at[5].set(-1)
    logp, ent = jax.jit(kernel_head(case))(h, w, labels, temperature)
    bad = np.zeros(32, bool)
    bad[[3, 5]] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(logp)), bad)
    chex.assert_tree_all_finite(ent)


def test_token_logprobs_with_keep_mask():
    blocks = dataclasses.replace(BLOCKS, block_tokens=16)
    assert_token_logprobs_match("pallas_triton", jnp.bfloat16, blocks)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_lowers_to_triton_at_production_shape(dtype):
    """N=16384, H=4096, V=151936 (Qwen3): the default tiles lower to Triton kernels
    (forward, and the backward du kernel for the full chunks and the tail) without a GPU."""
    with pallas_mode.interpret():
        cfg, padded = pallas_triton.make_plan(None, spec(16384, 4096, 151936, dtype, 30.0))
    cfg = dataclasses.replace(cfg, interpret=None)
    assert padded == 16384

    def grads(h, w, y, temperature):
        def loss(h, w):
            logp, ent = pallas_triton.chunked_head(cfg, h, w, y, temperature,
                                                   jnp.full_like(temperature, -jnp.inf))
            return jnp.sum(logp) + jnp.sum(ent)

        return jax.grad(loss, (0, 1))(h, w)

    args = (
        jax.ShapeDtypeStruct((16384, 4096), dtype), jax.ShapeDtypeStruct((4096, 151936), dtype),
        jax.ShapeDtypeStruct((16384,), jnp.int32), jax.ShapeDtypeStruct((16384,), jnp.float32),
    )
    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3


def test_config_resolution():
    with pallas_mode.interpret():
        cfg, padded = pallas_triton.make_plan(None, spec(3000, 4096, 151936, jnp.bfloat16))
    b = cfg.blocks
    assert padded == 3008 and (b.block_tokens, b.block_vocab, b.block_hidden) == (64, 256, 64)
    assert b.vocab_splits == 22  # ceil(1024 / 47 token tiles), no empty range over 594 tiles
    assert b.backward_vocab_chunk % b.block_vocab == 0
    assert padded * b.backward_vocab_chunk * 2 <= 256 * 2**20
    with pallas_mode.interpret():  # a soft-cap halves the vocab tile (register pressure)
        cfg, _ = pallas_triton.make_plan(None, spec(3000, 4096, 151936, jnp.bfloat16, 30.0))
    assert cfg.blocks.block_vocab == 128
    with pallas_mode.interpret():
        cfg, padded = pallas_triton.make_plan(None, spec(5, 20, 100, jnp.float32))
    b = cfg.blocks
    assert padded == 16 and (b.block_tokens, b.block_vocab, b.block_hidden) == (16, 128, 32)
    assert b.backward_vocab_chunk == 128 and b.vocab_splits == 1


def test_config_errors():
    with pytest.raises(jaxhead.KernelUnsupported, match="JAXHEAD_PALLAS_INTERPRET"):
        pallas_triton.make_plan(None, spec(8, 128, 256, jnp.float32))
    with pallas_mode.interpret():
        with pytest.raises(jaxhead.KernelUnsupported, match="int8"):
            pallas_triton.make_plan(None, spec(8, 128, 256, jnp.int8))
        with pytest.raises(ValueError, match="block_vocab"):
            pallas_triton.make_plan(dataclasses.replace(BLOCKS, block_vocab=96),
                                    spec(8, 128, 256, jnp.float32))
        with pytest.raises(ValueError, match="backward_vocab_chunk"):
            pallas_triton.make_plan(dataclasses.replace(BLOCKS, backward_vocab_chunk=300),
                                    spec(8, 128, 2048, jnp.float32))
        with pytest.raises(ValueError, match="num_warps"):
            pallas_triton.make_plan(dataclasses.replace(BLOCKS, num_warps=0),
                                    spec(8, 128, 256, jnp.float32))
    with pytest.raises(TypeError, match="PallasTritonConfig"):
        jaxhead.token_logprobs(jnp.ones((2, 8)), jnp.ones((8, 16)), jnp.zeros(2, jnp.int32),
                               impl="pallas_triton", config=jaxhead.XlaConfig())
