"""The MoE block under ``numerics = "invariant"``: one row tile of tokens routed and run
through its experts with shapes that do not depend on which tokens share the tile.

The default path (``models.moe.reference.dropless_experts``) sorts all the batch's
(token, expert) pairs by expert and runs one grouped matmul per projection: a token's
row lands at a place, and in a group of a size, that the rest of the batch decides, so
its bits move with the batch. Here ``models.invariant.row_tiled`` hands the block
``ROW_TILE`` tokens at a time and, per tile:

* the router's float32 logits are one ``[ROW_TILE, H] x [H, E]`` product, then softmax,
  top-k and the renormalisation of the chosen probabilities, each a function of the
  token's own row (``models.moe.layer.route``, as the default path);
* every expert runs on the whole tile: a fixed ``[E, ROW_TILE, I]`` SwiGLU activation
  and ``[E, ROW_TILE, H]`` output (each row a function of its own token only), from which
  each token's ``k`` chosen outputs are selected (a gather, never a product with a 0
  weight). No capacity, sort or group size enters: nothing is dropped, and a token never
  reads another token's values;
* the ``k`` outputs, in the compute dtype as the default path's, are weighted and summed
  in float32 in top-k order.

The price is ``E / k`` times the expert FLOPs of the dropless path (4x on the
``tiny-moe`` preset, 16x at 128 experts with 8 per token). The alternative, each token
multiplying its row by its own experts' gathered weights (``[ROW_TILE, H, I]`` per slot),
has the dropless FLOPs but its backward scatter-adds every tile's gathered weights into
the whole expert tensors: on ``tiny-moe`` its forward was about as fast and its forward +
backward several times slower than this one's (``benchmarks/invariant.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tile_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """Router logits of one tile: ``x [t, H] @ router [H, E]`` accumulated in float32
    (``[t, E]``); both in the compute dtype."""
    return jnp.einsum("th,he->te", x, router, preferred_element_type=jnp.float32)


def tile_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array,
                 up: jax.Array, down: jax.Array) -> jax.Array:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for one tile, each token
    alone: every expert's SwiGLU of the whole tile, each token's chosen outputs selected
    and combined in top-k order.

    Args:
      x: ``[t, H]`` compute dtype (one row tile).
      experts: int32 ``[t, k]`` expert ids in ``[0, E)``, highest router weight first.
      weights: float32 ``[t, k]`` combine weights.
      gate, up: ``[E, H, I]``; down: ``[E, I, H]``; the dtype of ``x``.

    Returns:
      ``[t, H]`` in the dtype of ``x``: the gate and up products accumulated in float32
      and rounded to the compute dtype (as ``models.moe.experts.expert_ffn``'s), the down
      product in the compute dtype (XLA:CPU has no batched bf16 x bf16 -> float32 product
      inside a loop: "Unsupported element type for DotThunk"), the slots weighted and
      summed in float32 in slot order, then rounded.
    """
    dt = x.dtype

    def project(w):
        return jnp.einsum("th,ehi->eti", x, w, preferred_element_type=jnp.float32).astype(dt)

    hidden = jax.nn.silu(project(gate)) * project(up)  # [E, t, I]
    out = jnp.einsum("eti,eih->eth", hidden, down)  # [E, t, H]: row t from token t only
    rows = jnp.arange(x.shape[0])
    total = jnp.zeros(x.shape, jnp.float32)
    for j in range(experts.shape[1]):  # top-k order: a fixed order of the float32 sum
        total = total + weights[:, j:j + 1] * out[experts[:, j], rows].astype(jnp.float32)
    return total.astype(dt)
