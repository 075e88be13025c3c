"""``PageAllocator``: the host's bookkeeping of a paged KV pool (``models.cache.
PagedKVCache``) split into equal per-shard pools.

Pages are numbered locally within their shard's pool. A page is taken with a count of
readers (the rows whose block tables hold it: the G samples of a prompt share its full
pages) and returns to its shard's free list when the last reader releases it.
"""

from __future__ import annotations


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
