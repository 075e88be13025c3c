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

The engine's parts, as a serving engine's (vLLM's block pool / KV-cache manager, scheduler,
model runner): ``models.generate.pages`` (the page pool and what each row gets),
``models.generate.schedule`` (admission, the row ladder, the chunk lengths),
``models.generate.paged_steps`` (the jitted device steps) and ``CompactEngine`` here, the
driver.

Under a mesh the rows are split in order over the batch shards (``ceil(B / n)`` each);
each shard prefills the prompts its rows continue (a prompt whose samples straddle two
shards is prefilled on both) and holds their pages in its own pool, so no device reads
another's pages.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

import jaxhead
from models.generate.api import (
    Decoding,
    EngineSettings,
    Jit,
    Layout,
    Place,
    Read,
    Work,
    row_requests,
)
from models.generate.paged_steps import PagedRunner, Rows
from models.generate.pages import (
    NO_PAGE,
    PageAllocator,
    pages_for_chunk,
    plan_prefill,
    pool_size,
)
from models.generate.schedule import RowLadder, admit, next_chunk

__all__ = ["CompactEngine", "Rows", "next_chunk"]


class CompactEngine:
    """The driver of ``compact``: the prefill, then chunks of decode steps until every row
    is done, over its KV-cache manager (``models.generate.pages``), its scheduler
    (``models.generate.schedule``) and its model runner (``models.generate.paged_steps``).

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
        self.d, self.chunk, self.page_size, self.read = d, chunk, page_size, read
        self.shards = row_multiple
        self.schedule = RowLadder(row_multiple, rung_multiple, growth, max_rows)
        self.runner = PagedRunner(merge, d, row_multiple, page_size, jit)
        self.pool_pages = 0

    def compiled(self, name: str, static):
        """The jitted device step ``name`` for its static value (``PagedRunner.compiled``:
        ``"prefill"``, ``"chunk"``, ``"assemble"``, ``"grow"``, ``"pool"``); its
        ``.lower(...)`` gives the program (``benchmarks/rollout_memory.py``)."""
        return self.runner.compiled(name, static)

    def lower(self, *args, **kwargs):
        """Refused: a call runs several programs (the prefill, a chunk per rung, ...);
        lower each with ``compiled(name, static).lower(...)``.

        Raises:
          ValueError: always.
        """
        raise ValueError("the compact engine runs several programs a call: lower each with "
                         "compiled(name, static).lower(...) (Generator.engine_for)")

    def ladder(self, rows: int) -> list[int]:
        """The per-shard row ladder of a call of ``rows`` real rows (``RowLadder.rungs``)."""
        return self.schedule.rungs(rows)

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
        pprompts, plens, src, dest, prompt_of, pages, tokens = plan_prefill(
            prompts, lens, source, real, per, alloc, size, self.pool_pages)
        pools = self.compiled("pool", alloc.size)(params)
        pools, first, record = self.compiled("prefill", num_rows)(
            params, pools, pprompts, plens, src, dest, prompt_of, row_ids, request, sample,
            full, key, temperature, trunc)
        done0 = np.asarray(self.read(first.done))
        for r in np.flatnonzero(done0[:real]):  # ended on their first token
            alloc.release(r // per, pages.pop(r))
        cap = self.schedule.cap(per)
        ladder, lockstep = self.ladder(real), cap >= per
        width = -(-(prompts.shape[1] + d.max_new_tokens) // size)
        waiting = [[r for r in range(s * per, min(s * per + per, real)) if not done0[r]]
                   for s in range(n)]
        batch: list[list[int]] = [[] for _ in range(n)]
        length, plen = dict.fromkeys(range(real), 1), lens[source]
        place: dict[int, int] = {}  # row -> its place in ``rows``
        rows, work, start, chunk, finished = first, 0, 1, 0, False
        while True:
            admit(batch, waiting, cap)  # waiting rows take the free places
            if not any(batch):
                break
            rung = next(r for r in ladder if r >= max(map(len, batch)))
            left = max(int(full[r]) - length[r] for rs in batch for r in rs)
            chunk = next_chunk(chunk, finished, max(1, self.chunk // 16), self.chunk, left)
            need = pages_for_chunk(batch, length, plen, full, pages, alloc, chunk, size)
            if need > alloc.size:
                grown = pool_size(self.pool_pages, need)
                pools = self.compiled("grow", grown)(pools)
                alloc.grow(grown)
                pages_for_chunk(batch, length, plen, full, pages, alloc, chunk, size)
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
