"""Bad mesh sizes and batches fail before anything compiles, naming both numbers. Abstract
meshes stand in for 8 devices in this process; ``errors_case`` checks the same on 8 real
CPU devices in a subprocess."""

from __future__ import annotations

import numpy as np
import pytest

from models.mesh import MeshConfig, check_divisible, make_mesh
from models.moe.api import routed_experts
from tests.support.multidevice import abstract_mesh, run_case

MESH = abstract_mesh(data=2, expert=4)


def test_mesh_that_does_not_match_the_devices():
    with pytest.raises(ValueError, match=r"needs 8 devices but there are 1"):
        make_mesh({"data": 2, "expert": 4})
    with pytest.raises(ValueError, match=r"multiply to 3, which does not divide 8"):
        MeshConfig(expert=3).shape(8)
    with pytest.raises(ValueError, match="at most one -1"):
        MeshConfig(data=-1, expert=-1).shape(8)
    with pytest.raises(ValueError, match=r"unknown mesh axes \['model'\]"):
        MeshConfig.from_config({"data": 2, "model": 2})
    assert MeshConfig.from_config({"expert": 2}).shape(8) == (4, 1, 2, 1, 1)


def test_moe_arrays_not_divisible_by_the_mesh():
    gate = np.zeros((6, 64, 32), np.float32)
    x = np.zeros((16, 64), np.float32)
    experts, weights = np.zeros((16, 2), np.int32), np.zeros((16, 2), np.float32)
    with pytest.raises(ValueError, match=r"dimension 0 \(expert\) of size 6 is not divisible by "
                                         r"the 4 devices"):
        routed_experts(x, experts, weights, gate, gate,
                                       gate.transpose(0, 2, 1), mesh=MESH)


def test_batch_not_divisible_by_the_data_axes():
    with pytest.raises(ValueError, match=r"batch of 6 rows is not divisible by the 8 shards"):
        check_divisible(6, MESH)
    x = np.zeros((12, 64), np.float32)
    experts, weights = np.zeros((12, 2), np.int32), np.zeros((12, 2), np.float32)
    gate = np.zeros((8, 64, 32), np.float32)
    with pytest.raises(ValueError, match=r"12 rows is not divisible by the 8 shards"):
        routed_experts(x, experts, weights, gate, gate,
                                       gate.transpose(0, 2, 1), mesh=MESH)


def test_errors_on_eight_devices():
    messages = run_case("tests.models.sharding_cases:errors_case")
    assert "needs 16 devices but there are 8" in messages["mesh"]
    for name in ("place_batch", "moe_tokens", "head_batch"):
        assert "not divisible by the 8 shards" in messages[name], messages
    assert "6 rows" in messages["place_batch"] and "12 rows" in messages["moe_tokens"]
    assert "6 rows" in messages["head_batch"]
