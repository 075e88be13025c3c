"""Invariant numerics (``ModelConfig.numerics = "invariant"``): a token's results do not
depend on the batch it is computed in.

XLA:CPU's matmul is not batch-invariant: the rows of ``[M, H] @ [H, F]`` differ in their
last bits with ``M`` (its blocking and vectorisation follow the shape). A computation on a
fixed ``[ROW_TILE, ...]`` shape is: so every per-token computation of the decoder (norms,
projections, q/k norms, RoPE, the MLP) runs under ``row_tiled`` on row tiles of one shape,
attention reads its keys in blocks at fixed absolute positions
(``models.attention.invariant``), and the head's log-probs come from one tiled call shared
by the trainer and the sampler (``head_logprobs``). The sampler's log-probs of a
completion then equal the trainer's bit for bit, on the same hardware, dtype and device
count. The approach is that of the batch-invariant kernels behind vLLM's and SGLang's
deterministic modes (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025:
fixed tiles, no split reductions), written here with fixed shapes under ``lax.map``.

MoE layers run their router and combine per row tile too, and their experts in
expert-major tiles of one shape at the dropless FLOPs (``models.moe.invariant``), so the
sampler and the trainer choose the same experts and get the same bits from them.

On a mesh (``on_shards``) every one of these computations runs inside ``jax.shard_map``:
each device takes its own rows (split over the batch axes ``data`` / ``fsdp`` /
``expert``, and a row's tokens over ``context`` where the trainer splits them), the
weights are all-gathered (fsdp's gather) and the device runs the one-device code on them,
so no matmul is ever split over its contraction dimension and a token's result is the
one-device result. MoE experts stay sharded over ``expert`` (``models.moe.invariant
.on_mesh``: each device computes the pairs of the experts it holds, an exact
reduce-scatter returns them).
A ``tensor`` axis would split the heads' and the MLP's contractions (split-K): refused.

What the mode does not cover is refused by name (``check_config``, ``check_mesh``): a
``tensor`` axis, and op choices without an invariant variant.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxhead
from models.mesh import BATCH_AXES, CONTEXT_AXIS, free_axes

#: ``ModelConfig.numerics`` values.
NUMERICS = ("default", "invariant")
#: Rows per tile of every per-token computation (and of the head's token chunk, and of
#: the attention's queries). Decode batches are padded to it: 32 costs a rollout of 32
#: rows nothing over 16 and halves the update's tile loop (docs/numerics.md, measured
#: with benchmarks/invariant.py).
ROW_TILE = 32
#: Tiles per step of the loop over row tiles (``map_tiles``): XLA:CPU runs a loop step
#: of small ops at a fixed cost, so the loop body holds this many tile computations, each
#: still a computation of one ``[ROW_TILE, ...]`` shape (docs/numerics.md, "Its price").
UNROLL = 8
#: Vocabulary columns per chunk of the head's scan, on both sides.
VOCAB_CHUNK = 8192
#: The only attention implementations the mode accepts (``"auto"`` resolves to it).
ATTENTION = ("auto", "invariant")


def check_config(cfg) -> None:
    """Check ``cfg.numerics`` and, under ``"invariant"``, what the mode cannot run yet.

    MoE layers run their invariant block (``models.moe.invariant``: dropless, the
    experts in expert-major tiles); ``moe_token_chunk`` only bounds memory and is moot
    there (the block takes a device's tokens in bounded rounds of its own).

    Raises:
      ValueError: an unknown ``numerics``; under ``"invariant"``, an ``attention_impl``
        other than ``"auto"`` / ``"invariant"``, an ``expert_dispatch`` other than
        ``"auto"`` (the all-to-all paths have no invariant variant) or an
        ``expert_capacity_factor`` (a capacity drops pairs by the other tokens of the
        batch); the field and its value named.
    """
    if cfg.numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {cfg.numerics!r}")
    if cfg.numerics != "invariant":
        return
    if cfg.num_experts and cfg.expert_dispatch != "auto":
        raise ValueError(f"numerics='invariant' runs the MoE block per row tile on one "
                         f"device; expert_dispatch={cfg.expert_dispatch!r} (an all-to-all "
                         f"path) has no invariant variant: leave it at 'auto'")
    if cfg.num_experts and cfg.expert_capacity_factor is not None:
        raise ValueError(f"numerics='invariant' is dropless; expert_capacity_factor="
                         f"{cfg.expert_capacity_factor!r} drops a token's pairs by the "
                         f"other tokens of its batch: set it to None")
    if cfg.attention_impl not in ATTENTION:
        raise ValueError(f"numerics='invariant' needs attention_impl in {ATTENTION}; "
                         f"attention_impl={cfg.attention_impl!r} has no invariant variant")


def check_mesh(mesh) -> None:
    """Refuse a mesh the mode cannot run on: one with a ``tensor`` axis of more than one
    device (it splits the attention heads' and the MLP's matmuls over their contraction
    dimension on one side and not the other: split-K sums in another order). The batch
    axes and ``context`` are covered (``on_shards``).

    Raises:
      ValueError: ``mesh`` (a ``jax.sharding.Mesh`` / ``AbstractMesh`` or None) has
        ``tensor > 1`` (its shape named).
    """
    if mesh is not None and dict(mesh.shape).get("tensor", 1) > 1:
        raise ValueError(f"numerics='invariant' cannot split matmuls over a tensor axis: the "
                         f"mesh has tensor={dict(mesh.shape)['tensor']} ({dict(mesh.shape)}); "
                         f"use the batch axes (data, fsdp, expert) or context instead")


def shard_axes(split_tokens: bool = False) -> tuple | None:
    """The mesh axes ``on_shards`` splits a ``[B, T, ...]`` array's two leading dimensions
    over under the mesh in context: ``(rows, tokens)``, rows over the batch axes of more
    than one device, tokens over ``context`` when ``split_tokens`` (the trainer's packed
    rows; a decode step's and a prefill's tokens are whole on every ``context`` device).
    None: no mesh of more than one free (not manual) device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    free = {name: size for name, size in free_axes(mesh).items() if size > 1}
    if not free:
        return None
    rows = tuple(a for a in BATCH_AXES if a in free) or None
    tokens = CONTEXT_AXIS if split_tokens and CONTEXT_AXIS in free else None
    return rows, tokens


def on_shards(fn: Callable, *xs, lead: int = 1, split_tokens: bool = False,
              placed: tuple = (), modules: tuple = ()):
    """``fn(*modules, *xs, *placed arrays)`` run per device inside
    ``jax.shard_map`` under the mesh in context (every free axis manual), each ``xs``
    array of rank >= ``lead`` split along its leading dimension over the batch axes (and,
    with ``lead=2`` and ``split_tokens``, its second over ``context``; ``shard_axes``),
    scalars and None whole on every device, ``placed`` ``(array, PartitionSpec)`` pairs
    split as their specs say (``PartitionSpec()``: whole); ``fn``'s outputs split like
    ``xs``. The parameters of ``modules`` (``nnx.Module`` s) enter whole too
    (all-gathered: fsdp's gather) and ``fn`` gets the modules rebuilt from them inside
    the manual region (an
    array ``fn`` closes over instead would have its gradient formed there, which JAX
    refuses). Each device thus runs the one-device computation of its own rows. Without
    such a mesh: ``fn(*modules, *xs, *placed arrays)``.

    Raises:
      ValueError: (``jax.shard_map``) a leading dimension that does not split evenly.
    """
    axes = shard_axes(split_tokens)
    arrays = tuple(a for a, _ in placed)
    if axes is None:
        return fn(*modules, *xs, *arrays)
    mesh = jax.sharding.get_abstract_mesh()
    spec, whole = jax.sharding.PartitionSpec(*axes[:lead]), jax.sharding.PartitionSpec()
    graph, state = nnx.split(modules)
    leaves, tree = jax.tree.flatten(state)
    n = len(xs) + len(placed)

    def body(*args):
        local = nnx.merge(graph, jax.tree.unflatten(tree, args[n:]))
        return fn(*local, *args[:n])

    specs = (tuple(None if x is None else spec if jnp.ndim(x) >= lead else whole for x in xs)
             + tuple(p for _, p in placed)
             + (whole,) * len(leaves))
    names = set(free_axes(mesh))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec, axis_names=names,
                         check_vma=False)(*xs, *arrays, *leaves)


def head_weight_split(lm_head, hidden_size: int, split_tokens: bool = False):
    """``(axes, PartitionSpec)``: how ``on_shards`` takes the head's weight (``head_logprobs``
    and the sampler's draw) under the mesh in context: its hidden dimension split over the
    free axes of more than one device, in the mesh's order, as long as their product
    divides ``hidden_size``, so each device holds ``H / n`` rows of it and jaxhead gathers
    one vocab chunk at a time (``weight_hidden_axes``). ``((), PartitionSpec())`` (whole)
    off a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if shard_axes(split_tokens) is None:
        return (), jax.sharding.PartitionSpec()
    axes, n = [], 1
    for name, size in free_axes(mesh).items():
        if size > 1 and hidden_size % (n * size) == 0:
            axes.append(name)
            n *= size
    split = tuple(axes) or None
    dims = (split, None) if lm_head.weight_layout == "hv" else (None, split)
    return tuple(axes), jax.sharding.PartitionSpec(*dims)


def row_tiled(fn: Callable, *xs: jax.Array, lead: int = 2, tile: int = ROW_TILE,
              split_tokens: bool = False, modules: tuple = (), placed: tuple = ()):
    """``fn(*modules, *placed arrays, *tiles)`` applied to ``xs`` in row tiles of one shape
    (on a mesh, each device its own rows: ``on_shards``; ``split_tokens``, ``modules``, the
    ``nnx.Module`` s ``fn`` reads, and ``placed``, ``(array, PartitionSpec)`` pairs each
    device gets its part of, as there).

    Args:
      fn: ``fn(*modules, *placed arrays, *tiles) -> pytree`` of arrays: ``[tile, ...]``
        in, ``[tile, ...]`` out, row ``i`` of each output a function of row ``i`` of the
        inputs only; a pure function of its arguments and of arrays it closes over
        (differentiable).
      xs: arrays whose first ``lead`` dimensions are the same (e.g. ``[B, T, H]`` hidden
        states and ``[B, T]`` positions with ``lead=2``): the token rows.
      lead: how many leading dimensions index the rows.
      tile: rows per tile.
      split_tokens: ``[B, T]`` rows whose tokens the mesh splits over ``context`` (the
        trainer's forward; ``shard_axes``).
      modules: the ``nnx.Module`` s ``fn`` reads its parameters from, passed to it first
        (on a mesh, rebuilt inside ``jax.shard_map``: ``on_shards``).
      placed: ``(array, PartitionSpec)`` pairs passed to ``fn`` after the modules, each
        device's part on a mesh (``on_shards``), the arrays whole without one.

    The rows (the ``lead`` dimensions flattened) are padded with zeros to a multiple of
    ``tile`` and mapped with ``map_tiles`` over ``[rows / tile, tile, ...]``, so ``fn``
    compiles once for one shape; the padding rows' outputs are dropped. Only these
    forward values must be the sampler's: the gradient (to ``xs`` and to the arrays
    ``fn`` closes over, hoisted by ``jax.closure_convert``) is that of ``fn`` on all the
    rows at once (``jax.vmap`` over the tiles), recomputed in the backward pass. It is
    the gradient of the same function to float rounding, without a loop of tile-sized
    backward steps and the residuals each would save (the same split as the invariant
    attention's, ``models.attention.invariant.self_attention``).

    Returns:
      ``fn``'s pytree with the ``lead`` dimensions restored.

    Raises:
      ValueError: the arrays' leading dimensions differ (shapes named).
    """
    m, k = len(modules), len(xs)
    return on_shards(
        lambda *a: _row_tiled(functools.partial(fn, *a[:m], *a[m + k:]), *a[m:m + k],
                              lead=lead, tile=tile),
        *xs, lead=min(lead, 2), split_tokens=split_tokens, modules=modules, placed=placed)


def _row_tiled(fn: Callable, *xs: jax.Array, lead: int, tile: int):
    dims = xs[0].shape[:lead]
    if any(x.shape[:lead] != dims for x in xs):
        raise ValueError(f"row_tiled: the first {lead} dimensions differ: "
                         f"{[x.shape for x in xs]}")
    n = math.prod(dims)
    padded = -(-n // tile) * tile

    def tiles(x):
        x = pad_rows(x.reshape(n, *x.shape[lead:]), padded)
        return x.reshape(padded // tile, tile, *x.shape[1:])

    tiled = tuple(tiles(x) for x in xs)
    converted, consts = jax.closure_convert(fn, *(x[0] for x in tiled))
    out = _mapped(converted, tiled, tuple(consts))
    return jax.tree.map(
        lambda y: y.reshape(padded, *y.shape[2:])[:n].reshape(*dims, *y.shape[2:]), out)


def map_tiles(fn: Callable, tiled):
    """``jax.lax.map(fn, tiled)``: ``fn`` over the leading axis of the pytree ``tiled``
    (``[tiles, tile, ...]`` arrays), ``UNROLL`` tiles per step of the loop (a
    ``jax.lax.scan`` with ``unroll``). Each tile's inputs and outputs pass an
    ``optimization_barrier``, so every tile stays its own computation of one shape:
    without it XLA:CPU rewrote the unrolled copies together (a benchmarks/invariant.py
    rollout's log-probs then moved by up to 0.023 from the trainer's), with it a tile's
    result is the one ``lax.map`` gives, wherever it sits in the loop
    (tests/models/test_invariant_numerics.py, tests/models/test_invariant_scan.py). The
    loop's fixed cost per step is paid ``UNROLL`` times less often."""
    barrier = jax.lax.optimization_barrier
    return jax.lax.scan(lambda _, t: (None, barrier(fn(barrier(t)))), None, tiled,
                        unroll=UNROLL)[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mapped(fn, tiled, consts):
    """``fn(*tile, *consts)`` over ``tiled`` (``[tiles, tile, ...]`` each): ``map_tiles``."""
    return map_tiles(lambda t: fn(*t, *consts), tiled)


def _mapped_fwd(fn, tiled, consts):
    return _mapped(fn, tiled, consts), (tiled, consts)


def _mapped_bwd(fn, res, dout):
    tiled, consts = res

    def whole(tiled, consts):  # every tile at once: one large matmul per op
        return jax.vmap(lambda *t: fn(*t, *consts))(*tiled)

    _, vjp = jax.vjp(whole, tiled, consts)
    return vjp(dout)


_mapped.defvjp(_mapped_fwd, _mapped_bwd)


def pad_rows(x: jax.Array, rows: int, value=0) -> jax.Array:
    """``x`` ``[n, ...]`` padded with ``value`` to ``rows`` rows."""
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1),
                   constant_values=value)


def head_logprobs(lm_head, hidden: jax.Array, labels: jax.Array, keep, *, temperature,
                  bucket: int | None = None, with_entropy: bool = True,
                  min_logit: jax.Array | None = None, split_tokens: bool = False
                  ) -> jaxhead.HeadOutput:
    """The head's float32 log-probs (and entropy) of ``labels``, computed the one way both
    the trainer (``Transformer.token_logprobs``) and the sampler
    (``models.generate.api.draw``) compute them under ``numerics="invariant"``.

    The rows are flattened and padded to a multiple of ``ROW_TILE`` (padding rows not
    kept), ``bucket`` is rounded up to a multiple of it, and ``jaxhead.token_logprobs``
    runs with ``impl="xla"`` and ``XlaConfig(token_chunk=ROW_TILE, vocab_chunk=
    VOCAB_CHUNK, vocab_outer=True)``: the kept rows are compacted into the bucket (a
    gather, also when every row is kept) and go through ``[ROW_TILE, H] x [H,
    VOCAB_CHUNK]`` tiles, whatever the batch, the bucket or the row they sit in. The
    entropy is always computed (its flag changes the compiled tile) and returned only
    ``with_entropy``. On a mesh each device does this for its own rows (``on_shards``),
    ``bucket`` is a shard's, and the head's weight enters split along its hidden dimension
    over the mesh (``head_weight_split``): each vocab chunk (``VOCAB_CHUNK`` entries, all
    of H) is all-gathered where it is used (``token_logprobs(weight_hidden_axes=...)``), so no device holds the whole
    weight (it held all of it: 0.58 GiB more for the 30B preset's decode) and the tiles are
    the one-device tiles.

    Args:
      lm_head: the model's ``jaxhead.LMHead``.
      hidden: ``[..., H]``; labels: int ``[...]``; keep: bool ``[...]`` or None (all).
      temperature: scalar or float ``[...]`` (> 0).
      bucket: as ``jaxhead.token_logprobs`` (None: chosen on the host from a concrete
        ``keep``, on one device); rounded up to a multiple of ``ROW_TILE``.
      min_logit: None, or float32 ``[...]``: each label's truncated sampling support, as
        ``jaxhead.token_logprobs`` (``-inf``: the whole softmax).
      split_tokens: ``[B, S]`` rows whose tokens are split over ``context`` (``on_shards``).

    Returns:
      ``jaxhead.HeadOutput`` float32 ``[...]`` (0 where not kept).

    Raises:
      ValueError / TypeError: as ``jaxhead.token_logprobs``.
    """
    shape = labels.shape
    keep = jnp.ones(shape, bool) if keep is None else keep
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), shape)
    weight = lm_head.weight(lm_head.dtype or hidden.dtype)  # passed, not closed over
    axes, spec = head_weight_split(lm_head, hidden.shape[-1], split_tokens)

    def local(hidden, labels, keep, t, min_logit, weight):
        return _head_logprobs(lm_head, weight, hidden, labels, keep, t, bucket, min_logit,
                              axes)

    out = on_shards(local, hidden, labels, keep, t, min_logit, lead=min(len(shape), 2),
                    split_tokens=split_tokens, placed=((weight, spec),))
    return jaxhead.HeadOutput(out.logprobs, out.entropy if with_entropy else None)


def _head_logprobs(lm_head, weight, hidden, labels, keep, temperature, bucket, min_logit,
                   hidden_axes=()) -> jaxhead.HeadOutput:
    """``head_logprobs`` on one device (``keep``, ``temperature`` of ``labels``' shape;
    ``weight``: ``lm_head``'s in the compute dtype, split over ``hidden_axes``)."""
    shape = labels.shape
    n = math.prod(shape)
    rows = -(-max(n, 1) // ROW_TILE) * ROW_TILE
    h = pad_rows(hidden.reshape(n, hidden.shape[-1]).astype(weight.dtype), rows)
    y = pad_rows(labels.reshape(n), rows)
    # always a keep mask: the rows reach the head through jaxhead's compaction (a gather
    # at indices computed at run time), never as a padded array the compiler could narrow
    k = pad_rows(keep.reshape(n), rows, False)
    t = pad_rows(temperature.reshape(n), rows, 1.0)
    if min_logit is not None:
        min_logit = pad_rows(jnp.asarray(min_logit, jnp.float32).reshape(n), rows, -jnp.inf)
    if bucket is None:
        try:
            bucket = jaxhead.bucket_size(int(np.count_nonzero(np.asarray(k))), rows)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            bucket = rows
    bucket = min(-(-int(bucket) // ROW_TILE) * ROW_TILE, rows)
    out = jaxhead.token_logprobs(
        h, weight, y, k, temperature=t, softcap=lm_head.softcap,
        with_entropy=True, bucket=bucket, impl="xla",
        config=jaxhead.XlaConfig(token_chunk=ROW_TILE, vocab_chunk=VOCAB_CHUNK,
                                 vocab_outer=True),
        weight_layout=lm_head.weight_layout, ignore_index=None, min_logit=min_logit,
        weight_hidden_axes=hidden_axes)
    return jaxhead.HeadOutput(out.logprobs[:n].reshape(shape),
                              out.entropy[:n].reshape(shape))
