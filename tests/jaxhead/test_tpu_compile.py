"""The head compiled by the real TPU compiler for v4, v5e, v5p and v6e, without a TPU.

Needs ``libtpu`` (``pip install -e '.[train,test,tpu]'``); skipped without it. The helpers
(``harness/tpu_compile.py``) compile ``jax.grad`` of ``sum(logp) + sum(entropy)`` of
one head configuration for a topology of ``jax.experimental.topologies``; see there.

Default run (~4 min on 2 cores): every plan of the full grid (no compile: tiles and VMEM
limit within each generation's VMEM), the ``impl="auto"`` choices and fallbacks (lowered
only), and a representative set of compiles: each issue-14 failure (``pallas_tpu`` inside
``sharded_token_logprobs``; the Pallas head on v4 and on v5p float32), the
vocab-parallel XLA head with every option, and the Pallas head on a ``[V, H]`` weight
(``weight_layout="vh"``) on v6e and v5e.

Full grid (~80 compiles, over an hour on 2 cores): 4 generations x the 4 shapes of
``SHAPES`` (8192x4096x151936 bf16; 2056x5120x152064 bf16 soft-cap + per-token temperature;
1024x2048x32000 f32 per-token temperature; Qwen3-30B 4096x2048x151936 bf16 per-token
temperature + min_logit) x {xla, pallas_tpu} x {plain, sharded} plus the vocab-parallel
XLA head, all with entropy::

    JAXHEAD_TPU_COMPILE=full pytest -q tests/jaxhead/test_tpu_compile.py
"""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]') for the TPU compiler")

import jax
import jax.numpy as jnp

import jaxhead
from harness import tpu_compile as tc
from jaxhead._src.head import pallas_mode, pallas_tpu
from tests.jaxhead.pallas_cases import swap_head

FULL = os.environ.get("JAXHEAD_TPU_COMPILE", "") == "full"
MIB = tc.MIB


def _case(shape: str, impl: str, mode: str) -> tc.Case:
    return tc.Case(**tc.SHAPES[shape], impl=impl, mode=mode)


#: The default compiles: (generation, case), each guarding one issue-14 failure.
REPRESENTATIVE = [
    ("v6e", _case("qwen3-30b", "pallas_tpu", "sharded")),  # kernel out_shape in shard_map
    ("v4", _case("cap-temp", "pallas_tpu", "plain")),  # v4's 16 MiB of VMEM
    ("v5p", _case("f32-temp", "pallas_tpu", "plain")),  # v5p float32 dh overran its limit
    ("v5e", dataclasses.replace(_case("f32-temp", "xla", "vocab"), softcap=tc.SOFTCAP,
                                min_logit=True)),  # vocab-parallel, every option
    # a [V, H] weight (a tied embedding table): (C, H) blocks, [C, H] dW tiles
    ("v6e", dataclasses.replace(_case("qwen3-30b", "pallas_tpu", "plain"), weight_layout="vh")),
    ("v5e", dataclasses.replace(_case("cap-temp", "pallas_tpu", "plain"), weight_layout="vh")),
]
GRID = [(gen, case) for gen in tc.TOPOLOGIES for case in
        [_case(s, impl, mode) for s in tc.SHAPES for impl in ("xla", "pallas_tpu")
         for mode in ("plain", "sharded")] + [_case(s, "xla", "vocab") for s in tc.SHAPES]]
COMPILES = GRID if FULL else REPRESENTATIVE


@pytest.mark.parametrize("gen, case", COMPILES, ids=[f"{g}-{c.label}" for g, c in COMPILES])
def test_compiles(gen, case):
    row = tc.compile_case(case, tc.topology_devices(gen))
    assert "error" not in row, row["error"]
    # forward, dh, dW: every Mosaic kernel of pallas_tpu, none on the XLA path
    assert row["kernels"] == (3 if case.impl == "pallas_tpu" else 0)
    assert 0 < row["peak_mib"] < 16 * 1024  # fits the smallest HBM (v5e: 16 GiB)


#: What each generation's TensorCore has (pltpu.get_tpu_info, libtpu 0.0.52).
VMEM_MIB = {"v4": 16, "v5e": 128, "v5p": 64, "v6e": 128}


@pytest.mark.parametrize("gen", list(tc.TOPOLOGIES))
def test_plans_fit_each_generations_vmem(gen):
    mesh = tc.mesh_for(tc.topology_devices(gen), "plain")
    with jax.set_mesh(mesh):
        assert pallas_tpu.vmem_capacity() == VMEM_MIB[gen] * MIB
    with pallas_mode.per_device(mesh):  # sharded_token_logprobs' plan, no mesh set
        assert pallas_tpu.vmem_capacity() == VMEM_MIB[gen] * MIB
    for shape in tc.SHAPES:
        for mode in ("plain", "sharded"):
            plan, padded = tc.tpu_plan(_case(shape, "pallas_tpu", mode), mesh)
            need = pallas_tpu.vmem_bytes(plan.block_tokens, plan.block_vocab,
                                         plan.spec.hidden_size,
                                         jnp.dtype(plan.spec.dtype).itemsize)
            assert need <= plan.vmem_limit_bytes <= 0.9 * VMEM_MIB[gen] * MIB
            assert plan.block_vocab % 128 == 0 and padded % plan.block_tokens == 0


def _lowered_kernels(gen: str, hidden=256, vocab=1024, dtype=jnp.bfloat16, **kw) -> int:
    """tpu_custom_calls in ``token_logprobs`` (fwd + bwd) lowered for one chip of ``gen``."""
    mesh = tc.mesh_for(tc.topology_devices(gen), "plain")
    args = (jax.ShapeDtypeStruct((64, hidden), dtype),
            jax.ShapeDtypeStruct((hidden, vocab), dtype),
            jax.ShapeDtypeStruct((64,), jnp.int32))

    def loss(h, w, y):
        out = jaxhead.token_logprobs(h, w, y, **kw)
        return jnp.sum(out.logprobs) + jnp.sum(out.entropy)

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower()
    return lowered.as_text().count("@tpu_custom_call")


def test_auto_picks_the_kernel_for_a_tpu_mesh(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        assert _lowered_kernels("v5e") == 3
    assert "using 'xla'" not in caplog.text


def _patch_plan(monkeypatch, make_plan):
    swap_head(monkeypatch, "pallas_tpu", make_plan=make_plan)


def test_a_kernel_that_fails_to_plan_raises_under_auto(monkeypatch, caplog):
    """Only ``KernelUnsupported`` (and a refused lowering) is a reason to fall back: any
    other error planning the kernel is a failure to see, not to hide behind XLA."""
    def broken(config, spec):
        raise RuntimeError("no TPU info for this chip")

    _patch_plan(monkeypatch, broken)
    for impl in ("auto", "pallas_tpu"):
        with pytest.raises(RuntimeError, match="no TPU info"):
            _lowered_kernels("v6e", impl=impl)

    def refuses(config, spec):
        raise jaxhead.KernelUnsupported("no tile fits")

    _patch_plan(monkeypatch, refuses)
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        assert _lowered_kernels("v6e") == 0
    assert "pallas_tpu cannot run this call (no tile fits); using 'xla'" in caplog.text
    with jaxhead.dispatch.strict(), pytest.raises(jaxhead.KernelUnsupported,
                                                  match="strict.*no tile fits"):
        _lowered_kernels("v6e")


def test_auto_falls_back_when_the_kernel_does_not_lower(monkeypatch, caplog):
    def misaligned(config, spec):  # a vocab tile Mosaic refuses: not a multiple of 128
        plan, padded = pallas_tpu.make_plan(config, spec)
        return dataclasses.replace(plan, block_vocab=200), padded

    _patch_plan(monkeypatch, misaligned)
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        assert _lowered_kernels("v6e", hidden=128, vocab=1000) == 0
    assert "do not lower for this platform" in caplog.text


def test_kernels_refuse_an_auto_partitioned_mesh(caplog):
    mesh = tc.mesh_for(tc.topology_devices("v6e"), "sharded")  # 4 chips, no shard_map
    h = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((64,), jnp.int32)
    with jax.set_mesh(mesh), caplog.at_level(logging.WARNING, logger="jaxhead"):
        run = jax.jit(lambda h, w, y: jaxhead.token_logprobs(h, w, y).logprobs)
        assert "@tpu_custom_call" not in run.trace(h, w, y).lower().as_text()
        assert "cannot be partitioned over the 4 devices" in caplog.text
        with pytest.raises(jaxhead.KernelUnsupported, match="inside jax.shard_map"):
            jax.jit(lambda h, w, y: jaxhead.token_logprobs(h, w, y, impl="pallas_tpu")
                    .logprobs).trace(h, w, y)
