"""The GRPO loop with ``model.numerics = "invariant"`` (issue #41): on the micro config in
bf16 compute, with the compact engine under continuous batching and two micro-batches,
``logprob_diff_max`` before the first update of every step is exactly 0 and, with the
sampler's log-probs as the old policy's (``loss.old_logprobs = "sampler"``), the first
update's ratio is exactly 1, for the dense model and for its MoE variant (the
``tiny-moe`` preset's experts: the issue saw a ``logprob_diff_max`` of 0.225 there, a
routing flip). The same run with the mode off shows the gap the issue reports
(``logprob_diff_max`` 0.025-0.033 per step in bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer import train_records

CONFIG = """
from configs.grpo_micro import get_config as micro


def get_config():
    c = micro()
    c.model.preset = "{preset}"
    c.model.overrides = {{**c.model.overrides.to_dict(), "numerics": "{numerics}"}}
    c.model.dtype = "bfloat16"
    c.sft.steps = 0
    c.eval.before_after = False
    c.train.steps = 2
    c.train.micro_batches = 2
    c.train.updates_per_batch = 2  # the first update is 1.1
    c.rollout.max_decode_rows = 3
    c.rollout.page_size = 4
    c.loss.old_logprobs = "sampler"
    return c
"""


def _first_updates(tmp_path: Path, numerics: str, preset: str = "tiny") -> list[dict]:
    train = train_records(tmp_path, numerics,
                          CONFIG.format(numerics=numerics, preset=preset))
    assert [r["step"] for r in train] == [1, 2]
    return train


@pytest.mark.parametrize("preset, numerics", [
    ("tiny", "invariant"),
    # the slow set: the gaps without the mode and the MoE loop, whose block is checked in
    # process by tests/models/test_invariant_{numerics,moe}.py (a trainer run is a minute)
    *(pytest.param(p, n, marks=pytest.mark.slow)
      for p, n in [("tiny", "default"), ("tiny-moe", "invariant"), ("tiny-moe", "default")])])
def test_first_update_sees_the_samplers_logprobs(tmp_path, numerics, preset):
    for r in _first_updates(tmp_path, numerics, preset):
        if numerics == "invariant":
            assert r["logprob_diff_max/1.1"] == 0.0, r
            assert r["ratio_max/1.1"] == 1.0, r
            if preset == "tiny-moe":  # the engines' recorded experts are the trainer's
                assert r["expert_disagreement/1.1"] == 0.0, r
        else:  # the gap the mode closes
            assert r["logprob_diff_max/1.1"] > 1e-3, r
