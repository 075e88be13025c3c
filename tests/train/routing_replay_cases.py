"""Multi-device case of routing replay (``tests/train/test_routing_replay.py``), run by
``tests.support.multidevice`` in a subprocess with 4 CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import optax

from models import get_config
from models.generate import IMPLEMENTATIONS
from models.mesh import make_mesh
from tests.support.models import random_model
from train.rl import rl_loss, rollout, state, steps, updates
from train.rl.placement import Placement, place_batch

MESH = {"fsdp": 2, "expert": 2}
G, T = 2, 8


def sharded_replay_case() -> dict:
    """A 1-layer ``tiny-moe`` over fsdp x expert: the routes each engine records sharded
    against one device's, and the sharded GRPO step's ``expert_disagreement`` with and
    without replay on a rollout drawn by a copy whose router is perturbed."""
    cfg = get_config("tiny-moe", dtype="float32", num_hidden_layers=1)
    model = random_model(cfg, seed=3)
    mdef, params = state.ModelDef.of(model.cfg), jax.device_get(state.params_of(model))
    sampler = {k: v + 0.05 * np.random.default_rng(1).standard_normal(v.shape).astype(v.dtype)
               if k.endswith("router") else v for k, v in params.items()}
    rng = np.random.default_rng(11)
    prompts = [rng.integers(20, 500, rng.integers(3, 14)).tolist() for _ in range(3)]
    placement = Placement(make_mesh(MESH), mdef)
    out: dict = {}
    ro = None
    for engine in IMPLEMENTATIONS:
        kw = {"max_new_tokens": T, "stop_ids": (7, 11), "num_valid": 500,
              "engine": engine, "page_size": 4, "record_routes": True}
        one = rollout.Generator(mdef, **kw)(sampler, prompts, jax.random.key(5),
                                            temperature=1.0, group_size=G)
        ro = rollout.Generator(mdef, placement=placement, **kw)(
            placement.place_params(sampler), prompts, jax.random.key(5), temperature=1.0,
            group_size=G)
        out[engine] = {"tokens": bool(np.array_equal(one.tokens, ro.tokens)),
                       "routes": bool(np.array_equal(one.routes, ro.routes)),
                       "prompt_routes": bool(np.array_equal(one.prompt_routes,
                                                            ro.prompt_routes))}
    n = len(prompts) * G
    comps = [ro.completion(i) for i in range(n)]
    seq_prompts = [prompts[i // G] for i in range(n)]
    values = {"old_logp": [ro.logprobs[i, :len(c)] for i, c in enumerate(comps)],
              "advantages": [np.full(len(c), (-1.0) ** i, np.float32)
                             for i, c in enumerate(comps)]}
    seqs = updates.Sequences(seq_prompts, comps, values, G,
                             [ro.sequence_routes(i, len(p)) for i, p in enumerate(seq_prompts)])
    packed = seqs.pack(np.arange(n), 32, 4)
    tx = optax.sgd(0.0)
    for replay in (False, True):
        step = steps.grpo_step(mdef, tx, rl_loss.LossConfig(max_completion_len=T), placement,
                               temperature=1.0, routing_replay=replay)
        p = placement.place_params(params)
        b = place_batch(packed.arrays(*packed.values), placement.mesh)
        _, _, metrics = step(p, placement.init_opt(tx, p), (b,), None, packed.num_seqs,
                             placement.bucket(packed, 16))
        out[f"disagreement_replay_{replay}"] = float(metrics["expert_disagreement"])
    return out
