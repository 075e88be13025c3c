"""Two CPU processes x 2 devices joined by ``jax.distributed`` on localhost run the tiny
MoE step (decoder, expert all-to-all, sharded head, gradients) with exactly the numbers
of one process x 4 devices, after agreeing on the head bucket with a collective."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.multidevice import run_case, run_multiprocess


# slow: by default tests/train/test_distributed.py trains in two processes against one, and
# tests/train/test_sharded_rollout.py rolls out in two
@pytest.mark.slow
def test_two_processes_match_one_process():
    one = run_case("tests.models.sharding_cases:distributed_forward_case", devices=4)
    two = run_multiprocess("tests.models.sharding_cases:distributed_forward_case", processes=2,
                           devices_per_process=2)
    assert one["processes"] == 1 and [t["processes"] for t in two] == [2, 2]
    assert one["devices"] == 4 and [t["devices"] for t in two] == [4, 4]
    # process 0 alone would pick a smaller bucket; the collective makes both use the max
    assert two[0]["own_bucket"] < two[1]["own_bucket"]
    assert two[0]["bucket"] == two[1]["bucket"] == one["bucket"] == two[1]["own_bucket"]
    for t in two:
        for key in ("loss", "aux"):
            assert abs(t[key] - one[key]) <= 1e-6, key
        for key in ("logprobs", "entropy", "hidden_sum"):
            np.testing.assert_allclose(t[key], one[key], rtol=0, atol=1e-5, err_msg=key)
        for path, norm in one["grad_norms"].items():
            assert abs(t["grad_norms"][path] - norm) <= 1e-5 * max(norm, 1.0), path
