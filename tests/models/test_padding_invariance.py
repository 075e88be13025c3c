"""Padding invariance, float32: adding padding rows, or padding tokens at the end of
rows, changes no real token's log-prob, entropy, GRPO loss (the trainer's, with KL,
entropy bonus and the MoE aux loss) or any parameter gradient, and padding positions get
log-prob 0. A tied model with a dense and an MoE layer expert-parallel on 8 CPU devices
(ragged dispatch with a capacity factor the real tokens fit) and, slow, on one device;
the tiny MoE with the dense dispatch (slow). And each dispatch path of the experts alone
(one device, dense, ragged with a capacity factor) leaves padding out (no output, no
gradient) and equals one device on the real tokens."""

from __future__ import annotations

import pytest

from tests.models.padding_cases import MIXED, invariance
from tests.support.multidevice import run_case

#: ``padding_cases.scaled_error`` bound (measured: log-probs 9.5e-7 absolute at |logp|
#: near 8, i.e. 1.2e-7 scaled, gradients 1e-7; one device 0 but for 1e-7 on gradients).
TOL = 1e-6


def _assert_invariant(r):
    for name in ("rows", "tokens"):
        for key in ("logp", "entropy", "loss", "grads"):
            assert r[name][key] <= TOL, (name, key, r[name])
        assert r[name]["padding_logp"] == 0, (name, r[name])
    assert r["kept"] > 0 and r["loss"] != 0, r
    assert set(r["dropped"].values()) == {0.0}, r  # the real tokens fit: no drop anywhere


def test_padding_changes_nothing_expert_parallel_with_a_capacity_factor():
    _assert_invariant(run_case("tests.models.padding_cases:ragged_case"))


@pytest.mark.slow
def test_padding_changes_nothing_on_one_device():
    _assert_invariant(invariance("tiny", **MIXED))


@pytest.mark.slow
def test_padding_changes_nothing_expert_parallel_dense_dispatch():
    _assert_invariant(run_case("tests.models.padding_cases:dense_case"))


def test_every_dispatch_path_leaves_padding_out():
    r = run_case("tests.models.padding_cases:layer_case")
    for name, d in r.items():
        for key in ("value", "x_grad", "weight_grad", "param_grads"):
            assert d[key] <= 1e-5, (name, key, d)
        assert d["padding_out"] == 0 and d["padding_x_grad"] == 0, (name, d)
        assert d["padding_weight_grad"] == 0 and d["dropped"] == 0, (name, d)
