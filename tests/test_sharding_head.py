"""The head under a mesh (8 CPU devices, data=2 x expert=4, in a subprocess): token-split
with per-shard compaction, and vocab-parallel, against ``jaxhead.token_logprobs`` on one
device: log-probs, entropy and both gradients."""

from __future__ import annotations

from multidevice import run_case
from sharding_cases import HEAD_CONFIGS

TOL = 1e-5


def test_sharded_head_matches_single_device():
    results = run_case("sharding_cases:head_case")
    assert set(results) == set(HEAD_CONFIGS)
    for name, r in results.items():
        for key in ("logprobs", "entropy", "dhidden", "dweight", "dhidden_rel", "dweight_rel"):
            assert r[key] <= TOL, f"{name}: max |{key} - single device| = {r[key]:.3g} > {TOL}"
        # every shard compacted into one bucket smaller than its token count
        assert r["bucket"] < r["tokens_per_shard"], (name, r)
    assert results["tokens"]["out_spec"] == "P(('data', 'expert'),)"
    assert results["vocab_parallel"]["out_spec"] == "P('data',)"
