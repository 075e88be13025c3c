"""Packing prompt + completion sequences into fixed-length rows with ``segment_ids``.

A packed batch has ``rows`` rows of ``row_len`` tokens. Each sequence (prompt followed by
its completion) occupies a contiguous span of one row with its own segment id (1, 2, ...
within the row; 0 = padding) and positions restarting at 0. Per-token arrays follow
jaxhead's next-token convention: position ``i`` scores token ``i + 1``, so the loss mask
of a completion token sits one position to its left.

The positions the head computes are ``keep`` (the one definition, used on the host for
the bucket and inside the jitted steps); the host picks the head's bucket from their count
(``PackedBatch.bucket``, on a mesh ``train.rl.placement.Placement.bucket``), a static int per
step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

import jaxhead

#: Keys of the arrays a step reads (``PackedBatch.arrays``), besides named ``values``.
BATCH_KEYS = ("tokens", "positions", "segment_ids", "labels", "loss_mask", "seq_index")


def keep(loss_mask, segment_ids):
    """The positions the head computes for a packed batch: ``jaxhead.keep_mask`` of its
    prediction-aligned ``loss_mask`` and its ``segment_ids`` (no position without a next
    token in its segment, no padding). bool ``[rows, row_len]``, a jax array; numpy inputs
    on the host, traced arrays inside a step."""
    return jaxhead.keep_mask(loss_mask=loss_mask, segment_ids=segment_ids,
                             aligned_to="predictions")


@dataclasses.dataclass
class PackedBatch:
    """Host (numpy) arrays of one packed batch, all ``[rows, row_len]`` unless noted.

    Attributes:
      tokens, positions, segment_ids: int32 model inputs.
      labels: int32 next-token labels (``-100`` where none; see
        ``jaxhead.next_token_labels``).
      loss_mask: float32, 1 at positions whose next token is a completion token.
      seq_index: int32, the sequence (``0 .. num_seqs-1``) whose completion token the
        position scores, ``-1`` elsewhere.
      values: the per-completion-token float32 arrays given to ``pack`` (e.g. sampler
        log-probs, advantages), aligned like ``loss_mask`` (0 elsewhere).
      num_seqs: number of sequences packed (static).
      routes: None, or int32 ``[rows, row_len, M, k]``: the experts the sampler's forward
        used for each token at each MoE layer (``pack``'s ``routes``; -1 where none was
        recorded: padding, a completion's last token), what routing replay feeds the
        trainer's forward (``models.Transformer``'s ``routes``).
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    seq_index: np.ndarray
    values: dict[str, np.ndarray]
    num_seqs: int
    routes: np.ndarray | None = None

    @property
    def keep(self) -> np.ndarray:
        """bool ``[rows, row_len]``: the positions the head computes (``keep``)."""
        return np.asarray(keep(self.loss_mask, self.segment_ids))

    @property
    def num_kept(self) -> int:
        """Positions the head computes: the completion tokens' predecessors."""
        return int(np.count_nonzero(self.keep))

    def arrays(self, *value_names: str) -> dict[str, np.ndarray]:
        """The host arrays a step reads: ``BATCH_KEYS`` plus the named ``values``, and
        ``routes`` when the batch has them (``train.rl.placement.place_batch`` puts them on
        the devices)."""
        out = {k: getattr(self, k) for k in BATCH_KEYS}
        out.update({k: self.values[k] for k in value_names})
        if self.routes is not None:
            out["routes"] = self.routes
        return out

    def bucket(self, multiple: int = 128, max_kept: int | None = None) -> int:
        """The head's static bucket for this batch: ``jaxhead.bucket_size`` with rungs that
        are multiples of ``multiple`` (a coarser ladder compiles fewer step variants), and
        never more than ``max_kept``, the most tokens such a batch can keep (e.g. its
        sequences times the longest completion: a full batch then takes exactly that many
        slots instead of the next rung's padding)."""
        limit = self.loss_mask.size if max_kept is None else min(max_kept, self.loss_mask.size)
        return jaxhead.bucket_size(self.num_kept, limit, multiple=multiple)

    def rows(self, start: int, stop: int) -> PackedBatch:
        """Rows ``start:stop`` as a batch (its sequence numbering kept: ``num_seqs`` and
        ``seq_index`` as in the whole batch)."""
        cut = slice(start, stop)
        return dataclasses.replace(
            self, **{k: getattr(self, k)[cut] for k in BATCH_KEYS},
            values={k: v[cut] for k, v in self.values.items()},
            routes=None if self.routes is None else self.routes[cut])

    def _scored(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat positions of the completion tokens grouped by sequence (each in token
        order) and the count per sequence."""
        flat = self.seq_index.reshape(-1)
        where = np.flatnonzero(flat >= 0)
        where = where[np.argsort(flat[where], kind="stable")]
        return where, np.bincount(flat[where], minlength=self.num_seqs)

    def per_sequence(self, x: np.ndarray) -> list[np.ndarray]:
        """The per-completion-token values of an array ``[rows, row_len]`` aligned like
        ``loss_mask``, one array per sequence (the inverse of ``place``)."""
        where, counts = self._scored()
        return np.split(np.asarray(x).reshape(-1)[where], np.cumsum(counts)[:-1])

    def place(self, per_seq: Sequence[np.ndarray]) -> np.ndarray:
        """float32 ``[rows, row_len]`` with sequence ``k``'s values where ``loss_mask``
        marks its completion tokens (0 elsewhere), as ``pack``'s ``values``.

        Raises:
          ValueError: the number of sequences or of a sequence's values does not match.
        """
        where, counts = self._scored()
        lengths = [len(v) for v in per_seq]
        if lengths != counts.tolist():
            raise ValueError(f"values for {len(lengths)} sequences of lengths {lengths}; "
                             f"the batch has {self.num_seqs} of {counts.tolist()}")
        out = np.zeros(self.loss_mask.size, np.float32)
        if where.size:
            out[where] = np.concatenate(per_seq)
        return out.reshape(self.loss_mask.shape)


def assign_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices per row, each row's total ``<= row_len``.

    Raises:
      ValueError: a sequence longer than ``row_len`` (its index and length named).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if lengths[i] > row_len:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens > row_len {row_len}")
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return rows


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
         row_len: int, *, num_rows: int | None = None, row_multiple: int = 1,
         values: dict[str, Sequence[Sequence[float]]] | None = None,
         routes: Sequence[np.ndarray] | None = None) -> PackedBatch:
    """Pack ``prompt_k + completion_k`` for every k.

    Args:
      prompts, completions: token id lists; completion ``k`` is scored (loss mask 1) and
        prompt ``k`` is context only.
      row_len: tokens per row.
      num_rows: rows of the batch (static shapes); None: as many as first-fit needs,
        rounded up to a multiple of ``row_multiple`` (few distinct shapes to compile).
      values: optional per-completion-token numbers (``values[name][k]`` has
        ``len(completions[k])`` entries), placed where ``loss_mask`` marks the token.
      routes: optional int ``[len(prompt_k) + len(completion_k), M, k]`` per sequence
        (``train.rl.rollout.Rollout.sequence_routes``), placed at its tokens
        (``PackedBatch.routes``, -1 elsewhere).

    Returns:
      ``PackedBatch``.

    Raises:
      ValueError: a sequence longer than ``row_len``; more rows needed than ``num_rows``;
        lengths of ``values`` or ``routes`` that do not match the sequences.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    values = values or {}
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    rows = assign_rows(lengths, row_len)
    n_rows = -(-len(rows) // row_multiple) * row_multiple if num_rows is None else num_rows
    if len(rows) > n_rows:
        raise ValueError(f"{len(prompts)} sequences need {len(rows)} rows of {row_len} "
                         f"tokens; only num_rows={n_rows}")
    shape = (n_rows, row_len)
    tokens, positions, segs, seq_index = (np.zeros(shape, np.int32) for _ in range(4))
    seq_index -= 1
    loss_mask = np.zeros(shape, np.float32)
    out_values = {name: np.zeros(shape, np.float32) for name in values}
    out_routes = None
    if routes is not None:
        if len(routes) != len(prompts):
            raise ValueError(f"routes for {len(routes)} sequences; {len(prompts)} packed")
        out_routes = np.full((*shape, *np.shape(routes[0])[1:]), -1, np.int32)
    for r, members in enumerate(rows):
        start = 0
        for s, k in enumerate(sorted(members), start=1):
            p, c = prompts[k], completions[k]
            n = len(p) + len(c)
            tokens[r, start:start + n] = list(p) + list(c)
            positions[r, start:start + n] = np.arange(n)
            segs[r, start:start + n] = s
            scored = slice(start + len(p) - 1, start + n - 1)  # predicts completion tokens
            loss_mask[r, scored] = 1.0
            seq_index[r, scored] = k
            for name, per_seq in values.items():
                if len(per_seq[k]) != len(c):
                    raise ValueError(f"values[{name!r}][{k}] has {len(per_seq[k])} entries "
                                     f"for a completion of {len(c)} tokens")
                out_values[name][r, scored] = per_seq[k]
            if out_routes is not None:
                if np.shape(routes[k])[:1] != (n,):
                    raise ValueError(f"routes[{k}] has shape {np.shape(routes[k])} for a "
                                     f"sequence of {n} tokens")
                out_routes[r, start:start + n] = routes[k]
            start += n
    labels, _ = jaxhead.next_token_labels(tokens, segs)
    return PackedBatch(tokens, positions, segs, np.asarray(labels), loss_mask, seq_index,
                       out_values, len(prompts), out_routes)
