"""``harness/on_policy.py``, the workload of ``benchmarks/mismatch.py``: issue #41's
acceptance asks for the mismatch table "default vs routing replay vs invariant" with the
expert disagreement rate, so the workload records an MoE model's routes as the trainer's
rollouts do, the step reports its own ``expert_disagreement`` and can replay them."""

from __future__ import annotations

import numpy as np
import pytest

from harness import on_policy

SIZES = {"layers": 1, "prompts": 2, "group": 2, "new_tokens": 4, "row_len": 64}


@pytest.fixture(scope="module")
def moe_work():
    return on_policy.workload("tiny-moe", dtype="bfloat16", **SIZES)


def test_moe_gap_reports_the_steps_expert_disagreement(moe_work):
    """Every recorded (token, MoE layer, slot) route is compared: every prompt and
    completion token but each completion's last (drawn, never fed back)."""
    ro = moe_work.rollout
    g = on_policy.gap(moe_work)
    layers, k = ro.routes.shape[2:]
    fed = np.count_nonzero(moe_work.packed.segment_ids) - len(ro.lengths)
    assert g["routes"] == fed * layers * k > 0
    assert 0.0 <= g["expert_disagreement"] <= 1.0
    assert g["tokens"] == int(ro.lengths.sum())


# slow: tests/train/test_routing_replay.py::test_step_replays_the_samplers_routes keeps it
# (the same grpo_step with routing_replay: disagreement above 0.01 without, exactly 0 with)
@pytest.mark.slow
def test_routing_replay_takes_the_samplers_experts(moe_work):
    """With replay the trainer's forward takes every recorded route (disagreement 0), on
    the rollout the default mode scored (same tokens)."""
    default, replay = on_policy.gap(moe_work), on_policy.gap(moe_work, routing_replay=True)
    assert replay["expert_disagreement"] == 0.0
    assert replay["tokens"] == default["tokens"] and replay["routes"] == default["routes"]
    if default["expert_disagreement"] == 0.0:  # no flip: replaying its own routes is exact
        np.testing.assert_array_equal(replay["diff"], default["diff"])


# slow: every dense workload of tests/models/test_invariant_scan.py checks the same
@pytest.mark.slow
def test_dense_workload_has_no_router():
    work = on_policy.workload("tiny", dtype="bfloat16", **SIZES)
    g = on_policy.gap(work)
    assert g["expert_disagreement"] is None and g["routes"] == 0
    with pytest.raises(ValueError, match="dense"):
        on_policy.gap(work, routing_replay=True)
