"""Context parallelism (``models.context``): multi-device cases run by
``tests.support.multidevice`` in a subprocess with 8 CPU devices
(``tests/models/test_context_parallel.py``). Each returns JSON-able measurements."""

from __future__ import annotations

from models.attention import api
from tests.models.kv_replication_cases import grpo_case

#: A row's tokens over 4 devices, the rows over fsdp=2; the MoE's experts over expert=2.
MESHES = {"context4_fsdp2": {"fsdp": 2, "context": 4}}
MOE_MESHES = {"context4_expert2": {"expert": 2, "context": 4}}


def _counted(case):
    """``case()`` with the calls of the context-parallel attention counted (traced
    layers), so a test sees that the mesh's context axis was used, not partitioned
    around."""
    calls = []
    original = api.context_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    api.context_attention = counting
    try:
        out = case()
    finally:
        api.context_attention = original
    return {**out, "context_attention_calls": len(calls)}


def dense_case() -> dict:
    """The dense tied model's GRPO step on rows of 32 tokens (8 per device)."""
    return _counted(lambda: grpo_case("tiny", MESHES, row_len=32))


def moe_case() -> dict:
    """The MoE's GRPO step on rows of 32 tokens, experts over expert=2."""
    return _counted(lambda: grpo_case("tiny-moe", MOE_MESHES, row_len=32))


def decode_case() -> dict:
    """Greedy and sampled rollouts of the tiny MoE (``train.rl.rollout.Generator``) under a
    context=4 x expert=2 mesh vs one device: decoding splits rows only, the context
    devices repeat the work."""
    from models.mesh import make_mesh
    from tests.train.rollout_cases import _policy, _rollouts
    from train.rl.placement import Placement

    mdef, params = _policy()
    placement = Placement(make_mesh(MOE_MESHES["context4_expert2"]), mdef)
    return {"mesh": _rollouts(mdef, params, placement),
            "one_device": _rollouts(mdef, params, None)}


def all_cases() -> dict:
    """Every case above in one process (one start-up for the test module)."""
    return {"dense": dense_case(), "moe": moe_case(), "decode": decode_case()}
