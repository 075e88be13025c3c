"""The paged engine's device steps (its model runner, ``models.generate.compact``): the
prefill of distinct prompts into the page pool, a chunk of decode steps, the gathering of
a chunk's rows, the pool's growth; ``PagedRunner`` jits each once per static shape.

A row reads only slots it wrote: its block table's unused entries are
``models.generate.pages.NO_PAGE`` (out of the pool: they read zeros), and the attention
selects masked slots away (``models.attention.paged``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from models.cache import PagedKVCache, init_pages
from models.cache.paged import along_pages, per_shard
from models.generate.api import (
    Decoding,
    Jit,
    along_batch,
    draw,
    empty_record,
    empty_routes,
    ended,
    masked,
    record_routes,
)


class Rows(NamedTuple):
    """The rows of a decode batch (a pytree of ``[R]`` int32 / bool arrays).

    Attributes:
      row_ids: global row index (``num_rows``: padding).
      request, sample: the row's request id and sample index (``models.generate.api.
        row_requests``): they key its draws.
      tokens: the last drawn token (not yet in the cache).
      lens: the row's prompt length.
      budgets: the most tokens the row decodes.
      length: tokens drawn so far (the next draw is decode step ``length``; its input
        token sits at slot ``lens + length - 1``).
      done, stopped: the row ended; it ended on a stop token.
    """

    row_ids: jax.Array
    request: jax.Array
    sample: jax.Array
    tokens: jax.Array
    lens: jax.Array
    budgets: jax.Array
    length: jax.Array
    done: jax.Array
    stopped: jax.Array


def _scatter_prompt(kp, vp, ck, cv, src, dest):
    """Pages ``dest`` ``[E]`` of the pools ``[P, K, S, D]`` set to pages ``src`` of the
    prefill cache ``[U, W, K, D]`` cut into ``W / S`` pages per prompt."""
    u, w, k, d = ck.shape
    size = kp.shape[2]

    def paged(c):  # [U, W, K, D] -> [U W / S, K, S, D]
        return jnp.swapaxes(c.reshape(u * (w // size), size, k, d), 1, 2)

    return (kp.at[dest].set(paged(ck)[src].astype(kp.dtype), mode="drop"),
            vp.at[dest].set(paged(cv)[src].astype(vp.dtype), mode="drop"))


def prefill(model, pools, prompts, plens, src, dest, prompt_of, row_ids, request, sample,
            budgets, key, temperature, trunc, d: Decoding, num_rows: int):
    """Prefill ``[n U, W]`` prompts (U per shard), store their pages and draw every row's
    first token.

    Args:
      pools: ``(keys, values)``, per layer ``[n P, K, S, D]``.
      prompts, plens: int32 ``[n U, W]`` right-padded prompts (W a multiple of S) and
        ``[n U]`` lengths.
      src, dest: int32 ``[n E]``: per shard, prefill page ``src`` (prompt ``i``'s page
        ``j`` is ``i W / S + j``) goes to pool page ``dest`` (``NO_PAGE``: none).
      prompt_of: int32 ``[B']``: the prefill row (global) of each row's prompt.
      row_ids, request, sample, budgets: int32 ``[B']`` (``B' = num_rows``): global index
        (``num_rows``: padding), request id, sample index and token budget of each row.
      key, temperature, trunc, d: as ``models.generate.reference.generate``.

    Returns:
      ``(pools, first, record)``: ``first`` = ``Rows`` of every row after its first token
      (``[B']``); ``record`` = ``(tokens, logprobs, min_logit, logmass)`` ``[B', T]``,
      ``lengths`` ``[B']``, ``stopped`` ``[B']``; with ``d.record_routes`` also the rows'
      prompt routes ``[B', W, M, k]`` and completion routes ``[B', T, M, k]``
      (``models.generate.api.record_routes``).
    """
    width = prompts.shape[1]
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), prompts.shape)
    out = model(prompts, pos, (pos < plens[:, None]).astype(jnp.int32),
                along_batch(model.init_cache(prompts.shape[0], width)))
    keys, values = [], []
    for kp, vp, ck, cv in zip(*pools, out.cache.keys, out.cache.values):
        kp, vp = per_shard(_scatter_prompt, (kp, vp), (ck, cv, src, dest), 2, 0)
        keys.append(kp)
        values.append(vp)
    last = out.hidden[jnp.arange(prompts.shape[0]), plens - 1]
    first = draw(model, along_batch(last[prompt_of]), key, 0, temperature, trunc, d,
                 request, sample)
    length = jnp.ones_like(row_ids)
    stopped, spent = ended(first.tokens, length, budgets, d)
    pad = row_ids >= num_rows
    rows = along_batch(Rows(row_ids, request, sample, first.tokens, plens[prompt_of],
                            budgets, length, stopped | spent | pad, stopped & ~pad))
    record = tuple(r.at[:, 0].set(x) for r, x in
                   zip(empty_record(num_rows, d.max_new_tokens), first))
    routes = ()
    if d.record_routes:  # each row's prompt's routes, then its completion's (decode_chunk)
        real = pos[prompt_of] < plens[prompt_of][:, None]
        routes = (record_routes(model, out.routes[prompt_of], real),
                  empty_routes(model, num_rows, d.max_new_tokens))
    record = along_batch((*record, length, rows.stopped, *routes))
    return along_pages((tuple(keys), tuple(values))), rows, record


def assemble(batch: Rows, first: Rows, fresh: jax.Array, idx: jax.Array) -> Rows:
    """The next decode batch ``[R']``: place ``i`` takes row ``idx[i]`` of ``first`` (a
    row starting) where ``fresh[i]``, else of ``batch`` (a row going on); ``idx = -1``: a
    padding place (done, global index of ``first``'s padding)."""
    num_rows = first.row_ids.shape[0]
    pick = jnp.clip(idx, 0)
    old = jax.tree.map(lambda x: jnp.take(x, jnp.minimum(pick, x.shape[0] - 1), axis=0),
                       batch)
    new = jax.tree.map(lambda x: jnp.take(x, pick, axis=0), first)
    rows = jax.tree.map(lambda a, b: jnp.where(fresh, b, a), old, new)
    pad = idx < 0
    return along_batch(rows._replace(done=rows.done | pad,
                                     row_ids=jnp.where(pad, num_rows, rows.row_ids)))


def decode_chunk(model, pools, rows: Rows, tables, record, key, start, chunk, temperature,
                 trunc, d: Decoding, num_rows: int, lockstep: bool):
    """Up to ``chunk`` decode steps of ``rows`` (fewer when every row ends), writing
    their draws into ``record`` at ``[global index, step]``.

    Args:
      pools: ``(keys, values)`` per layer; tables: int32 ``[R, M]`` the rows' pages (each
        row holds the pages of every slot the chunk writes).
      start: int32: the decode step of every active row at the chunk's start when
        ``lockstep`` (the rows started together); otherwise each row draws step
        ``length`` with its own key.
      chunk: int32 scalar (traced): the most steps to run.
      record: ``prefill``'s; with ``d.record_routes`` each step also writes the experts
        of the token it runs (completion token ``length - 1``) into the completion routes.

    Returns:
      ``(pools, rows, record, steps run)``.
    """
    def cond(c):
        return (c[0] < chunk) & ~jnp.all(c[2].done)

    def body(c):
        k, pools, r, record = c
        slot = r.lens + r.length - 1
        cache = PagedKVCache(*pools, tables, jnp.where(r.done, -1, slot))
        o = model(r.tokens[:, None], slot[:, None], jnp.ones_like(slot)[:, None], cache)
        step = start + k if lockstep else r.length
        new = masked(draw(model, o.hidden[:, 0], key, step, temperature, trunc, d,
                          r.request, r.sample), r.done)
        fields, (lengths, stopped), routes = record[:4], record[4:6], record[6:]
        col = jnp.where(r.done, d.max_new_tokens, r.length)  # finished rows: dropped
        fields = [f.at[r.row_ids, col].set(x, mode="drop") for f, x in zip(fields, new)]
        if routes:  # completion token length - 1 ran: its experts
            ran = jnp.where(r.done, d.max_new_tokens, r.length - 1)
            routes = (routes[0], routes[1].at[r.row_ids, ran].set(o.routes[:, 0],
                                                                  mode="drop"))
        length = r.length + (~r.done).astype(jnp.int32)
        stop, spent = ended(new[0], length, r.budgets, d)
        r = r._replace(tokens=new[0], length=length, done=r.done | stop | spent,
                       stopped=r.stopped | (stop & ~r.done))
        pools = along_pages((o.cache.keys, o.cache.values))
        return k + 1, pools, along_batch(r), (*fields, lengths, stopped, *routes)

    k, pools, rows, record = jax.lax.while_loop(
        cond, body, (jnp.int32(0), pools, rows, record))
    fields, (lengths, stopped), routes = record[:4], record[4:6], record[6:]
    lengths = lengths.at[rows.row_ids].set(rows.length, mode="drop")
    stopped = stopped.at[rows.row_ids].set(rows.stopped, mode="drop")
    return pools, rows, (*fields, lengths, stopped, *routes), k


def grow_pool(pools, pages: int):
    """The pools with each shard's pool padded to ``pages`` pages (zeros)."""
    def pad(kp, vp):
        extra = ((0, pages - kp.shape[0]), (0, 0), (0, 0), (0, 0))
        return jnp.pad(kp, extra), jnp.pad(vp, extra)

    grown = [per_shard(pad, (kp, vp), (), 2, 0) for kp, vp in zip(*pools)]
    return along_pages((tuple(g[0] for g in grown), tuple(g[1] for g in grown)))


class PagedRunner:
    """The jitted device steps of one engine, built once per static value and kept.

    Args:
      merge: ``params -> model``; d: the static settings.
      shards: the batch shards; page_size: S.
      jit: how a step compiles (``models.generate.api.Jit``).
    """

    def __init__(self, merge: Callable, d: Decoding, shards: int, page_size: int, jit: Jit):
        self.merge, self.d, self.shards, self.page_size, self.jit = (merge, d, shards,
                                                                     page_size, jit)
        self._fns: dict = {}

    def compiled(self, name: str, static):
        """The jitted device step ``name`` for its static value, built once and kept:
        ``"prefill"`` (static: the rows), ``"chunk"`` (``(rows, lockstep)``: one chunk of
        decode steps), ``"assemble"`` (None: waiting rows into freed places), ``"grow"``
        and ``"pool"`` (the pool's pages per shard). Its ``.lower(...)`` gives the
        program of those arguments (``benchmarks/rollout_memory.py``)."""
        if (name, static) not in self._fns:
            d, merge, kw = self.d, self.merge, {}
            if name == "prefill":
                def fn(params, pools, *args):
                    return prefill(merge(params), pools, *args, d, static)
                kw = {"donate_argnums": 1}
            elif name == "chunk":
                num_rows, lockstep = static

                def fn(params, pools, rows, tables, record, key, start, chunk, temperature,
                       trunc):
                    return decode_chunk(merge(params), pools, rows, tables, record, key,
                                        start, chunk, temperature, trunc, d, num_rows,
                                        lockstep)
                kw = {"donate_argnums": (1, 4)}
            elif name == "assemble":
                fn = assemble
            elif name == "grow":
                def fn(pools):  # (a larger output: the input cannot be donated)
                    return grow_pool(pools, static)
            else:  # "pool": an empty pool of ``static`` pages per shard
                def fn(params):
                    return along_pages(init_pages(merge(params).cfg, self.shards * static,
                                                  self.page_size))
            self._fns[name, static] = self.jit(fn, **kw)
        return self._fns[name, static]
