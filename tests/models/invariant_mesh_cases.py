"""``numerics="invariant"`` on an 8-device mesh: cases run by ``tests.support.multidevice``
in a subprocess (``tests/models/test_invariant_mesh.py``). Each returns JSON-able
measurements: whether the sampler's log-probs equal the trainer's (``np.array_equal``),
on the mesh and against one device in the same process."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxhead
from models import get_config
from models.invariant import row_tiled
from models.mesh import make_mesh
from models.sharding import jit_sharded, state_shardings
from tests.models import test_invariant_numerics as inv
from tests.models.kv_replication_cases import relative
from tests.models.padding_cases import packed_batch, step_outputs
from tests.support.models import random_model
from train.rl.placement import Placement

#: The rows over data x fsdp x expert (a dense model: expert is one more batch axis).
FSDP_EXPERT = {"data": 2, "fsdp": 2, "expert": 2}
#: The rows over fsdp x expert, a row's tokens over context (the trainer's side).
CONTEXT = {"fsdp": 2, "expert": 2, "context": 2}
#: Expert-parallel meshes of the invariant MoE block: expert = 8, 4, 2 (the last with a
#: row's tokens over context too).
EXPERT_MESHES = {"expert8": {"expert": 8}, "fsdp2_expert4": {"fsdp": 2, "expert": 4},
                 "data2_expert2_context2": {"data": 2, "expert": 2, "context": 2}}


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
    """The trainer's GRPO step (``train.rl.steps.grpo_loss_fn``, float32) on a packed batch on
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


def _moe_block() -> dict:
    """The ``tiny-moe`` preset's invariant MoE block (bf16: the router on row tiles, then
    ``MoE.residual_block``) on each of ``EXPERT_MESHES`` vs one device: whether its output
    is the same bits, the relative error of its gradients (the default path's, reduced in
    another order), and the shapes of the expert weights the compiled forward all-gathers
    (none whole: the experts stay sharded over ``expert``)."""
    cfg = get_config("tiny-moe", dtype="bfloat16", numerics="invariant")
    moe = random_model(cfg, seed=0).layers[0].mlp
    graph, params = nnx.split(moe)
    keys = jax.random.split(jax.random.key(3), 3)
    shape = (8, 16, cfg.hidden_size)
    x, h, cot = (jax.random.normal(k, shape, jnp.float32) for k in keys)
    x, h = x.astype(jnp.bfloat16), h.astype(jnp.bfloat16)
    mask = jnp.arange(16)[None, :] < jnp.array([16, 9, 16, 3, 16, 16, 12, 0])[:, None]

    def block(params, x, h, split=False):
        m = nnx.merge(graph, params)
        _, weights, experts = row_tiled(m.route_tile, h, split_tokens=split)
        return m.residual_block(x, h, weights, experts, mask, split_tokens=split)

    def loss(params, x, h, split=False):
        return jnp.sum(block(params, x, h, split).astype(jnp.float32) * cot)

    grad = jax.grad(loss, (0, 1, 2))
    want_y = np.asarray(jax.jit(block)(params, x, h).astype(jnp.float32))
    want_g = jax.tree.leaves(jax.jit(grad)(params, x, h))
    whole = {f"[{cfg.num_experts},{cfg.hidden_size},{cfg.moe_intermediate_size}]",
             f"[{cfg.num_experts},{cfg.moe_intermediate_size},{cfg.hidden_size}]"}
    out = {}
    for name, axes in EXPERT_MESHES.items():
        mesh = make_mesh(axes)
        split = "context" in axes
        placed = jax.device_put(params, state_shardings(params, mesh, cfg.sharding_rules))
        fwd = jit_sharded(lambda p, x, h, split=split: block(p, x, h, split), mesh)
        y = np.asarray(fwd(placed, x, h).astype(jnp.float32))
        hlo = fwd.lower(placed, x, h).compile().as_text()
        gathered = sorted({m for m in re.findall(r"= \w+(\[[\d,]+\])\S* all-gather\(", hlo)
                           if m in whole})
        g = jit_sharded(lambda p, x, h, split=split: grad(p, x, h, split), mesh)(
            placed, x, h)
        out[name] = {"as_one_device": bool(np.array_equal(y, want_y)),
                     "gap": float(np.abs(y - want_y).max()),
                     "whole_experts_gathered": gathered,
                     "grads": max(relative(a, b) for a, b in zip(jax.tree.leaves(g),
                                                                 want_g))}
    return out


def fsdp_expert_case() -> dict:
    """float32, the compact engine, sampled, rows on ``FSDP_EXPERT``."""
    return _compare("float32", "compact", 0.7, FSDP_EXPERT)


def moe_fsdp_expert_case() -> dict:
    """The MoE preset in bf16, the compact engine, sampled, rows on ``FSDP_EXPERT`` (its
    experts sharded over ``expert``)."""
    return _compare("bfloat16", "compact", 0.7, FSDP_EXPERT, preset="tiny-moe")


def context_case() -> dict:
    """bf16, the reference engine, truncated draws, on ``CONTEXT`` (the trainer's rows
    split over context); and the GRPO step's gradients on ``CONTEXT``."""
    return {"context": _compare("bfloat16", "reference", 0.9, CONTEXT, inv.TRUNCATION),
            "context_step": _context_step()}


def moe_block_case() -> dict:
    """The invariant MoE block on ``EXPERT_MESHES`` (its own process: its own time
    limit)."""
    return _moe_block()
