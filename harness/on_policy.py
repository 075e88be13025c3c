"""One rollout and one GRPO update on it: the sampler's log-probs of the completion tokens
against the trainer's (issue #41), and the calls to time.

Shared by ``benchmarks/invariant.py`` (CPU seconds of both halves),
``benchmarks/mismatch.py`` (the gap and the expert disagreement: default vs routing replay vs
invariant numerics, dense and MoE) and ``benchmarks/gpu_check.py`` (the bit-equality of
``numerics="invariant"`` on a GPU).

The workload: a freshly initialised preset (``models.PRESETS``) untied, in ``dtype``
compute (parameters float32), ``prompts`` random prompts of 8-40 tokens, ``group``
samples each, ``new_tokens`` tokens each (no stop token), the ``compact`` engine at
temperature 1 (pages of 16 tokens), recording each token's experts for an MoE model as the
trainer's rollouts do (``train.run.experience.generator``); then ``train.rl.steps.grpo_step``
(forward, backward, AdamW) on the rollout packed into rows of ``row_len`` tokens with the
sampler's log-probs as the old policy's and, for an MoE model, its routes (the step's
``expert_disagreement``; with ``routing_replay`` the forward takes them: R3). The trainer's
log-probs are the step's forward before the update (``return_logp``): the GRPO loop's own
``logprob_diff_*``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

from models import Transformer, get_config
from train.rl import packing, rl_loss, rollout, steps
from train.rl.placement import place_batch
from train.rl.state import ModelDef, params_of


@dataclasses.dataclass
class Workload:
    """The calls of one workload: ``sample()`` (a rollout, ``train.rl.rollout.Rollout``) and
    ``update(routing_replay=False)`` (one GRPO step on ``rollout``: its metrics and the
    trainer's log-probs ``[rows, row_len]``; ``routing_replay``: the step's
    ``routing_replay``, the MoE layers take the rollout's recorded experts); ``packed`` the
    rollout's ``train.rl.packing.PackedBatch`` (with ``routes`` for an MoE model)."""

    sample: object
    update: object
    rollout: object
    packed: packing.PackedBatch


def workload(preset: str = "tiny", *, numerics: str = "default", dtype: str = "bfloat16",
             layers: int | None = None, prompts: int = 8, group: int = 4,
             new_tokens: int = 24, row_len: int = 128, seed: int = 0,
             config: dict | None = None) -> Workload:
    """Build the model, draw one rollout and prepare the update (both compiled on first
    call). ``config``: further ``ModelConfig`` fields over the preset's (e.g.
    ``{"scan_layers": True, "remat": True}``, the training settings of the presets).

    Raises:
      ValueError: a config the model refuses (e.g. ``numerics="invariant"`` for what the
        mode does not cover: ``models.invariant.check_config``'s message).
    """
    overrides = dict(config or {})
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    cfg = get_config(preset, dtype=dtype, tie_word_embeddings=False, numerics=numerics,
                     **overrides)
    mdef, params = ModelDef.of(cfg), params_of(Transformer(cfg, rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    vocab = min(cfg.vocab_size, 500)
    texts = [rng.integers(10, vocab, int(n)).tolist() for n in rng.integers(8, 41, prompts)]
    gen = rollout.Generator(mdef, max_new_tokens=new_tokens, stop_ids=(), num_valid=vocab,
                            engine="compact", page_size=16, record_routes=cfg.is_moe)

    def sample():
        return gen(params, texts, jax.random.key(seed + 1), temperature=1.0,
                   group_size=group)

    ro = sample()
    comps = [ro.completion(i) for i in range(len(ro.lengths))]
    adv = rng.normal(size=len(comps)).astype(np.float32)
    prompt_of = [texts[i // group] for i in range(len(comps))]
    packed = packing.pack(
        prompt_of, comps, row_len, row_multiple=2,
        values={"old_logp": [ro.logprobs[i, :len(c)] for i, c in enumerate(comps)],
                "advantages": [np.full(len(c), adv[i]) for i, c in enumerate(comps)]},
        routes=None if ro.routes is None else [
            ro.sequence_routes(i, len(p)) for i, p in enumerate(prompt_of)])
    batch = place_batch(packed.arrays("old_logp", "advantages"))
    tx = optax.adamw(1e-4)
    opt_state = tx.init(params)
    compiled = {}

    def update(routing_replay: bool = False):  # the step donates its inputs: fresh copies
        if routing_replay not in compiled:
            compiled[routing_replay] = steps.grpo_step(
                mdef, tx, rl_loss.LossConfig(), temperature=1.0, return_logp=True,
                routing_replay=routing_replay)
        p = jax.tree.map(lambda x: x.copy(), params)
        o = jax.tree.map(lambda x: x.copy(), opt_state)
        _, _, metrics, logps = compiled[routing_replay](p, o, (batch,), None, packed.num_seqs,
                                                        packed.bucket())
        return metrics, logps[0]

    return Workload(sample, update, ro, packed)


def gap(work: Workload, routing_replay: bool = False) -> dict:
    """The sampler's vs the trainer's log-probs of the completion tokens after one
    ``update(routing_replay)``: ``diff`` (``|logp_trainer - logp_sampler|`` per token,
    nats, float64 ``[tokens]``), its ``max`` and ``mean`` (floats), ``equal``
    (``np.array_equal`` of the two float32 arrays) and ``tokens``; for an MoE model
    ``expert_disagreement`` (the step's metric: the fraction of the sampler's recorded
    (token, MoE layer, slot) routes the trainer's forward did not take) and ``routes`` (how
    many it compared, prompt tokens included), else None and 0.

    Raises:
      ValueError: ``routing_replay`` for a dense model (no routes to replay).
    """
    if routing_replay and work.packed.routes is None:
        raise ValueError("routing_replay=True needs an MoE model: this workload's model is "
                         "dense (no router, no routes recorded)")
    metrics, logps = work.update(routing_replay)
    mask = np.asarray(work.packed.loss_mask, bool)
    trainer = np.asarray(logps)[mask]
    sampler = np.asarray(work.packed.values["old_logp"])[mask]
    diff = np.abs(trainer.astype(np.float64) - sampler)
    moe = work.packed.routes is not None
    return {"diff": diff, "max": float(diff.max()), "mean": float(diff.mean()),
            "equal": bool(np.array_equal(trainer, sampler)), "tokens": int(mask.sum()),
            "expert_disagreement": float(metrics["expert_disagreement"]) if moe else None,
            "routes": int(np.count_nonzero(work.packed.routes >= 0)) if moe else 0}
