"""Expert-parallel Qwen3-MoE (8 CPU devices, in a subprocess): forward, head, loss and
gradients equal one device; the compiled step moves tokens with all-to-all and never
all-gathers the full expert weights; each device holds 1/expert of the experts."""

from __future__ import annotations

import pytest

from tests.support.multidevice import run_case

TOL = 1e-4


# slow: by default test_invariant_mesh.py's MoE case compares the expert-sharded model with
# one device (its trainer and sampler, bit for bit) and test_padding_invariance.py the
# expert-parallel forward with a capacity factor
@pytest.mark.slow
def test_moe_expert_parallel_matches_single_device():
    r = run_case("tests.models.sharding_cases:moe_case")
    for key in ("loss", "hidden", "logprobs", "entropy", "aux", "grads"):
        assert r[key] <= TOL, f"max |{key} - single device| = {r[key]:.3g} > {TOL}"
    assert r["grad_leaves"] == 27  # every parameter's gradient was compared
    for key, value in r["fsdp_tensor_forward"].items():
        assert value <= TOL, f"fsdp x expert x tensor: {key} differs by {value:.3g}"

    rounds = r["rounds"]  # the tokens of a device sent in several all-to-all rounds
    assert rounds["rounds"] == 4 and rounds["value"] <= TOL and rounds["grads"] <= TOL, rounds

    c = r["collectives"]
    # per MoE layer, forward: 3 (tokens out, counts, results back); the backward adds the
    # transposes and the rematerialised dispatch (XLA may merge the repeated counts one)
    assert 2 * 3 < c["all_to_all"] <= 2 * 8, c
    assert c["full_expert_gathers"] == [], c

    local = r["num_experts"] // r["expert_axis"]
    assert len(r["expert_shards"]) == 6  # gate/up/down of both MoE layers
    for path, s in r["expert_shards"].items():
        assert s["global"][0] == r["num_experts"], path
        assert s["shard"] == [local, *s["global"][1:]], (path, s)
        assert s["addressable"] == [[local, *s["global"][1:]]], (path, s)
