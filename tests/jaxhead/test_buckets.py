"""The bucket ladder: its documented growth, waste and rung counts."""

from __future__ import annotations

import itertools

import pytest

import jaxhead


@pytest.mark.parametrize("n, rungs", [(16384, 19), (65536, 25), (262144, 31)])
def test_rung_counts_match_docstring(n, rungs):
    ladder = jaxhead.bucket_ladder(n)
    assert len(ladder) == rungs and ladder[-1] == n
    assert all(r % 128 == 0 for r in ladder[:-1])
    assert ladder == sorted(set(ladder))


def test_worst_case_waste_matches_docstring():
    ladder = jaxhead.bucket_ladder(16384)
    waste = {(a, b): (b - a - 1) / b for a, b in itertools.pairwise(ladder)}
    assert max(waste.values()) == pytest.approx(0.496, abs=1e-3)  # 129 tokens in 256
    assert waste[(640, 896)] == pytest.approx(0.285, abs=1e-3)
    assert max(w for (a, _), w in waste.items() if a >= 896) <= 0.25
    assert max(w for (a, _), w in waste.items() if a >= 1536) <= 0.211


def test_bucket_size_is_smallest_fitting_rung():
    ladder = jaxhead.bucket_ladder(16384)
    for count in [0, 1, 127, 128, 129, 1000, 5000, 15104, 15105, 16384]:
        b = jaxhead.bucket_size(count, 16384)
        assert b >= count and b in ladder
        assert all(r < count for r in ladder if r < b)
    assert jaxhead.bucket_size(10, 64) == 64  # capped by N


def test_bucket_size_errors():
    with pytest.raises(ValueError, match="num_kept=20 exceeds max_size=10"):
        jaxhead.bucket_size(20, 10)
    with pytest.raises(ValueError, match="growth must be > 1"):
        jaxhead.bucket_size(5, growth=1.0)
