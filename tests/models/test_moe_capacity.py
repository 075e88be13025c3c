"""MoE capacity (``ModelConfig.expert_capacity_factor``, ragged dispatch), on 8 CPU devices
in a subprocess (``capacity_cases``): padding takes no capacity (the reported case: 75%
padding, factor 1.25, NaN and wrong log-probs before); real pairs past the capacity are
dropped by GShard's priority, exactly the pairs of a pair-by-pair reference, the tokens
keeping their other experts (values and gradients against float64); strict mode
(``expert_capacity_overflow="nan"``) gives their tokens NaN; the model's dropped
fraction."""

from __future__ import annotations

import numpy as np
import pytest

from models import check_ops, get_config
from models.moe.ragged import kept_rows
from tests.support.multidevice import run_case


def test_reported_case_matches_the_dropless_run():
    r = run_case("tests.models.capacity_cases:reported_case")
    assert r["kept"] == 120
    assert r["nan"] == 0 and r["max_abs"] <= 1e-5, r  # before: 79 NaN, 1.38 nats off


def test_overflow_drops_gshard_pairs_or_nans_in_strict_mode():
    r = run_case("tests.models.capacity_cases:dropping_case")
    strict = r.pop("strict")
    for name, c in r.items():
        # the case overflows, first choices included; padding (a quarter, all on the hot
        # experts) would overflow it alone but takes no capacity
        assert c["ref_dropped"] > c["ref_dropped_first_choices"] > 0, (name, c)
        assert c["mismatched_pairs"] == 0, (name, c)
        assert c["fraction"] == c["ref_fraction"], (name, c)
        assert c["value"] <= 1e-5, (name, c)
        assert max(c["grads"].values()) <= 1e-5, (name, c)
        # a token that lost one pair keeps the other expert's output
        assert c["tokens_with_one_drop"] > 0 and c["min_norm_with_one_drop"] > 1e-3, c
        assert c["padding_max_abs"] == 0, (name, c)
    # strict: NaN exactly on the tokens with a dropped pair, the rest unchanged
    assert strict["nan_rows_match"] and strict["dropped_match"], strict
    assert strict["nan_rows"] > 0 and strict["rest_equal"] == 0, strict


def test_the_model_reports_the_dropped_fraction():
    r = run_case("tests.models.capacity_cases:metric_case")
    assert r["expected"] > 0 and r["mesh"] == pytest.approx(r["expected"], abs=1e-7), r
    assert r["one_device"] == 0, r


def test_kept_rows_fills_the_buffer_by_rank_then_source_then_expert():
    ranked = np.zeros((2, 2, 2), np.int32)  # [source, rank, local expert]
    ranked[0, 0] = [3, 1]
    ranked[1, 0] = [2, 0]
    ranked[0, 1] = [1, 2]
    ranked[1, 1] = [0, 4]
    # 6 first choices fit in 8 rows, then source 0's second choices: 1 of expert 0, 1 of 2
    # of expert 1; source 1's second choices are dropped
    assert np.asarray(kept_rows(ranked, 8)).tolist() == [[4, 2], [2, 0]]
    assert np.asarray(kept_rows(ranked, 100)).tolist() == [[4, 3], [2, 4]]
    assert np.asarray(kept_rows(ranked, 3)).tolist() == [[3, 0], [0, 0]]


def test_overflow_mode_is_validated():
    assert get_config("tiny-moe").expert_capacity_overflow == "drop"
    assert get_config("tiny-moe", expert_capacity_overflow="nan").expert_capacity_overflow \
        == "nan"
    with pytest.raises(ValueError, match="'silent'"):  # checked where the model is built
        check_ops(get_config("tiny-moe", expert_capacity_overflow="silent"))
