"""``harness.bench``: the benchmarks' shared timing and table; ``harness.memory.parse_mesh``:
their ``--mesh``."""

from __future__ import annotations

import pytest

from harness import bench
from harness.memory import parse_mesh


def test_rounds_interleave_after_the_warmup_and_report_medians():
    order = []

    def call(name, value):
        def fn():
            order.append(name)
            return value
        return fn

    times = bench.rounds({"a": call("a", 1), "b": call("b", 2)}, 3, warmup=1)
    assert order == ["a", "b"] + ["a", "b"] * 3  # warm-up each, then one of each a round
    assert times["a"].last == 1 and times["b"].last == 2
    assert all(t.cpu >= 0 and t.wall >= 0 for t in times.values())
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.rounds({"a": call("a", 1)}, 0)


def test_table_is_markdown_and_refuses_ragged_rows():
    text = bench.table(["impl", "ms"], [["xla", "1.5"], ["pallas", 2]], align="lr")
    assert text.splitlines() == ["| impl | ms |", "|---|---:|", "| xla | 1.5 |",
                                 "| pallas | 2 |"]
    with pytest.raises(ValueError, match="a row of 1 cells under a header of 2"):
        bench.table(["impl", "ms"], [["xla"]])
    with pytest.raises(ValueError, match="align 'l' has 1 columns"):
        bench.table(["impl", "ms"], [], align="l")


def test_a_mesh_argument_names_its_axes_or_its_bad_part():
    assert parse_mesh("fsdp=8,expert=8") == {"fsdp": 8, "expert": 8}
    assert parse_mesh("data=2,") == {"data": 2}
    for bad in ("fsdp=8,expert8", "fsdp=0", "fsdp=-2", "=4", "fsdp=x"):
        with pytest.raises(ValueError, match=r"is not axis=size with a size >= 1"):
            parse_mesh(bad)
    with pytest.raises(ValueError, match=r"axis 'fsdp' is named twice"):
        parse_mesh("fsdp=2,fsdp=4")
