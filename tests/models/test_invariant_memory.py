"""What the invariant attention keeps for the backward pass of a rematerialised layer
scan (issue #41, "True on-policy rollouts": the invariant mode's GRPO step needed 55.5 GiB
of TPU temporaries against the default's 1.9 GiB, `benchmarks/memory.py --numerics
invariant` on the 0.6B preset cut to 2 layers, one v5p chip; docs/numerics.md).

Under ``jax.checkpoint`` inside ``lax.scan``, partial evaluation moved every value the
blockwise attention computes from the positions and segment ids alone (key indices,
masks, the zeros of its selects) into the forward pass, stacked over every query tile and
key block: ``[tiles, blocks, tile, KEY_BLOCK, K, D]``. The step's program (its jaxpr, the
same before any compiler) must hold nothing larger than the default attention's does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from models.attention import invariant as inv_attention
from models.attention.xla import chunked_attention

B, T, N, K, D, LAYERS = 1, 4 * inv_attention.KEY_BLOCK, 4, 2, 32, 2


def _largest(jaxpr) -> tuple[int, str]:
    """The most elements of any value an equation of ``jaxpr`` (or of a jaxpr nested in
    its parameters: scans, conds, calls, custom rules) produces, with its type."""
    best = (0, "")
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            best = max(best, (math.prod(shape), str(var.aval)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    best = max(best, _largest(inner))
    return best


def _scanned_step(attention):
    """The gradient of ``LAYERS`` rematerialised layers of ``attention`` in a
    ``lax.scan``: the positions and segment ids are the scan's constants (the trainer's
    layer scan), the queries its carry."""
    positions = jnp.concatenate([jnp.arange(100), jnp.arange(T - 100)])[None].astype(jnp.int32)
    segment_ids = jnp.concatenate([jnp.ones(100), 2 * jnp.ones(T - 110),
                                   jnp.zeros(10)])[None].astype(jnp.int32)

    def loss(q, k, v):
        def layer(x, kv):
            out = attention(x, kv[0], kv[1], positions, segment_ids)
            return out.reshape(x.shape), None

        y, _ = lax.scan(jax.checkpoint(layer), q, (k, v))
        return y.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def _invariant(q, k, v, positions, segment_ids):
    return inv_attention.self_attention(q, k, v, positions, segment_ids, scale=D ** -0.5)


def _default(q, k, v, positions, segment_ids):
    return chunked_attention(q, k, v, positions, segment_ids, positions, segment_ids,
                             scale=D ** -0.5)


def test_remat_scan_saves_no_per_tile_block_buffers():
    """The gradient of a rematerialised layer scan of the invariant attention holds no
    value larger than the default (``xla_chunked``) attention's: the key side of a tile
    is recomputed one block at a time, not saved for every tile and block."""
    q = jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((LAYERS, B, T, K, D), jnp.bfloat16)
    invariant = _largest(jax.make_jaxpr(_scanned_step(_invariant))(q, kv, kv).jaxpr)
    default = _largest(jax.make_jaxpr(_scanned_step(_default))(q, kv, kv).jaxpr)
    assert invariant[0] <= default[0], (invariant, default)

