"""Tensor parallelism wider than the KV heads: 8 query heads on 2 KV heads with tensor=4 or
8 (``models.sharding.kv_head_layout``). The trainer's GRPO step (dense tied model on
fsdp=2 x tensor=4 and tensor=8; the MoE on expert=2 x tensor=4) on a packed batch with
padding gives the loss, log-probs, entropy and every parameter gradient of one device; the
K/V projections are replicated over ``tensor`` with their shapes unchanged; the sharded
rollouts (KV cache) decode what one device does; the attention kernels get whole KV heads
per shard. Other head / tensor combinations fail naming the values. Before, every one of
these meshes raised a ``ValueError`` placing ``k_proj``."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import Transformer, get_config, state_shardings
from models.sharding import kv_head_layout, logical_to_mesh
from tests.support.multidevice import abstract_mesh, run_case

#: Relative error bound, float32 (``kv_replication_cases.relative``; measured: loss 7.6e-8,
#: log-probs 1.2e-7, gradients <= 1.6e-6 dense, 1.8e-6 MoE, kernels 1.0e-6).
TOL = 1e-5
KV = ("embed", "kv_heads", "head_dim")


def test_kv_heads_replicate_over_a_wider_tensor_axis():
    mesh = abstract_mesh(fsdp=2, tensor=4)
    assert logical_to_mesh(KV, mesh, shape=(64, 2, 16)) == P("fsdp", None, None)
    assert logical_to_mesh(KV, mesh, shape=(64, 4, 16)) == P("fsdp", "tensor", None)
    assert logical_to_mesh(KV, mesh, shape=(64, 8, 16)) == P("fsdp", "tensor", None)
    assert kv_head_layout(8, 2, mesh) == 2 and kv_head_layout(8, 4, mesh) == 1
    assert kv_head_layout(32, 4, abstract_mesh(tensor=8)) == 2  # Qwen3-30B-A3B, tensor=8
    assert kv_head_layout(8, 2, abstract_mesh(tensor=8)) == 4
    # the rules decide which axes the KV heads (and so the replication) use
    assert kv_head_layout(8, 2, mesh, rules=(("kv_heads", None),)) == 1


@pytest.mark.parametrize("heads, kv, sizes, message", [
    (4, 2, {"tensor": 8}, (r"over 8 devices \(mesh axes \{'tensor': 8\}\) wider than "
                           r"num_key_value_heads=2 needs a multiple of 2 devices that divides "
                           r"num_attention_heads=4")),
    (16, 4, {"tensor": 6}, r"over 6 devices .* num_key_value_heads=4 .* num_attention_heads=16"),
])
def test_other_head_counts_name_the_values(heads, kv, sizes, message):
    with pytest.raises(ValueError, match=message):
        kv_head_layout(heads, kv, abstract_mesh(**sizes))


def test_kv_heads_that_neither_divide_nor_are_divided():
    with pytest.raises(ValueError, match=r"k_proj of shape \(64, 3, 16\): dimension 1 "
                                         r"\(kv_heads\) of size 3 is not divisible by the 4 "
                                         r"devices of mesh axes \('tensor',\) \(nor a divisor"):
        logical_to_mesh(KV, abstract_mesh(tensor=4), shape=(64, 3, 16), what="k_proj")
    # too few query heads for tensor=8: placing their projections names them
    cfg = get_config("tiny", num_attention_heads=4, num_key_value_heads=2)
    state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"_proj of shape .*: dimension \d \(heads\) of size 4 "
                                         r"is not divisible by the 8 devices"):
        state_shardings(state, abstract_mesh(tensor=8))


@pytest.fixture(scope="module")
def measured():
    return run_case("tests.models.kv_replication_cases:case")


def test_grpo_step_matches_one_device(measured):
    for model, meshes in (("dense", 2), ("moe", 1)):
        runs = {k: v for k, v in measured[model].items() if isinstance(v, dict)}
        assert len(runs) == meshes, runs.keys()
        for mesh, r in runs.items():
            assert r["k_proj_spec"] == str(P("fsdp", None, None)), (model, mesh, r)
            assert r["q_proj_spec"] == str(P("fsdp", "tensor", None)), (model, mesh, r)
            for key in ("loss", "logp", "entropy"):
                assert r[key] <= TOL, (model, mesh, key, r[key])
            worst = max(r["grads"], key=r["grads"].get)
            assert r["grads"][worst] <= TOL, (model, mesh, worst, r["grads"][worst])
            assert any("k_proj" in k for k in r["grads"]), r["grads"].keys()
        assert measured[model]["kept"] > 0 and measured[model]["padding_rows"] >= 2


def test_rollouts_with_the_kv_cache_match_one_device(measured):
    mesh, one = measured["decode"]["mesh"], measured["decode"]["one_device"]
    assert mesh["params_kept"]
    for name in ("greedy", "sampled"):
        for key in ("tokens", "lengths", "stopped"):
            assert mesh[name][key] == one[name][key], (name, key)
        for key in ("logprobs", "min_logit"):
            np.testing.assert_allclose(mesh[name][key], one[name][key], rtol=0, atol=1e-5,
                                       err_msg=f"{name} {key}")
    assert mesh["sampled"]["tokens"] != mesh["greedy"]["tokens"]


def test_kernels_get_whole_kv_heads_per_shard(measured):
    for impl, r in measured["kernels"].items():
        assert r["value"] <= TOL, (impl, r["value"])
        assert len(r["grads"]) == 7 and max(r["grads"].values()) <= TOL, (impl, r["grads"])
