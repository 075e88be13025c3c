"""The MoE load-balancing loss under micro-batches (MaxText #1483's case): each part's loss
is weighted by its share of the mini-batch's real tokens, so padding-only parts weigh 0 and
parts that route alike add up to the whole batch's loss. Before, each of ``m`` parts
weighed ``1 / m``: with two padding-only parts of four the load-balancing term was half."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from models import get_config
from tests.support.models import random_model
from train.rl import packing, rl_loss, steps
from train.rl.placement import place_batch
from train.rl.state import ModelDef, params_of


@pytest.fixture(scope="module")
def moe():
    cfg = get_config("tiny-moe", dtype="float32").replace(router_aux_loss_coef=1.0)
    return ModelDef.of(cfg), params_of(random_model(cfg, seed=2))


def test_padding_only_micro_batches_weigh_nothing(moe):
    mdef, params = moe
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, 9).tolist() for _ in range(2)]
    comps = [rng.integers(10, 500, 7).tolist() for _ in range(2)]
    # one row of sequences, twice: the two real parts route alike; 2 padding-only rows
    packed = packing.pack(prompts * 2, comps * 2, 32, num_rows=4, values={
        "old_logp": [-rng.uniform(1, 4, 7)] * 4,
        "advantages": [np.full(7, a, np.float32) for a in (1.0, -1.0, 1.0, -1.0)]})
    assert np.count_nonzero(packed.segment_ids[2:]) == 0  # rows 2, 3: padding only
    loss_fn = jax.jit(steps.grpo_loss_fn(mdef, rl_loss.LossConfig(max_completion_len=7), 1.0,
                                         skip=False), static_argnums=(3, 4))

    def loss(piece, norm=None):
        b = place_batch(piece.arrays("old_logp", "advantages"))
        return float(loss_fn(params, b, None, packed.num_seqs, None, norm)[0])

    without_aux = jax.jit(steps.grpo_loss_fn(
        mdef.__class__.of(mdef.cfg.replace(router_aux_loss_coef=0.0)),
        rl_loss.LossConfig(max_completion_len=7), 1.0, skip=False), static_argnums=(3, 4))
    b = place_batch(packed.arrays("old_logp", "advantages"))
    whole = loss(packed)
    aux = whole - float(without_aux(params, b, None, packed.num_seqs, None)[0])
    assert aux > 0.5  # the Switch loss is top_k when balanced
    norm = rl_loss.LossNorm.of(packed.loss_mask, packed.seq_index, packed.num_seqs,
                               packed.segment_ids)
    for rows in ((0, 1, 2, 3), (0, 2, 4)):  # 4 parts of 1 row, 2 parts of 2 rows
        parts = [packed.rows(a, b) for a, b in itertools.pairwise(rows)]
        split = sum(loss(p, norm) for p in parts)
        assert abs(split - whole) <= 1e-6 * abs(whole), (rows, split, whole, aux)
