"""train.rl.packing: rows, segments, positions and next-token alignment of packed batches."""

from __future__ import annotations

import numpy as np
import pytest

from train.rl import packing


def test_pack_layout_and_alignment():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 1000, n).tolist() for n in (5, 9, 3, 7)]
    comps = [rng.integers(1, 1000, n).tolist() for n in (4, 2, 6, 1)]
    vals = {"v": [rng.normal(size=len(c)).tolist() for c in comps]}
    b = packing.pack(prompts, comps, 16, values=vals, row_multiple=4)
    assert b.tokens.shape == (4, 16) and b.num_seqs == 4
    for k, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        r, cols = np.nonzero(b.seq_index == k)
        row = r[0]
        assert len(cols) == len(c) and np.all(r == row)
        # position j scores token j + 1: the scored labels are the completion tokens
        np.testing.assert_array_equal(b.labels[row, cols], c)
        np.testing.assert_allclose(b.values["v"][row, cols], vals["v"][k], rtol=1e-6)
        seg = b.segment_ids[row, cols[0]]
        span = np.nonzero(b.segment_ids[row] == seg)[0]
        assert len(span) == len(p) + len(c)
        np.testing.assert_array_equal(b.tokens[row, span], p + c)
        np.testing.assert_array_equal(b.positions[row, span], np.arange(len(span)))
    assert b.num_kept == sum(map(len, comps))
    assert np.all(b.loss_mask[b.seq_index < 0] == 0)
    assert np.all(b.labels[b.segment_ids == 0] == -100)
    assert b.bucket() >= b.num_kept
    # per-sequence values back out of the layout, and into it
    per_seq = b.per_sequence(b.values["v"])
    for got, want in zip(per_seq, vals["v"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(b.place(per_seq), b.values["v"])
    with pytest.raises(ValueError, match="lengths \\[4, 2, 6\\]"):
        b.place(per_seq[:3])
    # row slices keep the numbering; their values are the whole batch's rows
    top = b.rows(0, 2)
    assert top.tokens.shape == (2, 16) and top.num_seqs == 4
    np.testing.assert_array_equal(top.values["v"], b.values["v"][:2])
    assert sum(len(v) for v in top.per_sequence(top.values["v"])) == top.num_kept


def test_pack_errors():
    with pytest.raises(ValueError, match="row_len"):
        packing.pack([[1] * 10], [[2] * 10], 16)
    with pytest.raises(ValueError, match="num_rows"):
        packing.pack([[1] * 8, [1] * 8], [[2] * 4, [2] * 4], 16, num_rows=1)
    with pytest.raises(ValueError, match="entries"):
        packing.pack([[1]], [[2, 3]], 16, values={"v": [[0.0]]})


def test_first_fit_decreasing_fills_rows():
    rows = packing.assign_rows([7, 5, 4, 3, 1], 10)
    assert sorted(sorted(r) for r in rows) == [[0, 3], [1, 2, 4]]


def test_bucket_never_exceeds_the_most_tokens_the_batch_can_keep():
    """128 completions of 16 tokens keep 2048 positions: the ladder's rung above 1920 is
    2432 (384 padding rows through the head); capped at 128 x 16 the bucket is exact."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 1000, 30).tolist() for _ in range(128)]
    comps = [rng.integers(1, 1000, 16).tolist() for _ in range(128)]
    b = packing.pack(prompts, comps, 128)
    assert b.num_kept == 2048 and b.bucket(64) == 2432
    assert b.bucket(64, max_kept=128 * 16) == 2048
    short = packing.pack(prompts, [c[:8] for c in comps], 128)  # the cap only ever lowers
    assert short.bucket(64, max_kept=128 * 16) == short.bucket(64) >= short.num_kept
