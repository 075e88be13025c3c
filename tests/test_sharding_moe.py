"""Expert-parallel Qwen3-MoE (8 CPU devices, in a subprocess): forward, head, loss and
gradients equal one device; the compiled step moves tokens with all-to-all and never
all-gathers the full expert weights; each device holds 1/expert of the experts."""

from __future__ import annotations

from multidevice import run_case

TOL = 1e-4


def test_moe_expert_parallel_matches_single_device():
    r = run_case("sharding_cases:moe_case")
    for key in ("loss", "hidden", "logprobs", "entropy", "aux", "grads"):
        assert r[key] <= TOL, f"max |{key} - single device| = {r[key]:.3g} > {TOL}"
    assert r["grad_leaves"] == 27  # every parameter's gradient was compared
    for key, value in r["fsdp_tensor_forward"].items():
        assert value <= TOL, f"fsdp x expert x tensor: {key} differs by {value:.3g}"

    c = r["collectives"]
    # forward: 3 per MoE layer (tokens out, counts, results back); backward: 2 per layer
    assert c["all_to_all"] == 10, c
    assert c["full_expert_gathers"] == [], c

    local = r["num_experts"] // r["expert_axis"]
    assert len(r["expert_shards"]) == 6  # gate/up/down of both MoE layers
    for path, s in r["expert_shards"].items():
        assert s["global"][0] == r["num_experts"], path
        assert s["shard"] == [local, *s["global"][1:]], (path, s)
        assert s["addressable"] == [[local, *s["global"][1:]]], (path, s)
