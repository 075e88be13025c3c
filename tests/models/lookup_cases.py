"""The sharded embedding gradient (``models.lookup``) on 8 CPU devices, run by
``tests/models/test_embed_lookup.py`` in a subprocess."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.lookup import embed_lookup
from models.mesh import make_mesh
from models.sharding import DEFAULT_RULES

V, H = 151936, 64


def _loss(lookup):
    def loss(table, tokens, w):
        return jnp.sum(lookup(table, tokens) * w)
    return loss


def memory_case() -> dict:
    """Compiled temporaries of the lookup's gradient (fsdp=2 x expert=4: the table split over
    fsdp, the tokens over both; a Qwen-sized vocabulary):
    ``embed_lookup``'s against ``jnp.take``'s, beside the table's bytes; and the two
    gradients on random data (max abs difference, float32)."""
    mesh = make_mesh({"fsdp": 2, "expert": 4})
    table_s = NamedSharding(mesh, P(None, "fsdp"))
    rows = NamedSharding(mesh, P(("fsdp", "expert")))
    shapes = (jax.ShapeDtypeStruct((V, H), jnp.float32, sharding=table_s),
              jax.ShapeDtypeStruct((8, 512), jnp.int32, sharding=rows),
              jax.ShapeDtypeStruct((8, 512, H), jnp.float32, sharding=rows))
    ours = _loss(lambda t, x: embed_lookup(t, x, rules=DEFAULT_RULES, split_tokens=True))
    plain = _loss(lambda t, x: jnp.take(t, x, axis=0))
    temps, grads = {}, {}
    rng = np.random.default_rng(0)
    table = jax.device_put(rng.standard_normal((V, H)).astype(np.float32), table_s)
    ids = rng.integers(0, V, (8, 512)).astype(np.int32)
    ids[:, :200] = 17  # one id repeated: its row sums many cotangents
    tokens = jax.device_put(ids, rows)
    w = jax.device_put(rng.standard_normal((8, 512, H)).astype(np.float32), rows)
    with jax.set_mesh(mesh):
        for name, fn in (("ours", ours), ("plain", plain)):
            step = jax.jit(jax.grad(fn), out_shardings=table_s)
            temps[name] = step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
            grads[name] = np.asarray(step(table, tokens, w))
    return {"table_bytes": V * H * 4, "temp": temps,
            "max_diff": float(np.max(np.abs(grads["ours"] - grads["plain"]))),
            "max_grad": float(np.max(np.abs(grads["plain"])))}
