"""The expert-parallel MoE layer with ``jax.lax.ragged_all_to_all``, forward and backward,
compiled by the real TPU compiler for a v6e slice (expert=4), on a machine without a TPU;
on v5e, whose limited ICI routing the compiler's ragged all-to-all refuses, ``"auto"``
compiles the dense dispatch and an explicit ``"ragged"`` is refused by name.

Needs ``libtpu`` (``pip install -e '.[tpu]'``); skipped without it. XLA:CPU cannot run
the ragged all-to-all (``tests/models/test_ragged_dispatch.py`` checks the values through
its emulation); this checks that the native op and its transpose compile, that ``"auto"``
picks it for a TPU mesh, and that a capacity factor shrinks its per-device temporaries.

Not asserted: ragged below dense. For this layer alone (1024 tokens per chip, unsharded
abstract inputs) the TPU compiler reported 1.0 MiB of temporaries for the dense path and
16.7 MiB for the worst-case ragged one (libtpu 0.0.52); the whole train step's numbers
are in docs/scale-out.md (``benchmarks/memory.py --topology``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]') for the TPU compiler")

import logging

import jax
import jax.numpy as jnp

from harness import tpu_compile as tc
from jaxhead.dispatch import KernelUnsupported
from models.mesh import make_mesh
from models.moe.api import routed_experts

#: 1024 tokens per chip, E = 16 experts (4 per chip), top-4: the dense blocks hold
#: 4 x min(4, 4) = 16x the balanced load.
TOKENS, HIDDEN, MLP, EXPERTS, TOP_K = 4096, 512, 256, 16, 4


def _compile(dispatch: str, capacity_factor=None, generation: str = "v6e"):
    mesh = make_mesh({"expert": 4}, devices=tc.topology_devices(generation)[:4])
    bf16 = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((TOKENS, HIDDEN), bf16),
            jax.ShapeDtypeStruct((TOKENS, TOP_K), jnp.int32),
            jax.ShapeDtypeStruct((TOKENS, TOP_K), jnp.float32),
            jax.ShapeDtypeStruct((EXPERTS, HIDDEN, MLP), bf16),
            jax.ShapeDtypeStruct((EXPERTS, HIDDEN, MLP), bf16),
            jax.ShapeDtypeStruct((EXPERTS, MLP, HIDDEN), bf16))

    def loss(x, experts, weights, gate, up, down):
        y, _ = routed_experts(x, experts, weights, gate, up, down, mesh=mesh,
                                              dispatch=dispatch,
                                              capacity_factor=capacity_factor)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, (0, 3, 4, 5))).lower(*args)
        compiled = lowered.compile()
    return lowered.as_text(), compiled.memory_analysis().temp_size_in_bytes


def test_ragged_compiles_for_tpu_and_a_capacity_factor_shrinks_it():
    auto_text, auto_temp = _compile("auto")
    dense_text, _ = _compile("dense")
    _, capped_temp = _compile("ragged", capacity_factor=2.0)
    # forward: tokens out and results back; backward: their transposes and the
    # rematerialised forward
    assert auto_text.count("ragged_all_to_all") >= 4
    assert "ragged_all_to_all" not in dense_text
    assert capped_temp < auto_temp, (capped_temp, auto_temp)


def test_v5e_takes_the_dense_dispatch(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        text, _ = _compile("auto", generation="v5e")
    assert "ragged_all_to_all" not in text and "all_to_all" in text
    assert "no ragged all-to-all on TPU v5 lite" in caplog.text
    with pytest.raises(KernelUnsupported, match="TPU v5 lite chips"):
        _compile("ragged", generation="v5e")
