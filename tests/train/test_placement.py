"""``train.rl.placement`` on this process's one device: parameter shardings from the model's
logical axes and the config's rules, optimiser shardings derived from them, batch
placement and its errors. (The same on 8 devices: ``tests/train/test_sharded_step.py``.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models import get_config, make_mesh
from train.rl.optim import make_optimizer
from train.rl.placement import Placement, place_batch
from train.rl.state import ModelDef
from train.run.schema import base_config


@pytest.fixture(scope="module")
def placement():
    return Placement(make_mesh(), ModelDef.of(get_config("tiny-moe", num_hidden_layers=1)))


def test_param_shardings_follow_the_rules(placement):
    specs = {k: s.spec for k, s in placement.params.items()}
    assert specs["layers.0.mlp.gate_proj"] == P("expert", "fsdp", "tensor")
    assert specs["embed_tokens.embedding"] == P("tensor", "fsdp")
    rules = (("expert", None), ("embed", "fsdp"), ("vocab", ("fsdp", "tensor")))
    other = Placement(make_mesh(), ModelDef.of(
        get_config("tiny-moe", num_hidden_layers=1, sharding_rules=rules)))
    assert other.rules == rules
    assert other.params["layers.0.mlp.gate_proj"].spec == P(None, "fsdp", None)
    # an axis an earlier dimension took is dropped; of several, those of size 1
    assert other.params["embed_tokens.embedding"].spec == P("fsdp", None)


def test_opt_shardings_are_derived_from_the_params(placement):
    c = base_config().train.optim
    c.frozen, c.lr_multipliers = ("embed_tokens",), (("norm", 50.0),)
    tx, _ = make_optimizer(c, 10)
    shardings = placement.opt_shardings(tx)
    abstract = placement.abstract_state(tx)["opt_state"]
    seen = set()
    for (path, sharding), leaf in zip(jax.tree_util.tree_leaves_with_path(shardings),
                                      jax.tree.leaves(abstract), strict=True):
        assert leaf.sharding == sharding
        key = getattr(path[-1], "key", None)
        if key in placement.params:  # a moment of that parameter
            assert sharding.spec == placement.params[key].spec, key
            assert leaf.shape == placement.abstract_params()[key].shape
            seen.add(key)
        else:  # counters
            assert sharding.spec == P() and leaf.shape == (), path
    # frozen parameters have no optimiser state, every other one has its moments
    assert seen == {k for k in placement.params if not k.startswith("embed_tokens.")}


def test_place_batch_on_one_device():
    arrays = {"tokens": np.arange(12, dtype=np.int32).reshape(6, 2),
              "mask": np.ones((6, 2), np.float32)}
    for mesh in (None, make_mesh()):
        out = place_batch(arrays, mesh)
        assert set(out) == set(arrays)
        for k, host in arrays.items():
            assert isinstance(out[k], jax.Array)
            np.testing.assert_array_equal(np.asarray(out[k]), host)
            assert out[k].dtype == host.dtype


def test_batch_helpers(placement):
    assert placement.row_multiple(4) == 4 and not placement.sharded
    assert placement.batch_shards == 1
