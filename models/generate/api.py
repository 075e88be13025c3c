"""What the rollout engines share: the settings of a call, the draw of one decode step,
the record of the sampled tokens, and the choice of engine (``IMPLEMENTATIONS``).

A call's rows are numbered ``0 .. B-1`` in the order the caller gave them (``G``
consecutive samples per prompt when ``group_size = G``); padding rows come after them. A
row's draw depends only on the key, the decode step and that global index: step ``t``
draws with ``fold_in(key, t)`` and row ``r`` takes the seed words of row ``r`` of a
``num_rows``-row draw (``jaxhead.sample``'s ``row_ids``), so an engine may prefill each
prompt once, drop finished rows or reorder rows without changing a sampled token (only
float rounding of a changed batch shape moves a logit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxhead
from models.mesh import BATCH_AXES, active_mesh, present

#: The engines: ``reference`` (the whole batch decodes until its longest row stops) and
#: ``compact`` (one prefill per prompt; finished rows leave the batch between chunks).
IMPLEMENTATIONS = ("reference", "compact")

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
    """

    max_new_tokens: int
    stop_ids: tuple[int, ...]
    num_valid: int
    truncated: bool


def along_batch(tree):
    """``tree`` with every array of rank >= 1 constrained to be split along its leading
    (batch) axis over the active mesh's batch axes; unchanged without a mesh."""
    mesh = active_mesh()
    if mesh is None:
        return tree
    spec = P(present(mesh, BATCH_AXES))
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, spec) if x.ndim else x, tree)


def draw(model, hidden: jax.Array, key: jax.Array, step, temperature, trunc,
         d: Decoding, row_ids: jax.Array, num_rows: int) -> jaxhead.Sample:
    """Decode step ``step``'s draw for ``hidden`` ``[R, H]``: rows ``row_ids`` ``[R]`` of
    a ``num_rows``-row batch, with ``fold_in(key, step)``; ``step`` an int32 scalar, or
    ``[R]`` when the rows are at different steps (each row then draws with its own)."""
    dtype = model.lm_head.dtype or hidden.dtype
    kw = dict(zip(Truncation._fields, trunc)) if d.truncated else {}
    step = jnp.asarray(step)
    keys = (jax.random.fold_in(key, step) if step.ndim == 0 else
            jax.vmap(jax.random.fold_in, (None, 0))(key, step))
    return jaxhead.sample(hidden.astype(dtype), model.lm_head.weight(dtype),
                          keys, temperature=temperature,
                          softcap=model.lm_head.softcap, num_valid=d.num_valid,
                          weight_layout=model.lm_head.weight_layout, row_ids=row_ids,
                          num_rows=num_rows, **kw)


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
#: back (on several processes every process reads every row).
Jit = Callable[[Callable], Callable]
Read = Callable[[object], object]
