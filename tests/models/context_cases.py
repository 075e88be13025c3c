"""Context parallelism (``models.context``): multi-device cases run by
``tests.support.multidevice`` in a subprocess with 8 CPU devices
(``tests/models/test_context_parallel.py``). Each returns JSON-able measurements."""

from __future__ import annotations

from tests.models.kv_replication_cases import grpo_case

#: A row's tokens over 4 devices, the rows over fsdp=2; the MoE's experts over expert=2.
MESHES = {"context4_fsdp2": {"fsdp": 2, "context": 4}}
MOE_MESHES = {"context4_expert2": {"expert": 2, "context": 4}}


def dense_case() -> dict:
    return grpo_case("tiny", MESHES)


def moe_case() -> dict:
    return grpo_case("tiny-moe", MOE_MESHES)
