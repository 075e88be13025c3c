"""keep_mask and next_token_labels on packed rows."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead

# one row: segment 1 (positions 0-3), segment 2 (4-8), segment 3 (9-11), padding (12-15)
SEG = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0, 0, 0]])
TOK = np.array([[11, 12, 13, 14, 21, 22, 23, 24, 25, 31, 32, 33, 0, 0, 0, 0]])


def test_next_token_labels_never_cross_segments():
    labels, valid = jaxhead.next_token_labels(jnp.asarray(TOK), jnp.asarray(SEG))
    want = [[12, 13, 14, -100, 22, 23, 24, 25, -100, 32, 33, -100, -100, -100, -100, -100]]
    chex.assert_trees_all_equal(np.asarray(labels), np.array(want))
    chex.assert_trees_all_equal(np.asarray(valid), np.array(want) != -100)


def test_next_token_labels_without_segments_drops_only_last():
    labels, valid = jaxhead.next_token_labels(jnp.asarray(TOK[:, :5]), ignore_index=-1)
    chex.assert_trees_all_equal(np.asarray(labels), np.array([[12, 13, 14, 21, -1]]))
    assert np.asarray(valid).tolist() == [[True, True, True, True, False]]


def test_keep_mask_is_union_of_readers_minus_segment_ends():
    # after the shift: the RL loss reads completion positions, KL a subset, CE another
    loss_mask = np.zeros_like(SEG).astype(bool)
    loss_mask[0, [2, 3, 6, 7, 8]] = True  # 3 and 8 are segment ends: no label
    kl = np.zeros(SEG.shape, np.float32)
    kl[0, [10, 11, 13]] = 0.5  # 11 is a segment end, 13 is padding
    ce = np.zeros(SEG.shape, np.float32)
    ce[0, 0] = 2.0
    keep = jaxhead.keep_mask(loss_mask=loss_mask, kl_weights=kl, ce_weights=ce,
                             segment_ids=jnp.asarray(SEG), aligned_to="predictions")
    assert np.flatnonzero(np.asarray(keep)).tolist() == [0, 2, 6, 7, 10]
    _, valid = jaxhead.next_token_labels(jnp.asarray(TOK), jnp.asarray(SEG))
    assert not np.any(np.asarray(keep) & ~np.asarray(valid))


def test_keep_mask_without_segments_never_keeps_last_position():
    keep = jaxhead.keep_mask(loss_mask=np.ones((2, 5), bool), aligned_to="predictions")
    assert np.asarray(keep).tolist() == [[True] * 4 + [False]] * 2


def test_token_aligned_completion_mask_keeps_every_completion_token():
    """The reported trap: a completion mask aligned with the completion tokens, given as the
    loss mask, dropped the first completion token of every sequence (508 of 512 kept).
    ``aligned_to="tokens"`` shifts it within segments: every completion token is scored,
    by the position before it, and nothing crosses a segment boundary."""
    completion = np.zeros_like(SEG).astype(bool)
    completion[0, [2, 3, 6, 7, 8, 10, 11]] = True  # completions of segments 1, 2, 3
    completion[0, 4] = True  # the first token of segment 2: no position of its own predicts it
    keep = np.asarray(jaxhead.keep_mask(loss_mask=completion, segment_ids=jnp.asarray(SEG),
                                        aligned_to="tokens"))
    labels, _ = jaxhead.next_token_labels(jnp.asarray(TOK), jnp.asarray(SEG))
    scored = np.asarray(labels)[keep]
    assert sorted(scored.tolist()) == sorted(TOK[0, [2, 3, 6, 7, 8, 10, 11]].tolist())
    assert np.flatnonzero(keep).tolist() == [1, 2, 5, 6, 7, 9, 10]
    # the prediction-aligned form of the same mask is what the shift gives
    shifted = jaxhead.shift_to_predictions(completion, jnp.asarray(SEG))
    np.testing.assert_array_equal(
        np.asarray(jaxhead.keep_mask(loss_mask=shifted, segment_ids=jnp.asarray(SEG),
                                     aligned_to="predictions")), keep)
    # without segment ids: one sequence per row, the last position never kept
    row = jaxhead.keep_mask(loss_mask=np.array([[0, 0, 1, 1, 1]]), aligned_to="tokens")
    assert np.asarray(row).tolist() == [[False, True, True, True, False]]


def test_keep_mask_errors():
    with pytest.raises(ValueError, match="needs at least one of"):
        jaxhead.keep_mask(segment_ids=jnp.asarray(SEG), aligned_to="tokens")
    with pytest.raises(ValueError, match=r"loss_mask has shape \(1, 16\) but kl_weights has "
                       r"shape \(1, 15\)"):
        jaxhead.keep_mask(loss_mask=SEG > 0, kl_weights=np.ones((1, 15)), aligned_to="tokens")
    with pytest.raises(ValueError, match=r"aligned_to must be one of \('predictions', "
                       r"'tokens'\), got 'labels'"):
        jaxhead.keep_mask(loss_mask=SEG > 0, aligned_to="labels")
    with pytest.raises(TypeError, match="aligned_to"):
        jaxhead.keep_mask(loss_mask=SEG > 0)  # required: no silent default
