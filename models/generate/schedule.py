"""The paged engine's scheduling (``models.generate.compact``): which rows decode in the next
chunk and in which shape. Waiting rows take the places finished rows free, at most
``max_rows`` at once (``admit``: continuous batching); the rows of a chunk are gathered
into the smallest rung of a static row ladder (``RowLadder``: few shapes, one compiled
chunk per rung); a chunk's length adapts to how the batch shrinks (``next_chunk``).
Host-side only: it decides, the device steps (``models.generate.paged_steps``) run."""

from __future__ import annotations

import dataclasses

import jaxhead


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


@dataclasses.dataclass(frozen=True)
class RowLadder:
    """The shapes a decode chunk runs in.

    Attributes:
      shards: n, the batch shards (rows split in order over them).
      multiple: every rung below the top is a multiple of it (a multiple of ``shards``).
      growth: the ladder's growth (``jaxhead.bucket_ladder``).
      max_rows: the most rows decoding at once over all shards (0: every row).
    """

    shards: int
    multiple: int
    growth: float
    max_rows: int = 0

    def cap(self, per_shard_rows: int) -> int:
        """The most rows a shard decodes at once, of ``per_shard_rows``."""
        if not self.max_rows:
            return per_shard_rows
        return min(per_shard_rows, -(-self.max_rows // self.shards))

    def rungs(self, rows: int) -> list[int]:
        """The per-shard row ladder of a call of ``rows`` real rows (its top holds a
        shard's rows, or ``max_rows / n`` of them)."""
        top = self.cap(-(-rows // self.shards))
        return jaxhead.bucket_ladder(top, multiple=self.multiple // self.shards,
                                     growth=self.growth)


def admit(batch: list[list[int]], waiting: list[list[int]], cap: int) -> None:
    """Waiting rows take each shard's free places (``cap`` a shard), in order (in place)."""
    for s in range(len(batch)):
        free = cap - len(batch[s])
        batch[s], waiting[s] = batch[s] + waiting[s][:free], waiting[s][free:]
