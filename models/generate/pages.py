"""The paged engine's KV-cache manager (the host's side of a paged KV pool,
``models.cache.PagedKVCache``, split into equal per-shard pools): ``PageAllocator``, its
free lists and readers; ``plan_prefill``, the pages each prompt and row gets at the
prefill; ``pages_for_chunk``, the pages the next chunk of decode steps writes;
``pool_size``, the pool's size ladder.

Pages are numbered locally within their shard's pool. A page is taken with a count of
readers (the rows whose block tables hold it: the G samples of a prompt share its full
pages) and returns to its shard's free list when the last reader releases it.
"""

from __future__ import annotations

import numpy as np


class PageAllocator:
    """Free lists and reader counts of ``shards`` pools of ``size`` pages each.

    Attributes:
      size: pages per shard's pool.
      held: pages held now, over all shards.
      peak: the most pages held at once since the allocator was made.
    """

    def __init__(self, shards: int, size: int = 0):
        self.size = 0
        self._free: list[list[int]] = [[] for _ in range(shards)]
        self._readers: list[dict[int, int]] = [{} for _ in range(shards)]
        self.held = self.peak = 0
        self.grow(size)

    @property
    def shards(self) -> int:
        """The number of per-shard pools."""
        return len(self._free)

    def grow(self, size: int) -> None:
        """Make each shard's pool ``size`` pages (no-op when it already has them)."""
        if size > self.size:
            for free in self._free:  # the lowest ids first
                free[:0] = range(self.size, size)
            self.size = size

    def free(self, shard: int) -> int:
        """Pages free in ``shard``'s pool."""
        return len(self._free[shard])

    def take(self, shard: int, count: int, readers: int = 1) -> list[int]:
        """``count`` free pages of ``shard``, each held for ``readers`` rows.

        Raises:
          MemoryError: fewer than ``count`` free pages (the numbers named); nothing taken.
        """
        free, count = self._free[shard], int(count)
        if count > len(free):
            raise MemoryError(f"shard {shard}: {count} pages asked, {len(free)} free of "
                              f"{self.size}")
        pages, free[:count] = free[:count], []
        for p in pages:
            self._readers[shard][p] = readers
        self.held += count
        self.peak = max(self.peak, self.held)
        return pages

    def release(self, shard: int, pages) -> None:
        """One reader of each of ``pages`` (of ``shard``) is done with it; a page no row
        reads any more is free again."""
        readers = self._readers[shard]
        for p in pages:
            readers[p] -= 1
            if not readers[p]:
                del readers[p]
                self._free[shard].append(p)
                self.held -= 1


#: Page pools are a multiple of this many pages per shard.
POOL_MULTIPLE = 8
#: An unused entry of a page scatter or a block table (out of any pool: a scatter drops
#: it, a gather reads zeros).
NO_PAGE = 2 ** 30


def pool_size(pool_pages: int, need: int) -> int:
    """Pages per shard that hold ``need``: ``pool_pages`` (at least ``POOL_MULTIPLE``)
    doubled until they do."""
    size = max(pool_pages, POOL_MULTIPLE)
    while size < need:
        size *= 2
    return size


def plan_prefill(prompts, lens, source, real: int, per: int, alloc: PageAllocator,
                 size: int, pool_pages: int):
    """The prefill's host arrays and each row's pages (``models.generate.paged_steps
    .prefill``): pages of ``size`` slots, the pool at least ``pool_pages`` per shard.

    Returns ``(prompts [n U, W], lens [n U], src [n E], dest [n E], prompt_of [B'],
    pages {row: [page]}, prompt tokens prefilled)``; ``alloc`` holds the pages."""
    n = alloc.shards
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
    alloc.grow(pool_size(pool_pages, max(need)))
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


def pages_for_chunk(batch, length, lens, budgets, pages, alloc: PageAllocator,
                    chunk: int, size: int) -> int:
    """Give every row of ``batch`` the pages of the slots the next ``chunk`` steps may
    write; returns the pool size (pages per shard) that needs."""
    wanted = []
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
