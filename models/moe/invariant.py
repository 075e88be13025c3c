"""The MoE block under ``numerics = "invariant"``: dropless expert FLOPs in tiles of one
fixed shape, so a token's bits do not depend on which tokens share its batch.

The default path (``models.moe.reference.dropless_experts``) sorts all the batch's
(token, expert) pairs by expert and runs one grouped matmul per projection: a token's
row lands at a place, and in a group of a size, that the rest of the batch decides, and
XLA:CPU's products (like any split-K or shape-tuned kernel) round a row by the shape it
sits in. Here:

* the router runs on the row tiles of ``models.invariant.row_tiled``: float32
  ``[ROW_TILE, H] x [H, E]`` logits, softmax, top-k and the renormalisation of the chosen
  probabilities, each a function of the token's own row (``router_logits``,
  ``models.moe.layer.route``);
* the experts run expert-major (``expert_tiles``): the (token, slot) pairs are grouped by
  expert, each expert's group padded to a multiple of ``EXPERT_TILE`` rows, and each tile,
  ``EXPERT_TILE`` gathered token rows of one expert, goes through that expert's SwiGLU as
  the same ``[EXPERT_TILE, H] x [H, I]`` and ``[EXPERT_TILE, I] x [I, H]`` products, one
  tile per step of a loop (``lax.fori_loop`` over the tiles in use). A fixed-shape
  product's row depends only on that row and the weights, not on the other rows of the
  tile nor where it sits (measured on XLA:CPU, the property batch-invariant kernels give
  on accelerators), so a pair's output depends only on its token and its expert. The FLOPs
  are the dropless path's plus each expert's padding to a whole tile (at most
  ``EXPERT_TILE - 1`` rows an expert); nothing is dropped and a token never reads another
  token's values. The tile buffer has a static shape, ``tile_bound`` tiles;
* the ``k`` outputs, in the compute dtype as the default path's, are weighted and summed
  in float32 in top-k order on the row tiles again, and added to the residual stream.

Only these forward values must be the sampler's (Thinking Machines, "Defeating
Nondeterminism in LLM Inference", 2025: the trainer's forward must be the sampler's; its
backward may be computed any way). ``residual_block``'s gradient is therefore the
default dropless path's (``models.moe.layer.MoE.experts``: ``ragged_dot``, or the
expert-parallel ``models.moe.api.routed_experts`` on a mesh) with the experts the forward
chose, a ``jax.custom_vjp``: the backward costs what the default's does.

On a mesh (``on_mesh``) the experts stay where ``ModelConfig.sharding_rules`` put them
(over ``expert``): each device all-gathers the tokens of its expert group (the rows split
over the ``expert`` axis), computes the tiles of the pairs whose expert it holds, writes
``-0.0`` for every other pair, and a reduce-scatter (``jax.lax.psum_scatter``) over the
expert axis returns each device its own tokens' pair outputs. Exactly one device
computes each pair and ``x + (-0.0) == x`` for every ``x`` (signed zeros included), so
the sum is exact in any order: the bits do not depend on the expert axis's size. Expert
weights split over ``fsdp`` on their hidden dimension are gathered whole for the layer,
the local experts only. A device's tokens go through this in rounds (``tokens_per_round``:
at most ``models.moe.api.MAX_DISPATCH_ROWS`` gathered pairs, the default dispatch's bound
on a round's receive buffer), so the tile buffer and the pair outputs are one round's
whatever the number of tokens; a pair's bits do not depend on its round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.invariant import ROW_TILE, row_tiled, shard_axes
from models.mesh import free_axes
from models.moe.api import MAX_DISPATCH_ROWS, _axes, _nontrivial
from models.moe.experts import token_chunks
from models.sharding import DEFAULT_RULES, logical_to_mesh

#: Rows per expert tile (one constant for the sampler and the trainer).
EXPERT_TILE = ROW_TILE


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """Router logits ``x [t, H] @ router [H, E]`` accumulated in float32 (``[t, E]``),
    both in the compute dtype: one statement for the default path (all tokens) and the
    invariant one (a row tile)."""
    return jnp.einsum("th,he->te", x, router, preferred_element_type=jnp.float32)


def tile_bound(pairs: int, experts: int, tile: int = EXPERT_TILE) -> int:
    """The most tiles ``pairs`` (token, expert) pairs over ``experts`` experts fill when
    each expert's group is padded to a multiple of ``tile`` rows:
    ``sum_e ceil(c_e / tile) <= ceil(pairs / tile) + experts``."""
    return -(-pairs // tile) + experts


def _swiglu(rows: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """One expert's SwiGLU of one tile, ``rows [t, H]`` -> ``[t, H]`` (dtype of ``rows``):
    each product accumulated in float32 and rounded to the compute dtype, as
    ``models.moe.experts.expert_ffn`` and the combine round them."""
    dt = rows.dtype

    def dot(a, w):
        return jnp.dot(a, w, preferred_element_type=jnp.float32).astype(dt)

    return dot(jax.nn.silu(dot(rows, gate)) * dot(rows, up), down)


def expert_tiles(x: jax.Array, experts: jax.Array, token_mask: jax.Array, gate: jax.Array,
                 up: jax.Array, down: jax.Array, first=0, tile: int = EXPERT_TILE
                 ) -> jax.Array:
    """Each (token, slot) pair's expert output, computed in expert-major tiles of one
    shape (the module docstring), for the pairs whose expert this call holds.

    Args:
      x: ``[N, H]`` compute dtype: the tokens.
      experts: int32 ``[N, k]`` expert ids (global, ``[0, E)``).
      token_mask: bool ``[N]``: the real tokens (the others' pairs are not computed).
      gate, up: ``[E_l, H, I]``; down: ``[E_l, I, H]``; the dtype of ``x``: experts
        ``first .. first + E_l - 1``.
      first: int scalar (may be traced): the id of ``gate[0]``'s expert.
      tile: rows per tile.

    Returns:
      ``[N, k, H]`` in the dtype of ``x``: ``expert_{experts[n, j]}(x[n])`` for the pairs
      of real tokens whose expert is held here, ``-0.0`` for every other pair (so a sum
      over the holders of the experts is exact).
    """
    n, k = experts.shape
    held = gate.shape[0]
    local = experts - first
    valid = (token_mask[:, None] & (local >= 0) & (local < held)).reshape(-1)
    ids = jnp.where(valid, local.reshape(-1), held)  # held: past every group
    counts = jnp.bincount(ids, length=held)
    tiles = -(-counts // tile)
    tile_end = jnp.cumsum(tiles)
    bound = tile_bound(n * k, held, tile)
    # each pair's row in the padded expert-major buffer: its expert's first tile, plus its
    # rank within the expert (pairs of an expert in (token, slot) order)
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    group = jnp.minimum(sorted_ids, held - 1)
    rank = jnp.arange(n * k) - (jnp.cumsum(counts) - counts)[group]
    row_sorted = jnp.where(sorted_ids < held, (tile_end - tiles)[group] * tile + rank,
                           bound * tile)
    row = jnp.zeros_like(row_sorted).at[order].set(row_sorted)
    # the token of each buffer row: N (a zero row) where no pair sits
    source = jnp.full((bound * tile,), n, jnp.int32).at[row].set(
        jnp.arange(n * k, dtype=jnp.int32) // k, mode="drop")
    tile_expert = jnp.minimum(
        jnp.searchsorted(tile_end, jnp.arange(bound), side="right"), held - 1)
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])

    def one(i, out):
        rows = padded[jax.lax.dynamic_slice_in_dim(source, i * tile, tile)]
        e = tile_expert[i]
        y = _swiglu(rows, gate[e], up[e], down[e])
        return jax.lax.dynamic_update_slice_in_dim(out, y[None], i, 0)

    buffer = jax.lax.fori_loop(0, tile_end[-1], one,
                               jnp.zeros((bound, tile, x.shape[1]), x.dtype))
    out = buffer.reshape(bound * tile, -1)[jnp.minimum(row, bound * tile - 1)]
    out = jnp.where(valid[:, None], out, jnp.asarray(-0.0, x.dtype))
    return out.reshape(n, k, -1)


def combine_tile(x: jax.Array, outputs: jax.Array, weights: jax.Array,
                 token_mask: jax.Array) -> jax.Array:
    """``x + sum_j weights[:, j] * outputs[:, j]`` for one row tile: the slots summed in
    float32 in top-k order, rounded to the compute dtype, 0 for padding tokens.

    Args:
      x: ``[t, H]`` the residual stream. outputs: ``[t, k, H]`` compute dtype.
      weights: float32 ``[t, k]``. token_mask: bool ``[t]``.

    Returns:
      ``[t, H]`` in the dtype of ``x``.
    """
    total = jnp.zeros(x.shape, jnp.float32)
    for j in range(outputs.shape[1]):  # a fixed order of the float32 sum
        total = total + weights[:, j:j + 1] * outputs[:, j].astype(jnp.float32)
    y = total.astype(outputs.dtype)
    return x + jnp.where(token_mask[:, None], y, jnp.zeros_like(y))


def tokens_per_round(tokens: int, devices: int, top_k: int,
                     max_rows: int = MAX_DISPATCH_ROWS) -> int:
    """A device's tokens per round of ``_local``: at most ``max_rows`` pairs gathered
    over the ``devices`` of the expert axis (``devices * t * top_k <= max_rows``, the
    bound ``models.moe.api`` puts on a dispatch round's receive buffer), at least 1 and
    at most ``tokens``."""
    return max(1, min(tokens, max_rows // (devices * top_k)))


def _local(x, h, weights, experts, token_mask, gate, up, down, expert_axes=(),
           gather_axes=(), down_axes=()):
    """The block's forward on one device's rows (``[B, T, ...]``), in rounds of
    ``tokens_per_round`` tokens (``models.moe.experts.token_chunks``: the tile buffer and
    the pair outputs are one round's): the round's tokens of the ``expert_axes`` group
    gathered, their pairs of the local experts tiled, each pair's output
    reduce-scattered back to the device that holds its token; then the combine."""
    b, t, hidden = h.shape
    k = experts.shape[-1]
    devices = jax.lax.axis_size(expert_axes) if expert_axes else 1
    if gather_axes:  # the local experts whole on their hidden dimension (fsdp's gather)
        gate, up = (jax.lax.all_gather(w, gather_axes, axis=1, tiled=True) for w in (gate, up))
    if down_axes:
        down = jax.lax.all_gather(down, down_axes, axis=2, tiled=True)

    def round_(h, experts, token_mask):
        first = 0
        if expert_axes:
            h, experts, token_mask = (jax.lax.all_gather(a, expert_axes, axis=0, tiled=True)
                                      for a in (h, experts, token_mask))
            first = jax.lax.axis_index(expert_axes) * gate.shape[0]
        outputs = expert_tiles(h, experts, token_mask, gate, up, down, first)
        if expert_axes:  # one holder per pair, -0.0 elsewhere: an exact sum
            outputs = jax.lax.psum_scatter(outputs, expert_axes, scatter_dimension=0,
                                           tiled=True)
        return outputs

    outputs = token_chunks(round_, tokens_per_round(b * t, devices, k),
                           h.reshape(b * t, hidden), experts.reshape(b * t, k),
                           token_mask.reshape(-1))
    y = row_tiled(combine_tile, x.reshape(b * t, hidden), outputs,
                  weights.reshape(b * t, k), token_mask.reshape(-1), lead=1)
    return y.reshape(x.shape)


def on_mesh(x, h, weights, experts, token_mask, gate, up, down, *, rules=DEFAULT_RULES,
            split_tokens: bool = False) -> jax.Array:
    """The invariant block's forward, ``x + MoE(h)``, on one device or, under the mesh
    in context, per device inside ``jax.shard_map`` with the experts where ``rules`` put
    them (the module docstring).

    Args:
      x: ``[B, T, H]`` the residual stream; h: ``[B, T, H]`` normed hidden states, the
        compute dtype.
      weights: float32 ``[B, T, k]``; experts: int32 ``[B, T, k]`` (the router's choice).
      token_mask: bool ``[B, T]``: the real tokens (padding adds 0).
      gate, up: ``[E, H, I]``; down: ``[E, I, H]``; the dtype of ``h``.
      rules: the logical -> mesh axis rules the experts are placed by.
      split_tokens: the rows' tokens are split over ``context`` (the trainer's forward,
        ``models.invariant.shard_axes``).

    Returns:
      ``[B, T, H]`` in the dtype of ``x``.

    Raises:
      ValueError: rows that do not split over the batch axes (``jax.shard_map``), or
        experts placed over a mesh axis the rows are not split over (the axes named).
    """
    axes = shard_axes(split_tokens)
    if axes is None:
        return _local(x, h, weights, experts, token_mask, gate, up, down)
    mesh = jax.sharding.get_abstract_mesh()
    spec = _nontrivial(logical_to_mesh(("expert", "embed", "mlp"), mesh, rules, gate.shape,
                                       "MoE gate_proj"), mesh)
    down_spec = _nontrivial(logical_to_mesh(("expert", "mlp", "embed"), mesh, rules,
                                            down.shape, "MoE down_proj"), mesh)
    expert_axes = _axes(spec[0])
    rows = axes[0] or ()
    if not set(expert_axes) <= set(rows):
        raise ValueError(f"numerics='invariant' needs the experts split over axes the rows "
                         f"are split over {rows}; the rules put them over {expert_axes}")
    # the experts as placed, split on their hidden dimension too (gathered inside, as the
    # default dispatch does); never on their MLP width (a tensor axis: refused)
    spec, down_spec = P(*spec[:2]), P(down_spec[0], None, down_spec[2])
    tokens = P(*axes)
    names = set(free_axes(mesh))
    body = functools.partial(_local, expert_axes=expert_axes, gather_axes=_axes(spec[1]),
                             down_axes=_axes(down_spec[2]))
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens,) * 5 + (spec, spec, down_spec),
                         out_specs=tokens, axis_names=names, check_vma=False)(
        x, h, weights, experts, token_mask, gate, up, down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def values_with_gradient_of(forward, default, *args):
    """``forward(*args)``, differentiated as ``default(*args)``: the values are the
    sampler's, the gradient the default path's. The last two ``args`` (int experts, bool
    token mask) get no cotangent."""
    return forward(*args)


def _values_fwd(forward, default, *args):
    return forward(*args), args


def _values_bwd(forward, default, args, dout):
    *diff, experts, token_mask = args
    _, vjp = jax.vjp(lambda *d: default(*d, experts, token_mask), *diff)
    return (*vjp(dout), None, None)


values_with_gradient_of.defvjp(_values_fwd, _values_bwd)
