"""``models.generate.pages.PageAllocator``: per-shard free lists, shared pages freed by
their last reader, growth, the peak, and a clear error when a pool runs out."""

from __future__ import annotations

import pytest

from models.generate.pages import PageAllocator


def test_pages_are_taken_shared_and_freed_per_shard():
    alloc = PageAllocator(2, 4)
    shared = alloc.take(0, 2, readers=3)
    own = alloc.take(0, 1)
    other = alloc.take(1, 4)
    assert shared == [0, 1] and own == [2] and other == [0, 1, 2, 3]
    assert alloc.held == alloc.peak == 7 and alloc.free(0) == 1 and alloc.free(1) == 0
    for _ in range(2):  # two of the three readers done: still held
        alloc.release(0, shared)
    assert alloc.free(0) == 1
    alloc.release(0, shared + own)
    alloc.release(1, other)
    assert alloc.held == 0 and alloc.peak == 7 and alloc.free(0) == alloc.free(1) == 4


def test_growth_adds_pages_and_running_out_raises():
    alloc = PageAllocator(1, 2)
    alloc.take(0, 2)
    with pytest.raises(MemoryError, match="shard 0: 1 pages asked, 0 free of 2"):
        alloc.take(0, 1)
    alloc.grow(5)
    assert alloc.take(0, 3) == [2, 3, 4] and alloc.size == 5
    alloc.grow(3)  # never shrinks
    assert alloc.size == 5
