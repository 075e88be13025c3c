"""Placement rules: logical axes -> mesh axes, and models created in their sharded layout."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import Transformer, get_config, init_sharded, state_shardings
from models.mesh import AXES, auto_axes
from models.sharding import logical_to_mesh
from tests.support.multidevice import abstract_mesh


def test_default_rules():
    mesh = abstract_mesh(data=2, fsdp=2, expert=2, tensor=2)
    assert logical_to_mesh(("expert", "embed", "mlp"), mesh) == P("expert", "fsdp", "tensor")
    assert logical_to_mesh(("embed", "heads", "head_dim"), mesh) == P("fsdp", "tensor", None)
    assert logical_to_mesh(("vocab", "embed"), mesh) == P("tensor", "fsdp")
    # the hidden dimension over fsdp and context: ZeRO-3 over the context devices too
    ctx = abstract_mesh(fsdp=2, expert=2, context=2)
    assert logical_to_mesh(("expert", "embed", "mlp"), ctx) == P("expert", ("fsdp", "context"),
                                                                 "tensor")
    assert logical_to_mesh(("embed",), abstract_mesh(context=4)) == P("context")
    rules = (("embed", "fsdp"), ("mlp", ("fsdp", "tensor")), ("vocab", "model"))
    # an axis used by an earlier dimension is dropped; an axis the mesh lacks too
    assert logical_to_mesh(("embed", "mlp", "vocab"), mesh, rules) == P("fsdp", "tensor", None)
    with pytest.raises(ValueError, match=r"q_proj of shape \(64, 3, 16\): dimension 1 "
                                         r"\(heads\) of size 3 is not divisible by the 2"):
        logical_to_mesh(("embed", "heads", "head_dim"), mesh, shape=(64, 3, 16), what="q_proj")


def test_state_shardings_and_init_sharded():
    cfg = get_config("tiny-moe", num_hidden_layers=1)
    # jax.make_mesh's default axis types (Explicit): the models run it with Auto axes
    mesh = jax.make_mesh((1,) * len(AXES), AXES, devices=jax.devices()[:1])
    model = init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    specs = {"/".join(map(str, p)): v.get_value().spec
             for p, v in nnx.to_flat_state(state_shardings(nnx.state(model), mesh))}
    assert specs["layers/0/mlp/gate_proj"] == P("expert", "fsdp", "tensor")
    assert specs["layers/0/mlp/router"] == P("fsdp", "expert")
    assert specs["layers/0/self_attn/q_proj"] == P("fsdp", "tensor", None)
    assert specs["embed_tokens/embedding"] == P("tensor", "fsdp")
    assert specs["lm_head/kernel"] == P("fsdp", "tensor")
    placed = model.layers[0].mlp.down_proj[...]
    assert placed.sharding.spec == P("expert", "tensor", "fsdp")
    assert placed.sharding.mesh == auto_axes(mesh) and auto_axes(mesh).are_all_axes_auto
    plain = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(0))))()
    chex.assert_trees_all_equal(nnx.state(model), plain)


def test_rules_are_config_data():
    from models import DEFAULT_RULES
    from models.moe.api import routed_experts

    cfg = get_config("tiny-moe", sharding_rules=[["expert", "data"], ["mlp", ["fsdp", "tensor"]]])
    assert cfg.sharding_rules == (("expert", "data"), ("mlp", ("fsdp", "tensor")))
    assert hash(cfg) == hash(cfg.replace())  # hashable, a static config
    assert get_config("tiny-moe").sharding_rules == DEFAULT_RULES
    with pytest.raises(ValueError, match=r"\(logical name, mesh axes\), got 'expert'"):
        get_config("tiny", sharding_rules=("expert",))
    # the expert-parallel MoE places its experts by the config's rules
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert model.layers[0].mlp.rules == cfg.sharding_rules
    mesh = abstract_mesh(data=2, expert=4)
    x, experts = np.zeros((16, 64), np.float32), np.zeros((16, 2), np.int32)
    gate = np.zeros((3, 64, 32), np.float32)
    args = (x, experts, experts.astype(np.float32), gate, gate, gate.transpose(0, 2, 1))
    with pytest.raises(ValueError, match=r"size 3 is not divisible by the 4 devices of mesh "
                                         r"axes \('expert',\)"):
        routed_experts(*args, mesh=mesh)
    with pytest.raises(ValueError, match=r"size 3 is not divisible by the 2 devices of mesh "
                                         r"axes \('data',\)"):
        routed_experts(*args, mesh=mesh, rules=cfg.sharding_rules)


def test_init_sharded_without_a_mesh():
    cfg = get_config("tiny", num_hidden_layers=1)
    model = init_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    plain = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(0))))()
    chex.assert_trees_all_equal(nnx.state(model), plain)
