"""Multi-device cases of the ragged expert dispatch (``models.moe.ragged``), run in a
subprocess with 8 CPU devices by ``tests/models/test_ragged_dispatch.py``. XLA:CPU has no
``ragged_all_to_all``, so ``dispatch="ragged"`` runs its emulation here: these cases check
the ragged path's offsets, sizes, layout and capacity handling against the dense path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from harness.oracle import max_abs
from models.mesh import make_mesh
from models.moe.api import routed_experts
from models.moe.ragged import emulated_ragged_all_to_all
from models.moe.reference import dropless_experts

TOKENS, HIDDEN, MLP, EXPERTS, TOP_K = 128, 32, 16, 8, 2


def _inputs(routing: str):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)
    logits = rng.standard_normal((TOKENS, EXPERTS)) * 2
    if routing == "skewed":  # every token picks experts 5 and 4: one device gets them all
        logits[:, 5] += 100
        logits[:, 4] += 90
    weights, experts = jax.lax.top_k(jax.nn.softmax(jnp.asarray(logits, jnp.float32)), TOP_K)
    params = tuple(jnp.asarray(rng.standard_normal(s) / 4, jnp.float32) for s in
                   ((EXPERTS, HIDDEN, MLP), (EXPERTS, HIDDEN, MLP), (EXPERTS, MLP, HIDDEN)))
    cotangent = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)
    return x, experts.astype(jnp.int32), weights, params, cotangent


def _vjp(routing, mesh=None, **kw):
    """Outputs and (x, gate, up, down) gradients of the MoE layer; one device if no mesh."""
    x, experts, weights, params, cotangent = _inputs(routing)

    def layer(x, *p):
        if mesh is None:
            return dropless_experts(x, experts, weights, *p)
        return routed_experts(x, experts, weights, *p, mesh=mesh, **kw)[0]

    def run():
        out, pull = jax.vjp(layer, x, *params)
        return out, pull(cotangent)

    if mesh is None:
        return jax.jit(run)()
    with jax.set_mesh(mesh):
        return jax.jit(run)()


def _diff(a, b) -> dict:
    return {"value": max_abs(a[0], b[0]),
            "grads": max(max_abs(p, q) for p, q in zip(a[1], b[1], strict=True))}


def equality_case() -> dict:
    """Ragged vs dense dispatch, forward and gradients, float32, on data=2 x expert=4 (4
    rounds: ``max_rows=64``): random routing (also vs one device) and the skewed one; a
    capacity factor 2 on the random routing (fits) and, in strict mode, on the skewed one
    (overflows)."""
    mesh = make_mesh({"data": 2, "expert": 4})
    random = _vjp("random", mesh, dispatch="ragged", max_rows=64)
    out = {"random": {"ragged_vs_dense": _diff(random, _vjp("random", mesh, dispatch="dense",
                                                                max_rows=64)),
                      "ragged_vs_one_device": _diff(random, _vjp("random"))},
           "skewed": {"ragged_vs_dense": _diff(
               _vjp("skewed", mesh, dispatch="ragged", max_rows=64),
               _vjp("skewed", mesh, dispatch="dense", max_rows=64))},
           "factor2_random": _diff(_vjp("random", mesh, dispatch="ragged",
                                        capacity_factor=2.0), random)}
    skewed = _vjp("skewed", mesh, dispatch="ragged", capacity_factor=2.0, overflow="nan")[0]
    out["factor2_skewed_nan_rows"] = int(jnp.isnan(skewed).any(axis=1).sum())
    out["factor2_skewed_finite_rows"] = int(jnp.isfinite(skewed).all(axis=1).sum())
    out["emulation_docstring_example"] = _emulation_example()
    return out


def _emulation_example() -> list:
    """The example of the ``jax.lax.ragged_all_to_all`` docstring through the emulation."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    args = (jnp.array([[1, 2, 2], [3, 4, 0]]), jnp.zeros((2, 4), jnp.int32),
            jnp.array([[0, 1], [0, 1]]), jnp.array([[1, 2], [1, 1]]),
            jnp.array([[0, 0], [1, 2]]), jnp.array([[1, 1], [2, 1]]))

    def body(*a):
        return emulated_ragged_all_to_all(*(v[0] for v in a), axis_name="x", num=2)[None]

    args = tuple(jax.device_put(a, jax.NamedSharding(mesh, jax.P("x"))) for a in args)
    run = jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    return np.asarray(jax.jit(run)(*args)).tolist()
