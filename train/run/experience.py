"""From a GRPO rollout to the updates' input: the rollouts' truncation and sampler, the
completions' rewards and the rows (prompt + completion, sampler log-probs, advantages)
``train.rl.updates.Updater`` packs and trains on."""

from __future__ import annotations

import numpy as np

from train.rl import rollout, updates
from train.rl.rollout_settings import RolloutSettings
from train.run import setup


def scored_on_sampler_support(cfg, settings: RolloutSettings) -> bool:
    """Whether the trainer scores tokens on the rollouts' truncated support (the trainer's
    and the reference's log-probs take ``min_logit``); False when sampling is not truncated
    (``settings.truncation``) or ``loss.logprob_support == "full"``.

    Raises:
      ValueError: ``loss.logprob_support`` not in ``rollout.LOGPROB_SUPPORT``.
    """
    support = rollout.LOGPROB_SUPPORT.require("loss.logprob_support", cfg.loss.logprob_support)
    return support == "sampler" and settings.truncation.active


def generator(s: setup.Setup, truncation: rollout.Truncation | None = None
              ) -> rollout.Generator:
    """The run's KV-cache sampler (``s.rollout.generator``; ``truncation``: another than
    the rollouts', e.g. none for the held-out evaluation), sharded over the run's mesh
    (``s.placement``) like the training step; for an MoE model it records each token's
    experts (``Rollout.routes``: the trainer's ``expert_disagreement`` and
    ``loss.routing_replay`` read them; ``M x k`` int32 per token, next to the KV cache's
    ``2 L x kv heads x head_dim`` values)."""
    return s.rollout.generator(s.mdef, stop_ids=s.tasks.stop_ids,
                               num_valid=s.tokenizer.num_valid, placement=s.placement,
                               record_routes=s.mdef.cfg.is_moe, truncation=truncation)


def score(cfg, s: setup.Setup, problems, ro: rollout.Rollout) -> tuple[np.ndarray, np.ndarray]:
    """``(rewards [P, G], correct [P, G])`` of the rollout's ``P * G`` completions (G per
    problem, in order): ``Tasks.reward`` with the format reward, and whether the task
    score alone is 1; a completion the budget cut off is scored on what it wrote."""
    g = s.rollout.group_size
    rewards, correct = [], []
    for i in range(len(problems) * g):
        ids, stopped, p = ro.completion(i), bool(ro.stopped[i]), problems[i // g]
        rewards.append(s.tasks.reward(p, ids, stopped, cfg.data.format_reward))
        correct.append(float(s.tasks.reward(p, ids, stopped) >= 1.0))
    shape = (len(problems), g)
    return np.reshape(rewards, shape), np.reshape(correct, shape)


def rollout_sequences(cfg, s: setup.Setup, problems, ro: rollout.Rollout,
                      advantages: np.ndarray) -> updates.Sequences:
    """Prompt + completion of every row of the rollout with the sampler log-probs
    (``old_logp``), the completion's advantage on each of its tokens and, when scored on
    the sampler's support (``scored_on_sampler_support``), each token's ``min_logit``;
    with ``loss.logprob_support == "full"`` ``old_logp`` is the full-softmax log-prob
    (``logprobs + logmass``); with recorded routes (an MoE model), each sequence's
    (``Rollout.sequence_routes``)."""
    g = s.rollout.group_size
    n = len(problems) * g
    comps = [ro.completion(i) for i in range(n)]
    adv = advantages.reshape(-1)
    on_support = scored_on_sampler_support(cfg, s.rollout)
    old = ro.logprobs if on_support else ro.logprobs + ro.logmass

    def per_token(x):
        return [x[i, : len(c)] for i, c in enumerate(comps)]

    values = {"old_logp": per_token(old),
              "advantages": [np.full(len(c), adv[i], np.float32) for i, c in enumerate(comps)]}
    if on_support:
        values["min_logit"] = per_token(ro.min_logit)
    prompts = [problems[i // g].prompt for i in range(n)]
    routes = None if ro.routes is None else [
        ro.sequence_routes(i, len(p)) for i, p in enumerate(prompts)]
    return updates.Sequences(prompts, comps, values, g, routes)
