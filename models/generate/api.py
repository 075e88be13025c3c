"""What the rollout engines share: the settings of a call, the draw of one decode step,
the record of the sampled tokens.

A call's rows are numbered ``0 .. B-1`` in the order the caller gave them (``G``
consecutive samples per prompt when ``group_size = G``); padding rows come after them.
Each row is a **request**: prompt ``r // G`` under its request id (the prompt's index in
the call, unless the caller names ids) and sample ``r % G`` of its group. A request's
draw depends only on the key, its request id, its sample index and the decode step:
step ``t`` draws with ``request_key(key, request, sample, t)`` (``jaxhead.sample`` with
one key per row), never with the row's place, bucket, batch or shard. So an engine may
prefill each prompt once, drop finished rows, admit waiting ones or reorder rows, and
the same request in another call draws the same tokens from the same logits (only float
rounding of a changed batch shape moves a logit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxhead
from models.invariant import head_logprobs, head_weight_split, row_tiled
from models.mesh import BATCH_AXES, active_mesh, present
from models.transformer import moe_layers

#: Each recorded field's value after a row's last token: token, log-prob, min_logit,
#: logmass.
FILL = (0, 0.0, -jnp.inf, 0.0)


class Truncation(NamedTuple):
    """Truncated sampling settings (``jaxhead.sample``): ``top_k`` (0: off), ``top_p``
    (1: off), ``min_p`` (0: off); any combination, the support is their intersection."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0


class Decoding(NamedTuple):
    """The static settings of a compiled decoder.

    Attributes:
      max_new_tokens: T, the most tokens a row decodes (a row's own budget may be lower).
      stop_ids: a row ends after drawing any of these.
      num_valid: only ids below it are drawn.
      truncated: the sampler path: True, top-k / top-p / min-p from full float32 logits
        (the settings traced); False, jaxhead's chunked Gumbel-max (no ``[B, V]`` logits).
      record_routes: an MoE model's engine also records the experts every token it runs
        used at every MoE layer (``record_routes``; for routing replay).
    """

    max_new_tokens: int
    stop_ids: tuple[int, ...]
    num_valid: int
    truncated: bool
    record_routes: bool = False


def along_batch(tree):
    """``tree`` with every array of rank >= 1 constrained to be split along its leading
    (batch) axis over the active mesh's batch axes; unchanged without a mesh."""
    mesh = active_mesh()
    if mesh is None:
        return tree
    spec = P(present(mesh, BATCH_AXES))
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, spec) if x.ndim else x, tree)


def request_key(key: jax.Array, request, sample, step) -> jax.Array:
    """The key of decode step ``step`` of sample ``sample`` of request ``request``:
    ``fold_in(fold_in(fold_in(key, request), sample), step)``; int32 arrays of one shape
    (broadcast) give keys of that shape."""
    request, sample, step = jnp.broadcast_arrays(jnp.asarray(request, jnp.int32),
                                                 jnp.asarray(sample, jnp.int32),
                                                 jnp.asarray(step, jnp.int32))

    def one(r, s, t):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, r), s), t)

    for _ in range(request.ndim):
        one = jax.vmap(one)
    return one(request, sample, step)


def row_requests(request_ids, prompts: int, group_size: int, rows: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Host int32 ``(request, sample)`` ``[rows]`` of a call's rows: row ``r < prompts x
    group_size`` is sample ``r % G`` of request ``request_ids[r // G]``; padding rows after
    them repeat the last request's ids (their draws are dropped).

    Args:
      request_ids: None (the prompts' indices ``0 .. prompts-1``) or ``prompts`` distinct
        ints in ``[0, 2**31)``, e.g. a dataset's problem index.

    Raises:
      ValueError: ``request_ids`` of the wrong length, not integers, out of range or
        repeated (named).
    """
    if request_ids is None:
        ids = np.arange(prompts, dtype=np.int64)
    else:
        ids = np.asarray(request_ids)
        if ids.shape != (prompts,) or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"request_ids must be {prompts} ints (one per prompt), got "
                             f"{request_ids!r}")
        if ids.size and (ids.min() < 0 or ids.max() >= 2 ** 31):
            raise ValueError(f"request_ids must be in [0, 2**31), got {ids.tolist()}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"request_ids must be distinct (two requests would draw the "
                             f"same noise), got {ids.tolist()}")
    r = np.minimum(np.arange(rows), prompts * group_size - 1)
    return ids[r // group_size].astype(np.int32), (r % group_size).astype(np.int32)


def draw(model, hidden: jax.Array, key: jax.Array, step, temperature, trunc,
         d: Decoding, request: jax.Array, sample: jax.Array) -> jaxhead.Sample:
    """Decode step ``step``'s draw for ``hidden`` ``[R, H]``: row ``i`` is sample
    ``sample[i]`` of request ``request[i]`` (int32 ``[R]``) and draws with
    ``request_key(key, request[i], sample[i], step)``; ``step`` an int32 scalar, or ``[R]``
    when the rows are at different steps.

    Under ``numerics="invariant"`` (``models.invariant``) the draw runs on row tiles of one
    shape, truncated or not (the same request draws the same token in any batch; on a mesh
    each device draws its own rows), and the recorded log-prob is
    ``models.invariant.head_logprobs`` of the drawn token at the sampling temperature (1
    when greedy), on the support it was drawn from when truncated (``min_logit``, the
    tile's threshold): the value the trainer's forward computes for it
    (``Transformer.token_logprobs`` with that ``min_logit``, ``loss.logprob_support =
    "sampler"``), bit for bit. ``logmass`` is then the tile's own (``jaxhead.sample``'s),
    for the truncated-mass metric: ``logprobs + logmass`` is the full-softmax log-prob only
    to rounding.
    """
    dtype = model.lm_head.dtype or hidden.dtype
    kw = dict(zip(Truncation._fields, trunc)) if d.truncated else {}
    keys = request_key(key, request, sample, step)
    if model.cfg.numerics == "invariant":
        return _invariant_draw(model, hidden.astype(dtype), keys, temperature, kw, d)
    return jaxhead.sample(hidden.astype(dtype), model.lm_head.weight(dtype),
                          keys, temperature=temperature,
                          softcap=model.lm_head.softcap, num_valid=d.num_valid,
                          weight_layout=model.lm_head.weight_layout, **kw)


def _invariant_draw(model, hidden, keys, temperature, truncation: dict, d: Decoding
                    ) -> jaxhead.Sample:
    """``draw`` under ``numerics="invariant"``: tokens (and a truncated draw's support) from
    row tiles, log-probs from ``head_logprobs``."""
    head = model.lm_head
    weight = head.weight(hidden.dtype)
    # on a mesh each device holds H / n of the weight's hidden dimension (chunks gathered
    # where used)
    axes, spec = head_weight_split(head, hidden.shape[-1])

    def tile(w, h, rows):
        out = jaxhead.sample(h, w, jnp.take(keys, rows, axis=0),
                             temperature=temperature, softcap=head.softcap,
                             num_valid=d.num_valid, weight_layout=head.weight_layout,
                             weight_hidden_axes=axes, **truncation)
        return out.tokens, out.min_logit, out.logmass

    rows = jnp.arange(hidden.shape[0], dtype=jnp.int32)
    tokens, min_logit, logmass = row_tiled(tile, hidden, rows, lead=1,
                                           placed=((weight, spec),))
    t = jnp.asarray(temperature, jnp.float32)
    if not d.truncated:  # the whole softmax: no support, all of its mass
        min_logit = jnp.full(tokens.shape, -jnp.inf, jnp.float32)
        logmass = jnp.zeros(tokens.shape, jnp.float32)
    logp = head_logprobs(head, hidden, tokens, None, temperature=jnp.where(t > 0, t, 1.0),
                         with_entropy=False,
                         min_logit=min_logit if d.truncated else None).logprobs
    return jaxhead.Sample(tokens, logp, min_logit, logmass)


#: A recorded route's value where no token ran (prompt padding, a completion's last
#: token, after it): ``Transformer``'s routing replay then takes the token's own top-k.
NO_ROUTE = -1


def record_routes(model, routes: jax.Array, real: jax.Array) -> jax.Array:
    """The routes an engine records of one model call: ``DecoderOutput.routes`` int32
    ``[R, T, M, k]`` with ``NO_ROUTE`` where ``real`` (bool ``[R, T]``) is False.

    A rollout's routes are a row's prompt routes ``[W, M, k]`` (prefill: the prompt's
    tokens) and its completion routes ``[T, M, k]``: decode step ``t`` runs completion
    token ``t - 1`` and records its experts at index ``t - 1``, so a completion of ``n``
    tokens has routes at ``0 .. n - 2`` (its last token is drawn, never run). Memory:
    ``M x k`` int32 per token (the 30B preset: 48 x 8 x 4 B = 1.5 KiB).

    Raises:
      ValueError: ``model`` has no MoE layer (``routes`` None).
    """
    if routes is None:
        raise ValueError(f"recording routes needs an MoE model; {type(model).__name__} "
                         f"has no MoE layer (num_experts = {model.cfg.num_experts})")
    return jnp.where(real[:, :, None, None], routes, NO_ROUTE)


def empty_routes(model, rows: int, steps: int) -> jax.Array:
    """int32 ``[rows, steps, M, k]`` holding ``NO_ROUTE`` (M: the MoE layers)."""
    cfg = model.cfg
    return jnp.full((rows, steps, moe_layers(cfg), cfg.num_experts_per_tok), NO_ROUTE,
                    jnp.int32)


def empty_record(rows: int, steps: int) -> tuple[jax.Array, ...]:
    """``(tokens, logprobs, min_logit, logmass)`` ``[rows, steps]`` holding ``FILL``."""
    dtypes = (jnp.int32, jnp.float32, jnp.float32, jnp.float32)
    return tuple(jnp.full((rows, steps), f, t) for f, t in zip(FILL, dtypes))


def masked(sample, done: jax.Array) -> tuple[jax.Array, ...]:
    """The sample's four fields, ``FILL`` where ``done``."""
    return tuple(jnp.where(done, f, x) for f, x in zip(FILL, sample))


def ended(tokens: jax.Array, length: jax.Array, budgets: jax.Array, d: Decoding
          ) -> tuple[jax.Array, jax.Array]:
    """``(stopped, out_of_budget)`` bool ``[R]`` after a row drew ``tokens`` and holds
    ``length`` tokens."""
    return jnp.isin(tokens, jnp.asarray(d.stop_ids, jnp.int32)), length >= budgets


class Work(NamedTuple):
    """What an engine computed for one call (host ints).

    Attributes:
      prefill_tokens: prompt tokens prefilled (the prompts' lengths summed; padding slots
        not counted).
      prefill_slots: prefill rows x their padded width, padding rows included.
      decode_row_steps: decode steps x the rows computed at each (padding rows included).
      kv_slots: the KV cache's slots per layer over all devices: the most allocated at
        once (its memory).
      kv_slots_held: the most of them the rows held at once (a paged cache's pool is
        allocated in steps, so it may hold more than its rows do; else ``kv_slots``).
    """

    prefill_tokens: int
    prefill_slots: int
    decode_row_steps: int
    kv_slots: int
    kv_slots_held: int


#: ``jit(fn, **jit_kwargs) -> compiled fn``: how an engine compiles its functions (the
#: trainer passes one that compiles under its mesh); ``read(tree) -> host tree`` reads device arrays
#: back (on several processes every process reads every row); ``place(dict of host arrays)
#: -> dict of device arrays`` puts host rows where the engine's functions take them.
Jit = Callable[[Callable], Callable]
Read = Callable[[object], object]
Place = Callable[[dict], dict]


class Layout(NamedTuple):
    """Where an engine's arrays live on a mesh (``jax.sharding.Sharding`` s): the
    parameters' (a pytree), an array split by rows over the batch axes, a replicated one.
    None for an engine on one device."""

    params: object
    rows: object
    replicated: object


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an engine is built with besides the model and ``Decoding`` (every engine takes
    them all and reads its own).

    Attributes:
      row_multiple: the batch shards n (rows are split in order over them).
      chunk: the most decode steps between compactions (``compact``).
      rung_multiple, growth: the row ladder (``compact``; ``rung_multiple`` a multiple of
        ``row_multiple``).
      page_size: slots per page of the paged KV cache (``compact``).
      max_rows: the most rows decoding at once, 0 every row (``compact``).
    """

    row_multiple: int = 1
    chunk: int = 64
    rung_multiple: int = 8
    growth: float = 1.5
    page_size: int = 64
    max_rows: int = 0
