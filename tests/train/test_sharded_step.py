"""The GRPO train step under a data=2 x expert=4 mesh (8 CPU devices, in a subprocess)
equals the single-device step, on one batch and accumulated over two micro-batches:
metrics (the MoE's dropped fraction among them), updated parameters and Adam moments;
parameters and moments keep their expert-sharded layout."""

from __future__ import annotations

import pytest

from tests.support.multidevice import run_case

TOL = 1e-4


# slow: by default the step on a mesh equals one device's in test_invariant_mesh.py (fsdp x
# expert, bit for bit), test_kv_replication.py (fsdp x tensor, dense and MoE),
# test_context_parallel.py (context) and test_distributed.py (two processes)
@pytest.mark.slow
def test_grpo_step_on_mesh_matches_single_device():
    r = run_case("tests.train.sharding_cases:grpo_step_case")
    for key, diff in r["metrics"].items():
        assert diff <= TOL * max(1.0, abs(r["values"][key])), (key, diff, r["values"][key])
    assert r["params"] <= TOL and r["moments"] <= TOL, r
    assert r["param_change"] > 1e-3  # the update did move the parameters
    assert r["values"]["kl"] >= 0 and r["values"]["loss"] != 0
    assert r["values"]["moe_dropped_fraction"] == 0  # the MoE's metric; dropless here
    assert r["rows"] % 8 == 0 and r["buckets"][1] <= r["buckets"][0]
    # two micro-batches accumulated on the mesh as on one device
    for key, diff in r["micro_metrics"].items():
        assert diff <= TOL * max(1.0, abs(r["micro_values"][key])), key
    assert r["micro_params"] <= TOL
    assert r["param_specs_kept"]
    assert r["gate_shard"][0] == 8 // 4  # 8 experts over expert=4
    assert r["gate_moment_shard"] and all(s[0] == 2 for s in r["gate_moment_shard"])
