"""``numerics="invariant"`` on an 8-device mesh: cases run by ``tests.support.multidevice``
in a subprocess (``tests/models/test_invariant_mesh.py``). Each returns JSON-able
measurements: whether the sampler's log-probs equal the trainer's (``np.array_equal``),
on the mesh and against one device in the same process."""

from __future__ import annotations

import numpy as np

import jaxhead
from models.mesh import make_mesh
from tests.models import test_invariant_numerics as inv
from tests.models.kv_replication_cases import relative
from tests.models.padding_cases import packed_batch, step_outputs
from train.placement import Placement

#: The rows over data x fsdp x expert (a dense model: expert is one more batch axis).
FSDP_EXPERT = {"data": 2, "fsdp": 2, "expert": 2}
#: The rows over fsdp x expert, a row's tokens over context (the trainer's side).
CONTEXT = {"fsdp": 2, "expert": 2, "context": 2}


def _compare(dtype, engine, temperature, mesh, truncation=None, preset="tiny") -> dict:
    """The rollout of ``inv._prompts()`` and the trainer's log-probs of it on ``mesh`` and
    on one device: equalities and the largest gaps."""
    mdef, _ = inv._policy(dtype, "invariant", preset)
    placement = Placement(make_mesh(mesh), mdef)
    prompts, roll = inv._rollout(dtype, "invariant", engine, temperature, preset,
                                 truncation, placement)
    trainer = inv._trainer_logprobs(dtype, "invariant", prompts, roll, temperature or 1.0,
                                    preset, placement)
    _, one = inv._rollout(dtype, "invariant", engine, temperature, preset, truncation)
    one_trainer = inv._trainer_logprobs(dtype, "invariant", prompts, one,
                                        temperature or 1.0, preset)
    live = np.arange(inv.T) < roll.lengths[:, None]
    return {
        "compared": int(live.sum()), "rows": len(roll.lengths),
        "truncated": bool(np.isfinite(roll.min_logit[live]).all()),
        "sampler_is_trainer": bool(np.array_equal(roll.logprobs, trainer)),
        "gap": float(np.abs(roll.logprobs - trainer).max()),
        "tokens_as_one_device": bool(np.array_equal(roll.tokens, one.tokens)),
        "sampler_as_one_device": bool(np.array_equal(roll.logprobs, one.logprobs)),
        "trainer_as_one_device": bool(np.array_equal(trainer, one_trainer)),
    }


def _context_step() -> dict:
    """The trainer's GRPO step (``train.steps.grpo_loss_fn``, float32) on a packed batch on
    the ``CONTEXT`` mesh vs one device: whether the log-probs are the same bits, and the
    relative error of the loss and of each gradient (the invariant attention's backward
    through the all-gather over context)."""
    mdef, params = inv._policy("float32", "invariant")
    arrays, num_seqs = packed_batch(rows=4, row_len=32)
    keep = arrays["loss_mask"] > 0
    placement = Placement(make_mesh(CONTEXT), mdef)
    want = step_outputs(mdef, params, arrays, num_seqs,
                        jaxhead.bucket_for_shards(keep, 1, multiple=16))
    got = step_outputs(mdef, params, arrays, num_seqs,
                       placement.shard_bucket(keep, multiple=16), placement)
    return {"logp_as_one_device": bool(np.array_equal(np.asarray(got["logp"])[keep],
                                                      np.asarray(want["logp"])[keep])),
            "loss": relative(got["loss"], want["loss"]),
            "grads": {k: relative(got["grads"][k], g) for k, g in want["grads"].items()}}


def mesh_case() -> dict:
    """float32, the compact engine, sampled, on ``FSDP_EXPERT``; the MoE preset alike in
    bf16 (its experts sharded over ``expert``); bf16, the reference engine, truncated
    draws, on ``CONTEXT`` (the trainer's rows split over context); the gradients on
    ``CONTEXT``."""
    return {"fsdp_expert": _compare("float32", "compact", 0.7, FSDP_EXPERT),
            "moe_fsdp_expert": _compare("bfloat16", "compact", 0.7, FSDP_EXPERT,
                                        preset="tiny-moe"),
            "context": _compare("bfloat16", "reference", 0.9, CONTEXT, inv.TRUNCATION),
            "context_step": _context_step()}
