"""Multi-device case of the trainer's GRPO step, run by ``tests.support.multidevice`` in
a subprocess with 8 CPU devices (``tests/train/test_sharded_step.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from harness.oracle import max_abs
from models import get_config
from models.mesh import make_mesh
from tests.models.sharding_cases import MOE_MESH
from tests.support.models import random_model


def grpo_step_case() -> dict:
    """``train.rl.steps.grpo_step`` (reference forward, clipped surrogate, KL, entropy, MoE aux
    loss, Adam) on the tiny MoE: on one device vs placed by ``train.rl.placement.Placement``
    on data=2 x expert=4 (expert-parallel MoE, sharded head, sharded Adam moments), on one
    batch and on two micro-batches (gradient accumulation). Adam runs with ``eps=1`` so
    that an update is a smooth function of its gradient."""
    import optax

    from train.rl import rl_loss, state, steps
    from train.rl.packing import pack
    from train.rl.placement import Placement, place_batch

    model = random_model(get_config("tiny-moe", dtype="float32"), seed=3)
    mdef, params = state.ModelDef.of(model.cfg), jax.device_get(state.params_of(model))
    tx = optax.adam(1.0, eps=1.0)
    lcfg = rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3",
                              entropy_coef=0.01, aggregation="token-mean",
                              max_completion_len=12)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, 500, rng.integers(4, 12)).tolist() for _ in range(12)]
    comps = [rng.integers(1, 500, rng.integers(2, 13)).tolist() for _ in range(12)]
    adv = rng.standard_normal(12).astype(np.float32)
    packed = pack(prompts, comps, 32, row_multiple=8, values={
        "old_logp": [rng.uniform(-7.0, -5.0, len(c)) for c in comps],
        "advantages": [np.full(len(c), a, np.float32) for c, a in zip(comps, adv)]})

    # the same sequences in 16 rows as 2 micro-batches of 8 (gradient accumulation)
    rows16 = pack(prompts, comps, 32, num_rows=16,
                  values={k: packed.per_sequence(v) for k, v in packed.values.items()})
    micro = [rows16.rows(0, 8), rows16.rows(8, 16)]
    norm = rl_loss.LossNorm.of(rows16.loss_mask, rows16.seq_index, rows16.num_seqs)

    def run(placement):
        def fresh():
            p = jax.tree.map(jnp.asarray, params) if placement is None else \
                placement.place_params(params)
            return p, placement.init_opt(tx, p) if placement else tx.init(p)

        mesh = placement.mesh if placement else None
        forward = steps.reference_logprobs(mdef, placement, temperature=1.0)
        step = steps.grpo_step(mdef, tx, lcfg, placement, temperature=1.0)
        p, opt = fresh()
        b = place_batch(packed.arrays("old_logp", "advantages"), mesh)
        bucket = placement.bucket(packed, 16) if placement else packed.bucket(16)
        ref = forward(p, b, bucket)
        new, opt, m = step(p, opt, (b,), (ref,), packed.num_seqs, bucket)
        p, opt_m = fresh()
        bs = tuple(place_batch(x.arrays("old_logp", "advantages"), mesh) for x in micro)
        bucket_m = max(placement.bucket(x, 16) if placement else x.bucket(16) for x in micro)
        refs = tuple(forward(p, x, bucket_m) for x in bs)
        new_m, _, m_m = step(p, opt_m, bs, refs, rows16.num_seqs, bucket_m, norm)
        return new, opt, m, bucket, new_m, m_m

    p1, o1, m1, bucket1, pm1, mm1 = run(None)
    placement = Placement(make_mesh(MOE_MESH), mdef)
    p8, o8, m8, bucket8, pm8, mm8 = run(placement)
    gate = "layers.0.mlp.gate_proj"
    return {
        "metrics": {k: max_abs(m8[k], m1[k]) for k in m1},
        "values": {k: float(v) for k, v in m1.items()},
        "params": max(max_abs(p8[k], p1[k]) for k in p1),
        "param_change": max(max_abs(p1[k], params[k]) for k in p1),
        "moments": max(max_abs(a, b) for a, b in zip(jax.tree.leaves(o8),
                                                       jax.tree.leaves(o1), strict=True)),
        "buckets": [bucket1, bucket8], "rows": int(packed.tokens.shape[0]),
        "micro_metrics": {k: max_abs(mm8[k], mm1[k]) for k in mm1},
        "micro_values": {k: float(v) for k, v in mm1.items()},
        "micro_params": max(max_abs(pm8[k], pm1[k]) for k in pm1),
        "param_specs_kept": all(p8[k].sharding == placement.params[k] for k in p8),
        "gate_shard": list(p8[gate].sharding.shard_shape(p8[gate].shape)),
        "gate_moment_shard": [list(x.sharding.shard_shape(x.shape)) for x in
                              jax.tree.leaves(o8) if x.shape == p8[gate].shape],
    }
