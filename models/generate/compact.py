"""``compact``: one prefill per prompt; finished rows leave the batch between chunks.

1. Prefill: each distinct prompt once (``[U, W]``, not ``[U x G, W]``); the G samples of a
   prompt take copies of its KV cache rows (a gather) and of its last hidden state, from
   which the first token of every row is drawn.
2. Decode in chunks of ``chunk`` steps (a ``while_loop`` that also ends when every row is
   done). Between chunks the host reads which rows are still active and, when a smaller
   rung of the static row ladder (``jaxhead.bucket_ladder``) holds them, gathers them and
   their cache rows into that rung: few shapes (one compiled chunk per rung), and the
   decode work follows the rows' lengths (``Σ lengths`` rounded up to whole chunks, times
   at most the ladder's growth) instead of ``B x longest``.

Rows keep their global index (``row_ids``) wherever they move, and draw with it
(``models.generate.api``): the tokens are the reference engine's for the same key.
Rows are written into the ``[B, T]`` record by that index (padding rows carry the index
``B``, which the scatter drops).

Not done here: the G samples hold copies of the prompt's KV (no block table), the cache
holds ``W + max_new_tokens`` slots per row from the start and a decode step attends over
all of them (masked), and rows never refill freed slots (no continuous batching).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxhead
from models.cache import KVCache
from models.generate.api import (
    Decoding,
    Jit,
    Read,
    Work,
    along_batch,
    draw,
    empty_record,
    ended,
    masked,
)


class Rows(NamedTuple):
    """The decoding rows (a pytree, ``[R]`` each but the cache's index).

    Attributes:
      row_ids: int32 global row index (``num_rows`` for padding).
      tokens: int32 the last drawn token.
      lens: int32 the row's prompt length.
      budgets: int32 the most tokens the row decodes.
      length: int32 tokens decoded so far.
      done, stopped: bool: the row ended; it ended on a stop token.
      cache: the rows' ``KVCache`` (``[R, W + T]`` slots).
    """

    row_ids: jax.Array
    tokens: jax.Array
    lens: jax.Array
    budgets: jax.Array
    length: jax.Array
    done: jax.Array
    stopped: jax.Array
    cache: KVCache


def _widen(cache: KVCache, slots: int) -> KVCache:
    """``cache`` with ``slots`` empty slots appended to every row."""
    def pad(x):
        return jnp.pad(x, [(0, 0), (0, slots)] + [(0, 0)] * (x.ndim - 2))

    return cache._replace(keys=tuple(map(pad, cache.keys)),
                          values=tuple(map(pad, cache.values)),
                          positions=pad(cache.positions), segment_ids=pad(cache.segment_ids))


def _take(tree, idx: jax.Array):
    """Rows ``idx`` of every array of rank >= 1 in ``tree`` (scalars kept)."""
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0) if x.ndim else x, tree)


def prefill(model, prompts, lens, source, row_ids, budgets, key, temperature, trunc,
            d: Decoding, num_rows: int) -> tuple[Rows, tuple[jax.Array, ...]]:
    """Prefill the distinct prompts ``[U, W]`` once and start ``R`` rows from them.

    Args:
      prompts, lens: int32 ``[U, W]`` right-padded prompts and ``[U]`` lengths.
      source, row_ids, budgets: int32 ``[R]``: each row's prompt, global index
        (``num_rows``: padding) and token budget.
      key, temperature, trunc, d: as ``models.generate.reference.generate``.
      num_rows: B, the rows of the call (the record's rows).

    Returns:
      ``(rows, record)``: the rows after their first token; ``record`` = ``(tokens,
      logprobs, min_logit, logmass)`` ``[B, T]``, ``lengths`` ``[B]``, ``stopped`` ``[B]``.
    """
    width, steps = prompts.shape[1], d.max_new_tokens
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), prompts.shape)
    out = model(prompts, pos, (pos < lens[:, None]).astype(jnp.int32),
                along_batch(model.init_cache(prompts.shape[0], width)))
    last = out.hidden[jnp.arange(prompts.shape[0]), lens - 1]
    cache = along_batch(_widen(_take(out.cache, source), steps - 1))
    first = draw(model, along_batch(last[source]), key, 0, temperature, trunc, d, row_ids,
                 num_rows)
    length = jnp.ones_like(row_ids)
    budgets = budgets.astype(jnp.int32)
    stopped, spent = ended(first.tokens, length, budgets, d)
    pad = row_ids >= num_rows
    rows = Rows(row_ids, first.tokens, lens[source], budgets, length, stopped | spent | pad,
                stopped & ~pad, cache)
    record = tuple(r.at[row_ids, 0].set(x, mode="drop")
                   for r, x in zip(empty_record(num_rows, steps), first))
    return along_batch(rows), _finish(along_batch(record) + _empty_ends(num_rows), rows)


def _empty_ends(num_rows: int) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros((num_rows,), jnp.int32), jnp.zeros((num_rows,), bool)


def _finish(record, rows: Rows):
    """``record`` with the rows' lengths and stop flags written at their global index."""
    *fields, lengths, stopped = record
    return (*fields, lengths.at[rows.row_ids].set(rows.length, mode="drop"),
            stopped.at[rows.row_ids].set(rows.stopped, mode="drop"))


def decode_chunk(model, rows: Rows, record, key, start, temperature, trunc, d: Decoding,
                 num_rows: int, chunk: int) -> tuple[Rows, tuple[jax.Array, ...], jax.Array]:
    """Decode steps ``[start, start + chunk)`` (fewer when every row ends or step T is
    reached) of ``rows``, writing their draws into ``record`` at their global index.

    Returns ``(rows, record, steps run)``.
    """

    def cond(c):
        k, rows, _ = c
        return (k < chunk) & (start + k < d.max_new_tokens) & ~jnp.all(rows.done)

    def body(c):
        k, r, record = c
        step = start + k
        p = (r.lens + step - 1)[:, None]
        o = model(r.tokens[:, None], p, jnp.ones_like(p), r.cache)
        new = masked(draw(model, o.hidden[:, 0], key, step, temperature, trunc, d,
                          r.row_ids, num_rows), r.done)
        *fields, lengths, stopped = record
        fields = [f.at[r.row_ids, step].set(x, mode="drop") for f, x in zip(fields, new)]
        length = r.length + (~r.done).astype(jnp.int32)
        stop, spent = ended(new[0], length, r.budgets, d)
        r = r._replace(tokens=new[0], length=length, done=r.done | stop | spent,
                       stopped=r.stopped | (stop & ~r.done), cache=along_batch(o.cache))
        return k + 1, along_batch(r), (*fields, lengths, stopped)

    k, rows, record = jax.lax.while_loop(cond, body, (jnp.int32(0), rows, record))
    return rows, _finish(record, rows), k


def gather_rows(rows: Rows, idx: jax.Array, valid: jax.Array, num_rows: int) -> Rows:
    """Rows ``idx`` ``[R']`` of ``rows``; where ``valid`` is False a padding row (done,
    global index ``num_rows``)."""
    out = _take(rows, idx)
    return along_batch(out._replace(done=out.done | ~valid,
                                    row_ids=jnp.where(valid, out.row_ids, num_rows)))


class CompactEngine:
    """The host side of ``compact``: compiles its three functions once per shape and
    drives the chunks.

    Args:
      merge: ``params -> model``.
      d: the static settings.
      chunk: decode steps between compactions (>= 1).
      rung_multiple: every rung of the row ladder below its top is a multiple of it (a
        multiple of ``row_multiple``).
      row_multiple: the rows of a call are padded to a multiple of it (the batch shards
        on a mesh): the ladder's top.
      growth: the ladder's growth (``jaxhead.bucket_ladder``): the decode work is at most
        about this factor over the rows' lengths rounded up to whole chunks.
      jit, read: how functions compile and device rows are read back (``models.generate.api``).

    Raises:
      ValueError: ``chunk < 1`` (named); a bad ladder (``jaxhead.bucket_ladder``).
    """

    def __init__(self, merge: Callable, d: Decoding, *, chunk: int, rung_multiple: int,
                 growth: float, row_multiple: int = 1, jit: Jit = jax.jit,
                 read: Read = jax.device_get):
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"decode chunk must be a positive int, got {chunk!r}")
        jaxhead.bucket_ladder(1, multiple=rung_multiple, growth=growth)  # checks the ladder
        self.merge, self.d, self.chunk = merge, d, chunk
        self.multiple, self.growth, self.jit, self.read = rung_multiple, growth, jit, read
        self.row_multiple = row_multiple
        self._fns: dict = {}

    def _fn(self, name: str, num_rows: int):
        if (name, num_rows) not in self._fns:
            d, merge = self.d, self.merge
            if name == "prefill":
                def fn(params, *args):
                    return prefill(merge(params), *args, d, num_rows)
            elif name == "chunk":
                def fn(params, rows, record, key, start, temperature, trunc):
                    return decode_chunk(merge(params), rows, record, key, start, temperature,
                                        trunc, d, num_rows, self.chunk)
            else:
                def fn(rows, idx, valid):
                    return gather_rows(rows, idx, valid, num_rows)
            self._fns[name, num_rows] = self.jit(fn)
        return self._fns[name, num_rows]

    def ladder(self, rows: int) -> list[int]:
        """The row ladder of a call of ``rows`` real rows (its top holds them all)."""
        top = -(-rows // self.row_multiple) * self.row_multiple
        return jaxhead.bucket_ladder(top, multiple=self.multiple, growth=self.growth)

    def __call__(self, params, prompts, lens, budgets: np.ndarray, key, temperature, trunc,
                 *, group_size: int, prompt_tokens: int) -> tuple[tuple[jax.Array, ...], Work]:
        """Rollouts of ``len(budgets)`` rows (``G`` per prompt row, in order).

        Args:
          params: the policy's parameters (in the layout ``jit`` expects).
          prompts, lens: ``[U, W]`` / ``[U]`` distinct prompts (device or host; rows past
            ``len(budgets) / G`` are padding).
          budgets: int ``[B]`` host array: each row's token budget (``<= T``).
          group_size: G, consecutive rows per prompt row (one compile serves every G).
          key, temperature, trunc: as ``models.generate.reference.generate``.
          prompt_tokens: the real prompt tokens (for ``Work``).

        Returns:
          ``(record, work)``: record as ``prefill``'s (device arrays ``[B', ...]``, ``B' >=
          B`` rows, the first B real) and the ``Work`` done.
        """
        d, real = self.d, len(budgets)
        ladder = self.ladder(real)
        size = ladder[-1]
        row_ids = np.arange(size, dtype=np.int32)
        source = np.minimum(row_ids // group_size, prompts.shape[0] - 1).astype(np.int32)
        row_ids[real:] = size  # padding
        full = np.zeros(size, np.int32)
        full[:real] = budgets
        rows, record = self._fn("prefill", size)(
            params, prompts, lens, jnp.asarray(source), jnp.asarray(row_ids),
            jnp.asarray(full), key, temperature, trunc)
        work, start = 0, 1
        while start < d.max_new_tokens:
            done = np.asarray(self.read(rows.done))
            active = np.flatnonzero(~done)
            if not len(active):
                break
            rung = next(r for r in ladder if r >= len(active))
            if rung < len(done):  # a smaller rung holds the active rows: move them there
                idx = np.zeros(rung, np.int32)
                idx[:len(active)] = active
                valid = np.arange(rung) < len(active)
                rows = self._fn("gather", size)(rows, jnp.asarray(idx), jnp.asarray(valid))
            rows, record, k = self._fn("chunk", size)(params, rows, record, key,
                                                      jnp.int32(start), temperature, trunc)
            work += rung * int(self.read(k))
            start += self.chunk
        slots = int(math.prod(prompts.shape))
        return record, Work(prompt_tokens, slots, work)
