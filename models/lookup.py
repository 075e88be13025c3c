"""The embedding lookup under a mesh, with its gradient sharded like the table.

``jnp.take(table, tokens)``'s gradient is a scatter-add of one cotangent row per token into a
zero ``[V, H]`` table. Under a mesh XLA forms that table whole on every device and then
all-reduces it (Qwen3-30B-A3B: two float32 ``[151936, 2048]`` buffers, 1.19 GiB each, per
device), although each device keeps only its shard. ``embed_lookup`` gives the lookup a
backward inside ``jax.shard_map`` that never forms it: each device scatters its own tokens'
cotangents into one vocabulary chunk ``[V_local / chunks, H]`` at a time, sums the chunk over
the token shards (a reduce-scatter over the table's hidden-dimension axes, which are among
the token axes, and a ``psum`` over the other token axes) and keeps its own columns. The peak
is one chunk plus the gradient's own shard.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.mesh import BATCH_AXES, CONTEXT_AXIS
from models.sharding import logical_to_mesh

#: Vocabulary chunks of the sharded backward (each a ``[V_local / CHUNKS, H]`` buffer).
CHUNKS = 8


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def embed_lookup(table: jax.Array, tokens: jax.Array, *, rules, split_tokens: bool,
                 chunks: int = CHUNKS) -> jax.Array:
    """``table[tokens]``: the rows of ``table [V, H]`` for int ``tokens [B, S]``, in the
    table's dtype.

    Under a multi-device mesh (``jax.set_mesh``) whose token shards include every axis
    the table's hidden dimension is split over (training: rows over the batch axes,
    with ``split_tokens`` a row's tokens over ``context``), the gradient w.r.t. ``table``
    is formed shard by shard (module docstring); otherwise it is a scatter-add (one
    device, or decoding, where nothing is differentiated). Either way a 16-bit table's
    gradient is summed in float32 and rounded once.

    Args:
      table: ``[V, H]``, laid out by ``rules`` (logical axes ``vocab, embed``).
      tokens: int ``[B, S]``.
      rules: the model's logical -> mesh axis rules (``ModelConfig.sharding_rules``).
      split_tokens: a row's tokens are split over ``context`` (training and scoring).
      chunks: vocabulary chunks of the backward.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return _take(table, tokens)
    sizes = dict(mesh.shape)
    spec = logical_to_mesh(("vocab", "embed"), mesh, rules, table.shape, "embed_tokens")
    vocab_axes, embed_axes = ([a for a in _axes(e) if sizes[a] > 1] for e in spec)
    rows = [a for a in BATCH_AXES if sizes.get(a, 1) > 1]
    seq = [CONTEXT_AXIS] if split_tokens and sizes.get(CONTEXT_AXIS, 1) > 1 else []
    token_axes = rows + seq
    if not set(embed_axes) <= set(token_axes) or set(vocab_axes) & set(token_axes):
        return _take(table, tokens)
    tok_spec = P(tuple(rows) or None, tuple(seq) or None)
    out_spec = P(tuple(vocab_axes) or None, tuple(embed_axes) or None)
    v_local = table.shape[0] // math.prod(sizes[a] for a in vocab_axes)
    h_local = table.shape[1] // math.prod(sizes[a] for a in embed_axes)
    chunk = -(-v_local // chunks)
    others = [a for a in token_axes if a not in embed_axes]

    def shard_grad(ids, g):
        """This device's ``[v_local, h_local]`` of the table's gradient."""
        start = 0
        for a in vocab_axes:  # row-major over the vocabulary axes, as the spec splits
            start = start * sizes[a] + jax.lax.axis_index(a)
        ids = ids.reshape(-1) - start * v_local
        g = g.reshape(-1, g.shape[-1]).astype(_accumulation(table.dtype))

        def one(k):
            rel = ids - k * chunk
            rel = jnp.where((rel >= 0) & (rel < chunk), rel, chunk)  # chunk: dropped
            part = jnp.zeros((chunk, g.shape[-1]), g.dtype).at[rel].add(g, mode="drop")
            if embed_axes:
                part = jax.lax.psum_scatter(part, tuple(embed_axes), scatter_dimension=1,
                                            tiled=True)
            return jax.lax.psum(part, tuple(others)) if others else part

        parts = jax.lax.map(one, jnp.arange(chunks))
        return parts.reshape(chunks * chunk, h_local)[:v_local].astype(table.dtype)

    grad = jax.shard_map(shard_grad, mesh=mesh, in_specs=(tok_spec, P(*tok_spec, None)),
                         out_specs=out_spec)

    return _lookup(table, tokens, grad)


def _accumulation(dtype) -> jnp.dtype:
    """The dtype a gradient of ``dtype`` rows is summed in: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def _take(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``jnp.take(table, tokens, axis=0)``; for a 16-bit table with a gradient summed in
    float32 (``_float32_grad``)."""
    if jnp.finfo(table.dtype).bits >= 32:
        return jnp.take(table, tokens, axis=0)
    return _lookup(table, tokens, functools.partial(_float32_grad, table.shape, table.dtype))


def _float32_grad(shape, dtype, tokens: jax.Array, g: jax.Array) -> jax.Array:
    """The gradient of a ``shape`` / ``dtype`` table from its rows' cotangents ``g``,
    scatter-added in float32 and rounded to ``dtype`` once (a bfloat16 scatter-add rounds
    at every add: one id at 1,459 of 2,048 positions gave its row 30% off)."""
    acc = jnp.zeros(shape, _accumulation(dtype))
    acc = acc.at[tokens.reshape(-1)].add(g.reshape(-1, shape[-1]).astype(acc.dtype),
                                         mode="drop")
    return acc.astype(dtype)


def _lookup(table: jax.Array, tokens: jax.Array, grad) -> jax.Array:
    """``jnp.take(table, tokens, axis=0)`` whose gradient w.r.t. ``table`` is
    ``grad(tokens, g)`` (none w.r.t. the integer tokens)."""

    @jax.custom_vjp
    def lookup(table, tokens):
        return jnp.take(table, tokens, axis=0)

    def fwd(table, tokens):
        return lookup(table, tokens), tokens

    def bwd(tokens, g):
        return grad(tokens, g), None

    lookup.defvjp(fwd, bwd)
    return lookup(table, tokens)
