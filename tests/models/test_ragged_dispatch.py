"""Ragged expert dispatch (``models.moe.ragged``): on 8 CPU devices (emulated
``ragged_all_to_all``, in a subprocess) equal to the dense dispatch and to one device,
forward and gradients, float32, random and skewed routing; a capacity overflow in strict
mode gives NaN rows; the ``"auto"`` choice and the config checks."""

from __future__ import annotations

import pytest
from flax import nnx

from jaxhead.dispatch import target_platform
from models import get_config
from models.moe.api import REGISTRY
from models.moe.ragged import receive_rows
from models.transformer import Transformer, check_ops
from tests.support.multidevice import abstract_mesh, run_case

TOL = 1e-4


def test_ragged_equals_dense_and_one_device():
    r = run_case("tests.models.ragged_cases:equality_case")
    for routing in ("random", "skewed"):
        for key, d in r[routing].items():
            assert d["value"] <= TOL and d["grads"] <= TOL, (routing, key, d)
    assert r["factor2_random"]["value"] <= TOL, r["factor2_random"]
    assert r["factor2_random"]["grads"] <= TOL, r["factor2_random"]
    # all 128 tokens pick experts 5 and 4 (one device): 2x the balanced load holds the
    # first choices (expert 5) only, so every token lost one pair and, in strict mode, is
    # NaN, none silently different
    assert r["factor2_skewed_nan_rows"] == 128 and r["factor2_skewed_finite_rows"] == 0, r
    assert r["emulation_docstring_example"] == [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_auto_is_dense_on_cpu_and_names_bad_values():
    cpu = target_platform(abstract_mesh(expert=4))
    query = (cpu, None, "drop")  # (platform, capacity_factor, overflow)
    assert REGISTRY.resolve("auto", *query, platform=cpu).name == "dense"  # no ragged on CPU
    ragged = REGISTRY.resolve("ragged", *query, platform=cpu)
    assert ragged.name == "ragged" and ragged.plan["native"] is False  # the emulation
    with pytest.raises(ValueError, match="'sparse'"):
        REGISTRY.resolve("sparse")
    sparse = get_config("tiny-moe", expert_dispatch="sparse")  # checked where it is built
    with pytest.raises(ValueError, match="'sparse'"):
        nnx.eval_shape(lambda: Transformer(sparse, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="-1.0"):
        check_ops(get_config("tiny-moe", expert_capacity_factor=-1.0))
    check_ops(get_config("tiny-moe", expert_capacity_factor=1.5))


def test_receive_rows():
    assert receive_rows(16, 4, 2, 2, None) == 4 * 16 * 2  # worst case
    assert receive_rows(16, 4, 8, 2, None) == 4 * 16 * 2  # at most E_l pairs per token
    assert receive_rows(16, 4, 2, 2, 1.5) == 48  # 1.5 x the balanced 16 * 2
    assert receive_rows(16, 4, 2, 2, 100.0) == 4 * 16 * 2  # never above the worst case
