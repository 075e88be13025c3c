"""The Mosaic TPU kernels (``impl="pallas_tpu"``) in the TPU interpreter on CPU, against
the XLA path; their lowering to Mosaic at the production shape; their config errors."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import jaxhead
from jaxhead._src.head import pallas_mode, pallas_tpu
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

try:  # the interpreter's race-detection state is private; skip only what reads it
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _races
except ImportError:  # pragma: no cover - a jax that moved it
    _races = None
needs_race_state = pytest.mark.skipif(
    not hasattr(_races, "races"), reason="this jax does not expose the TPU race detector state"
)

BLOCKS = jaxhead.PallasTpuConfig(block_tokens=32, block_vocab=256)


def kernel_head(case: Case, mode: str = "interpret", config=BLOCKS):
    return head_fn("pallas_tpu", case, config, mode=mode)


def spec(rows, hidden, vocab, dtype, softcap=None):
    return HeadSpec(rows, hidden, vocab, jnp.dtype(dtype).name, softcap, True)


@functools.cache
def kernel_results(case: Case):
    return results(kernel_head(case), *inputs(case))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_xla_path(case):
    assert_matches(kernel_results(case), oracle_results(case), case.dtype)


@needs_race_state
def test_no_races_with_two_simulated_cores():
    case = CASES[0]
    _races.reset_tpu_interpret_mode_state()
    got = results(kernel_head(case, mode="races"), *inputs(case))
    assert _races.races is not None and not _races.races.races_found
    assert_matches(got, oracle_results(case), case.dtype)


@needs_race_state
def test_race_detector_is_live():
    """Two cores writing one output block must be reported, or the test above proves
    nothing."""

    def racy(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.ones((16, 128), jnp.float32)
    _races.reset_tpu_interpret_mode_state()
    pl.pallas_call(
        racy,
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2),
    )(x).block_until_ready()
    assert _races.races.races_found


def test_label_outside_vocab_gives_nan():
    case = Case(32, 300, "float32")
    h, w, labels, temperature, _, _ = inputs(case)
    labels = labels.at[3].set(300).at[5].set(-1)
    logp, ent = jax.jit(kernel_head(case))(h, w, labels, temperature)
    bad = np.zeros(32, bool)
    bad[[3, 5]] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(logp)), bad)
    chex.assert_tree_all_finite(ent)


def test_a_wrong_result_fails_the_check():
    """The comparison is sharp enough to see a soft-cap that was not applied."""
    case = CASES[0]
    got = kernel_results(case)
    want = oracle_results(dataclasses.replace(case, softcap=None))
    assert max(max_errors(got, want).values()) > 100 * TOL[jnp.dtype(case.dtype)]
    with pytest.raises(AssertionError):
        assert_matches(got, want, case.dtype)


def test_token_logprobs_with_keep_mask():
    assert_token_logprobs_match("pallas_tpu", jnp.float32, jaxhead.PallasTpuConfig(16, 256))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_lowers_to_mosaic_at_production_shape(dtype):
    """N=16384, H=4096, V=151936 (Qwen3): the default tiles lower to a Mosaic kernel
    (forward and both backward kernels) without a TPU."""
    with pallas_mode.interpret():
        cfg, padded = pallas_tpu.make_plan(None, spec(16384, 4096, 151936, dtype, 30.0))
    cfg = dataclasses.replace(cfg, interpret=None)
    assert padded == 16384 and cfg.vmem_limit_bytes <= 0.9 * 64 * 2**20

    def grads(h, w, y, temperature):
        def loss(h, w):
            logp, ent = pallas_tpu.chunked_head(cfg, h, w, y, temperature,
                                                jnp.full_like(temperature, -jnp.inf))
            return jnp.sum(logp) + jnp.sum(ent)

        return jax.grad(loss, (0, 1))(h, w)

    args = (
        jax.ShapeDtypeStruct((16384, 4096), dtype), jax.ShapeDtypeStruct((4096, 151936), dtype),
        jax.ShapeDtypeStruct((16384,), jnp.int32), jax.ShapeDtypeStruct((16384,), jnp.float32),
    )
    text = jax.jit(grads).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 3


def test_config_errors():
    with pytest.raises(jaxhead.KernelUnsupported, match="JAXHEAD_PALLAS_INTERPRET"):
        pallas_tpu.make_plan(None, spec(8, 128, 256, jnp.float32))
    with pallas_mode.interpret():
        with pytest.raises(jaxhead.KernelUnsupported, match="float16"):
            pallas_tpu.make_plan(None, spec(8, 128, 256, jnp.float16))
        with pytest.raises(ValueError, match="block_tokens"):
            pallas_tpu.make_plan(jaxhead.PallasTpuConfig(8, 256), spec(8, 128, 256, jnp.bfloat16))
        with pytest.raises(ValueError, match="block_vocab"):
            pallas_tpu.make_plan(jaxhead.PallasTpuConfig(8, 200), spec(8, 128, 256, jnp.float32))
        with pytest.raises(jaxhead.KernelUnsupported, match="VMEM"):
            pallas_tpu.make_plan(None, spec(8, 2**22, 256, jnp.float32))
        with pytest.raises(jaxhead.KernelUnsupported, match="VMEM"):
            pallas_tpu.make_plan(jaxhead.PallasTpuConfig(2048, 2048),
                                 spec(4096, 8192, 2**16, jnp.float32))
        vocab_parallel = dataclasses.replace(spec(8, 128, 256, jnp.float32), vocab_axis="v",
                                             vocab_shards=2)
        with pytest.raises(jaxhead.KernelUnsupported, match="vocab-parallel"):
            pallas_tpu.make_plan(None, vocab_parallel)


def test_rows_are_fitted_to_the_tiles():
    with pallas_mode.interpret():
        cfg, padded = pallas_tpu.make_plan(jaxhead.PallasTpuConfig(512, 512),
                                           spec(600, 128, 1000, jnp.bfloat16))
        assert (cfg.block_tokens, padded) == (304, 608)
        cfg, padded = pallas_tpu.make_plan(None, spec(0, 128, 100, jnp.float32))
        assert padded == 0 and cfg.block_vocab == 100
