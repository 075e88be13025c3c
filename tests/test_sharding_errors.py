"""Bad input under a mesh fails before anything compiles, naming both numbers. Abstract
meshes stand in for 8 devices in this process; ``errors_case`` checks the same on 8 real
CPU devices in a subprocess."""

from __future__ import annotations

import numpy as np
import pytest
from multidevice import abstract_mesh, run_case

import jaxhead
from jaxhead.mesh import MeshConfig, check_divisible
from models import expert_parallel

MESH = abstract_mesh(data=2, expert=4)


def head_args(batch=8, seq=4, hidden=32, vocab=256):
    """Host arrays: the checks run before anything is traced or compiled."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, seq, hidden), np.float32),
            rng.standard_normal((hidden, vocab), np.float32),
            rng.integers(0, vocab, (batch, seq)).astype(np.int32))


def test_mesh_that_does_not_match_the_devices():
    with pytest.raises(ValueError, match=r"needs 8 devices but there are 1"):
        jaxhead.make_mesh({"data": 2, "expert": 4})
    with pytest.raises(ValueError, match=r"multiply to 3, which does not divide 8"):
        MeshConfig(expert=3).shape(8)
    with pytest.raises(ValueError, match="at most one -1"):
        MeshConfig(data=-1, expert=-1).shape(8)
    with pytest.raises(ValueError, match=r"unknown mesh axes \['model'\]"):
        MeshConfig.from_config({"data": 2, "model": 2})
    assert MeshConfig.from_config({"expert": 2}).shape(8) == (4, 1, 2, 1)


def test_batch_not_divisible_by_the_data_axes():
    with pytest.raises(ValueError, match=r"batch of 6 rows is not divisible by the 8 shards"):
        check_divisible(6, MESH)
    with pytest.raises(ValueError, match=r"6 rows is not divisible by the 8 shards"):
        jaxhead.sharded_token_logprobs(*head_args(batch=6), mesh=MESH)
    with pytest.raises(ValueError, match=r"6 rows is not divisible by the 4 shards"):
        jaxhead.sharded_token_logprobs(*head_args(batch=6), mesh=abstract_mesh(data=4, tensor=2))
    x = np.zeros((12, 64), np.float32)
    experts, weights = np.zeros((12, 2), np.int32), np.zeros((12, 2), np.float32)
    gate = np.zeros((8, 64, 32), np.float32)
    with pytest.raises(ValueError, match=r"12 rows is not divisible by the 8 shards"):
        expert_parallel.dropless_experts(x, experts, weights, gate, gate,
                                         gate.transpose(0, 2, 1), mesh=MESH)


def test_mesh_axes_that_do_not_divide_the_arrays():
    gate = np.zeros((6, 64, 32), np.float32)
    x = np.zeros((16, 64), np.float32)
    experts, weights = np.zeros((16, 2), np.int32), np.zeros((16, 2), np.float32)
    with pytest.raises(ValueError, match=r"dimension 0 \(expert\) of size 6 is not divisible by "
                                         r"the 4 devices"):
        expert_parallel.dropless_experts(x, experts, weights, gate, gate,
                                         gate.transpose(0, 2, 1), mesh=MESH)
    with pytest.raises(ValueError, match=r"vocab size 250 is not divisible by the 4 devices"):
        jaxhead.sharded_token_logprobs(*head_args(vocab=250), mesh=MESH, token_axes=("data",),
                                       vocab_axis="expert")


def test_head_axis_and_bucket_errors():
    args = head_args()
    with pytest.raises(ValueError, match="also a token axis"):
        jaxhead.sharded_token_logprobs(*args, mesh=MESH, vocab_axis="expert")
    with pytest.raises(ValueError, match=r"\['model'\] are not in the mesh"):
        jaxhead.sharded_token_logprobs(*args, mesh=MESH, token_axes=("model",))
    with pytest.raises(ValueError, match="runs the XLA path"):
        jaxhead.sharded_token_logprobs(*args, mesh=MESH, token_axes=("data",),
                                       vocab_axis="expert", impl="pallas_tpu")
    keep = np.zeros((8, 4), bool)
    keep[3] = True  # shard 3 (of 8) keeps all of its 4 tokens
    with pytest.raises(ValueError, match=r"bucket=3 is smaller than the 4 kept tokens"):
        jaxhead.sharded_token_logprobs(*args, keep, mesh=MESH, bucket=3)
    with pytest.raises(ValueError, match="no mesh"):
        jaxhead.sharded_token_logprobs(*args)


def test_errors_on_eight_devices():
    messages = run_case("sharding_cases:errors_case")
    assert "needs 16 devices but there are 8" in messages["mesh"]
    for name in ("shard_batch", "moe_tokens", "head_batch"):
        assert "not divisible by the 8 shards" in messages[name], messages
    assert "6 rows" in messages["shard_batch"] and "12 rows" in messages["moe_tokens"]
    assert "6 rows" in messages["head_batch"]
