"""``compact``: one prefill per prompt, a paged KV cache, finished rows leave the batch.

1. Prefill: each distinct prompt once; its keys and values go to pages of ``page_size``
   slots (``models.cache.PagedKVCache``). The G samples of a prompt share its full pages
   through their block tables; the last, partly filled page is copied per sample (each
   writes its own tokens after the prompt). The first token of every row is drawn from
   its prompt's last hidden state.
2. Decode in chunks of steps (a ``while_loop`` that also ends when every row is done);
   each step's attention reads only the slots its row has written
   (``models.attention.paged``). A chunk's length is sized from the rows still running
   (``next_chunk``): from ``chunk // 16`` steps, halved after a chunk in which rows
   finished (the batch is shrinking: compact it soon), doubled after one in which none did
   (a stable tail: fewer round trips), at most ``chunk`` and never past the longest budget
   left; the length is traced, so every length runs one compiled chunk per rung. Between
   chunks the host reads which rows are done,
   returns their pages, admits waiting rows into the freed places (continuous batching,
   when ``max_rows`` caps the rows decoding at once), gathers the active rows into the
   smallest rung of a static row ladder (``jaxhead.bucket_ladder``: few shapes, one
   compiled chunk per rung) and gives each the pages the next chunk writes. The pool
   grows along a ladder of sizes when the pages run out (and keeps its size for the next
   call), so the cache holds what the rows have written plus at most one chunk.

Rows keep their global index (``row_ids``), which places their draws in the ``[B, T]``
record, and draw decode step ``t`` with their request's key (``models.generate.api.
request_key``) wherever and whenever they run: the tokens are the reference engine's for
the same key (a changed batch shape moves a logit by float rounding only).

A row reads only slots it wrote: its block table's unused entries are ``NO_PAGE`` (out of
the pool: they read zeros), and the attention selects masked slots away
(``models.attention.paged``), so a page's stale contents or another request's NaN never
reach it.

Under a mesh the rows are split in order over the batch shards (``ceil(B / n)`` each);
each shard prefills the prompts its rows continue (a prompt whose samples straddle two
shards is prefilled on both) and holds their pages in its own pool, so no device reads
another's pages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxhead
from models.cache import PagedKVCache, init_pages
from models.cache.paged import along_pages, per_shard
from models.generate.api import (
    Decoding,
    EngineSettings,
    Jit,
    Layout,
    Place,
    Read,
    Work,
    along_batch,
    draw,
    empty_record,
    empty_routes,
    ended,
    masked,
    record_routes,
    row_requests,
)
from models.generate.pages import PageAllocator

#: Page pools are a multiple of this many pages per shard.
POOL_MULTIPLE = 8
#: An unused entry of a page scatter or a block table (out of any pool: a scatter drops
#: it, a gather reads zeros).
NO_PAGE = 2 ** 30


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


def next_chunk(previous: int, finished: bool, shortest: int, longest: int,
               steps_left: int) -> int:
    """The length of the next decode chunk: ``previous`` halved when rows ``finished`` in
    it, else doubled (0: the first chunk, ``shortest``), within ``[shortest, longest]`` and
    at most ``steps_left`` (the longest budget a running row has left; >= 1)."""
    if not previous:
        size = shortest
    else:
        size = previous // 2 if finished else previous * 2
    return max(1, min(max(size, shortest), longest, steps_left))


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


class CompactEngine:
    """The host side of ``compact``: compiles its functions once per shape, plans the
    pages and drives the chunks.

    Args:
      merge: ``params -> model``.
      d: the static settings.
      settings: ``EngineSettings``; this engine reads every field:
      chunk: the most decode steps between compactions (>= 1); chunks start at ``chunk //
        16`` (at least 1) and adapt (``next_chunk``).
      rung_multiple: every rung of the row ladder below its top is a multiple of it (a
        multiple of ``row_multiple``).
      row_multiple: the batch shards n: rows are split in order over them (``ceil(B /
        n)`` each).
      growth: the ladder's growth (``jaxhead.bucket_ladder``): the decode work is at most
        about this factor over the rows' lengths rounded up to whole chunks.
      page_size: S, slots per page of the KV cache.
      max_rows: the most rows decoding at once over all shards (0: every row): the others
        wait and take the places finished rows free (continuous batching).
      jit, read: how functions compile and device rows are read back
        (``models.generate.api``); ``place`` and ``layout`` (every engine's arguments) are
        not needed: the steps take host arrays in the layout ``jit`` gives them.

    Attributes:
      pool_pages: pages per shard the next call's pool starts with (the most a call has
        needed, rounded up: later calls of the same workload do not grow it).

    Raises:
      ValueError: ``chunk``, ``page_size`` or ``max_rows`` out of range, ``rung_multiple``
        not a multiple of ``row_multiple`` (named); a bad ladder
        (``jaxhead.bucket_ladder``).
    """

    def __init__(self, merge: Callable, d: Decoding, settings: EngineSettings | None = None,
                 *, jit: Jit = jax.jit, read: Read = jax.device_get,
                 place: Place | None = None, layout: Layout | None = None):
        del place, layout  # its steps take host arrays in the layout jit gives them
        settings = EngineSettings() if settings is None else settings
        chunk, rung_multiple, growth = settings.chunk, settings.rung_multiple, settings.growth
        row_multiple, page_size = settings.row_multiple, settings.page_size
        max_rows = settings.max_rows
        for name, value, low in (("decode chunk", chunk, 1), ("page_size", page_size, 1),
                                 ("max_rows", max_rows, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if rung_multiple % row_multiple:
            raise ValueError(f"rung_multiple ({rung_multiple}) must be a multiple of the "
                             f"batch shards ({row_multiple})")
        jaxhead.bucket_ladder(1, multiple=rung_multiple, growth=growth)  # checks the ladder
        self.merge, self.d, self.chunk, self.page_size = merge, d, chunk, page_size
        self.multiple, self.growth, self.jit, self.read = rung_multiple, growth, jit, read
        self.shards, self.max_rows = row_multiple, max_rows
        self.pool_pages = 0
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

    def ladder(self, rows: int) -> list[int]:
        """The per-shard row ladder of a call of ``rows`` real rows (its top holds a
        shard's rows, or ``max_rows / n`` of them)."""
        top = self._cap(-(-rows // self.shards))
        return jaxhead.bucket_ladder(top, multiple=self.multiple // self.shards,
                                     growth=self.growth)

    def _cap(self, per_shard_rows: int) -> int:
        if not self.max_rows:
            return per_shard_rows
        return min(per_shard_rows, -(-self.max_rows // self.shards))

    def _pool_size(self, need: int) -> int:
        """Pages per shard that hold ``need``: ``pool_pages`` doubled until they do."""
        size = max(self.pool_pages, POOL_MULTIPLE)
        while size < need:
            size *= 2
        return size

    def _plan_prefill(self, prompts, lens, source, real: int, per: int,
                      alloc: PageAllocator):
        """The prefill's host arrays and each row's pages (see ``prefill``).

        Returns ``(prompts [n U, W], lens [n U], src [n E], dest [n E], prompt_of [B'],
        pages {row: [page]}, prompt tokens prefilled)``; ``alloc`` holds the pages."""
        n, size = self.shards, self.page_size
        per_page = prompts.shape[1] // size
        groups = []
        for s in range(n):
            rows = range(s * per, min(s * per + per, real))
            uniq = sorted({int(source[r]) for r in rows})
            groups.append((rows, uniq))
        width = max(1, *(len(u) for _, u in groups))
        need = [sum(lens[u] // size for u in uniq) + sum(bool(lens[source[r]] % size)
                                                        for r in rows)
                for rows, uniq in groups]
        alloc.grow(self._pool_size(max(need)))
        slot_of = np.zeros(n * width, np.int64)  # the prompt in each prefill row
        prompt_of = np.repeat(np.arange(n) * width, per).astype(np.int32)
        entries: list[list[tuple[int, int]]] = []
        pages: dict[int, list[int]] = {}
        for s, (rows, uniq) in enumerate(groups):
            entries.append([])
            for i, u in enumerate(uniq):
                slot_of[s * width + i] = u
                mine = [r for r in rows if source[r] == u]
                whole, part = divmod(int(lens[u]), size)
                shared = alloc.take(s, whole, readers=len(mine))
                entries[s] += [(i * per_page + j, p) for j, p in enumerate(shared)]
                for r in mine:
                    prompt_of[r] = s * width + i
                    own = alloc.take(s, 1) if part else []
                    entries[s] += [(i * per_page + whole, p) for p in own]
                    pages[r] = shared + own
        most = max(1, *(len(e) for e in entries))
        src = np.zeros((n, most), np.int32)
        dest = np.full((n, most), NO_PAGE, np.int32)
        for s, e in enumerate(entries):
            if e:
                src[s, :len(e)], dest[s, :len(e)] = zip(*e)
        tokens = int(sum(lens[u] for _, uniq in groups for u in uniq))
        return (prompts[slot_of], lens[slot_of].astype(np.int32), src.ravel(), dest.ravel(),
                prompt_of, pages, tokens)

    def _pages_for_chunk(self, batch, length, lens, budgets, pages, alloc: PageAllocator,
                         chunk: int):
        """Give every row of ``batch`` the pages of the slots the next ``chunk`` steps may
        write; returns the pool size (pages per shard) that needs."""
        size, wanted = self.page_size, []
        for s, rows in enumerate(batch):
            more = {}
            for r in rows:
                slot = lens[r] + length[r] - 1  # the next write
                limit = min(slot + chunk, lens[r] + budgets[r] - 1)
                more[r] = max(0, -(-limit // size) - len(pages[r]))
            wanted.append(more)
        need = max(alloc.size - alloc.free(s) + sum(m.values()) for s, m in enumerate(wanted))
        if need > alloc.size:
            return need
        for s, more in enumerate(wanted):
            for r, count in more.items():
                pages[r] = pages[r] + alloc.take(s, count)
        return alloc.size

    def __call__(self, params, prompts, lens, budgets: np.ndarray, key, temperature, trunc,
                 *, group_size: int, request_ids=None) -> tuple[tuple[jax.Array, ...], Work]:
        """Rollouts of ``len(budgets)`` rows (``G`` per prompt row, in order).

        Args:
          params: the policy's parameters (in the layout ``jit`` expects).
          prompts, lens: host ``[U, W]`` / ``[U]`` distinct prompts, right-padded.
          budgets: int ``[B]`` host array: each row's token budget (``<= T``); row ``r``
            continues prompt ``r // G``.
          key, temperature, trunc: as ``models.generate.reference.generate``.
          group_size: G, consecutive rows per prompt row (one compile serves every G).
          request_ids: None or one distinct int per prompt (``models.generate.api.
            row_requests``): prompt ``i``'s samples draw as request ``request_ids[i]``
            (default ``i``).

        Returns:
          ``(record, work)``: record as ``prefill``'s (device arrays ``[B', ...]``, ``B'
          >= B`` rows, the first B real) and the ``Work`` done.
        """
        d, n, size = self.d, self.shards, self.page_size
        prompts, lens = np.asarray(prompts), np.asarray(lens).astype(np.int64)
        prompts = np.pad(prompts, ((0, 0), (0, -prompts.shape[1] % size)))
        real = len(budgets)
        per = -(-real // n)
        num_rows = per * n
        row_ids = np.arange(num_rows, dtype=np.int32)
        row_ids[real:] = num_rows
        request, sample = row_requests(request_ids, real // group_size, group_size, num_rows)
        source = np.minimum(np.arange(num_rows) // group_size, len(lens) - 1)
        full = np.ones(num_rows, np.int32)
        full[:real] = budgets
        alloc = PageAllocator(n)
        pprompts, plens, src, dest, prompt_of, pages, tokens = self._plan_prefill(
            prompts, lens, source, real, per, alloc)
        pools = self.compiled("pool", alloc.size)(params)
        pools, first, record = self.compiled("prefill", num_rows)(
            params, pools, pprompts, plens, src, dest, prompt_of, row_ids, request, sample,
            full, key, temperature, trunc)
        done0 = np.asarray(self.read(first.done))
        for r in np.flatnonzero(done0[:real]):  # ended on their first token
            alloc.release(r // per, pages.pop(r))
        cap = self._cap(per)
        ladder, lockstep = self.ladder(real), cap >= per
        width = -(-(prompts.shape[1] + d.max_new_tokens) // size)
        waiting = [[r for r in range(s * per, min(s * per + per, real)) if not done0[r]]
                   for s in range(n)]
        batch: list[list[int]] = [[] for _ in range(n)]
        length, plen = dict.fromkeys(range(real), 1), lens[source]
        place: dict[int, int] = {}  # row -> its place in ``rows``
        rows, work, start, chunk, finished = first, 0, 1, 0, False
        while True:
            for s in range(n):  # waiting rows take the free places
                free = cap - len(batch[s])
                batch[s], waiting[s] = batch[s] + waiting[s][:free], waiting[s][free:]
            if not any(batch):
                break
            rung = next(r for r in ladder if r >= max(map(len, batch)))
            left = max(int(full[r]) - length[r] for rs in batch for r in rs)
            chunk = next_chunk(chunk, finished, max(1, self.chunk // 16), self.chunk, left)
            need = self._pages_for_chunk(batch, length, plen, full, pages, alloc, chunk)
            if need > alloc.size:
                grown = self._pool_size(need)
                pools = self.compiled("grow", grown)(pools)
                alloc.grow(grown)
                self._pages_for_chunk(batch, length, plen, full, pages, alloc, chunk)
            fresh = np.zeros(n * rung, bool)
            idx = np.full(n * rung, -1, np.int32)
            tables = np.full((n * rung, width), NO_PAGE, np.int32)
            for s, rs in enumerate(batch):
                for j, r in enumerate(rs):
                    g = s * rung + j
                    fresh[g], idx[g] = r not in place, place.get(r, r)
                    tables[g, :len(pages[r])] = pages[r]
            place = {r: s * rung + j for s, rs in enumerate(batch) for j, r in enumerate(rs)}
            rows = self.compiled("assemble", None)(rows, first, fresh, idx)
            pools, rows, record, k = self.compiled("chunk", (num_rows, lockstep))(
                params, pools, rows, tables, record, key, np.int32(start), np.int32(chunk),
                temperature, trunc)
            got_len, got_done, k = self.read((rows.length, rows.done, k))
            work += n * rung * int(k)
            start += chunk
            finished = bool(any(got_done[place[r]] for rs in batch for r in rs))
            for s in range(n):
                for r in list(batch[s]):
                    length[r] = int(got_len[place[r]])
                    if got_done[place[r]]:
                        alloc.release(s, pages.pop(r))
                        batch[s].remove(r)
        self.pool_pages = max(self.pool_pages, alloc.size)
        slots = int(pprompts.shape[0] * pprompts.shape[1])
        return record, Work(tokens, slots, work, n * alloc.size * size, alloc.peak * size)
