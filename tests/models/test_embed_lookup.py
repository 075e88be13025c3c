"""The embedding lookup's gradient under a mesh is formed shard by shard
(``models.lookup.embed_lookup``): equal to JAX's on random data with a repeated id, and the
compiled step holds no ``[V, H]``-sized buffer (JAX's holds the fsdp shard over the whole
vocabulary here, and the whole table in the TPU compiler's Qwen3-30B-A3B step). Its
equality inside the whole GRPO step on many meshes is in test_kv_replication.py and
test_context_parallel.py (every parameter's gradient against one device)."""

from __future__ import annotations

from tests.support.multidevice import run_case


def test_sharded_embedding_gradient_equals_jax_and_holds_no_whole_table():
    r = run_case("tests.models.lookup_cases:memory_case")
    assert r["max_diff"] <= 1e-5 * r["max_grad"], r
    # JAX's: the fsdp shard of the table over the whole vocabulary (the TPU compiler forms
    # the whole table in the Qwen3-30B-A3B step); ours: two vocabulary chunks of it
    assert r["temp"]["plain"] >= 0.5 * r["table_bytes"], r
    assert r["temp"]["ours"] <= 0.3 * r["table_bytes"], r
