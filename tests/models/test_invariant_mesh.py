"""``ModelConfig.numerics = "invariant"`` on an 8-device CPU mesh (issue #41's acceptance:
"on one device and on an 8-device mesh (fsdp x expert, and with context > 1 for the
trainer's side)"): the sampler's log-probs of G = 2 completions of uneven prompts equal
the trainer's (packed rows, two micro-batches, a bucket per shard) bit for bit,
``np.array_equal``:

* float32, the ``compact`` engine, sampled, rows over data=2 x fsdp=2 x expert=2 (in the
  ``slow`` set: by default the MoE preset's bf16 case below runs the compact engine on
  the same mesh);
* the same in bf16 for the ``tiny-moe`` preset, its experts sharded over ``expert``;
* bf16, the ``reference`` engine, truncated draws (top-k, top-p and min-p), rows over
  fsdp=2 x expert=2 and the trainer's rows split over context=2 (in the ``slow`` set with
  the context step below: one device's truncated draws are the trainer's by default in
  test_invariant_numerics.py, the context-parallel step one device's in
  test_context_parallel.py);

and both equal what one device computes in the same process (the results do not depend
on the device count); the trainer's GRPO step on the context mesh gives one device's
log-probs bit for bit and its gradients to float rounding. The invariant MoE block keeps
expert parallelism: with its experts sharded over expert = 8, 4 and 2 (and tokens over
context) it gives one device's output bit for bit and never all-gathers a whole expert
tensor.

The subprocess compiles with LLVM's optimisation on (not ``CASE_FLAGS``): with
``--xla_backend_optimization_level=0`` XLA:CPU's tiles are not batch-invariant even on
one device (docs/numerics.md).
"""

from __future__ import annotations

import functools

import pytest

from tests.support.multidevice import run_case


@functools.cache
def _result(case: str) -> dict:
    """One case of ``tests.models.invariant_mesh_cases`` in its own 8-device process."""
    return run_case(f"tests.models.invariant_mesh_cases:{case}", 8,
                    XLA_FLAGS="--xla_force_host_platform_device_count=8")


@functools.cache
def _moe_result() -> dict:
    return run_case("tests.models.invariant_mesh_cases:moe_block_case", 8,
                    XLA_FLAGS="--xla_force_host_platform_device_count=8")


@pytest.mark.parametrize("name", [
    # the dense float32 case: by default the MoE preset's bf16 case runs the same engine
    # on the same mesh, the dense model the context mesh
    pytest.param("fsdp_expert", marks=pytest.mark.slow), "moe_fsdp_expert",
    pytest.param("context", marks=pytest.mark.slow)])
def test_sampler_logprobs_are_the_trainers_on_a_mesh(name):
    r = _result("context_case")[name] if name == "context" else _result(f"{name}_case")
    assert r["compared"] > r["rows"], r  # completions of several tokens
    assert r["sampler_is_trainer"], r
    assert r["tokens_as_one_device"] and r["sampler_as_one_device"], r
    assert r["trainer_as_one_device"], r
    if name == "context":
        assert r["truncated"], r


# in the slow set with the context mesh's sampler case above (one 8-device process): the
# context-parallel step equals one device's in test_context_parallel.py, and the invariant
# mode's mesh bits are the MoE case's
@pytest.mark.slow
def test_context_parallel_step_is_one_devices():
    r = _result("context_case")["context_step"]
    assert r["logp_as_one_device"], r
    assert r["loss"] < 1e-6, r
    worst = max(r["grads"].values())
    assert worst < 1e-5, r["grads"]


@pytest.mark.parametrize("mesh", ["expert8", "fsdp2_expert4", "data2_expert2_context2"])
def test_moe_block_is_one_devices_with_its_experts_sharded(mesh):
    """Issue #41 (the 30B preset's memory in the mode): the invariant MoE block on an
    expert-parallel mesh gives one device's bits (bf16) whatever the expert axis's size,
    its gradients (the default dropless path's, summed in another order) within bf16
    rounding, and its compiled forward gathers no whole ``[E, H, I]`` / ``[E, I, H]``
    expert tensor (it did: every expert on every device)."""
    r = _moe_result()[mesh]
    assert r["as_one_device"], r
    assert r["whole_experts_gathered"] == [], r
    assert r["grads"] < 2e-2, r
