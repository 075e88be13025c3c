"""Tunix's GRPO learner with every LM-head computation on jaxhead: one added line.

    pip install -e '.[tunix]' && python examples/tunix_grpo.py

Two GRPO steps of a tiny random Qwen3 (float32, tied head) on CPU, with a character
tokenizer and a toy reward. With a real model, tokenizer and cluster, only the ``with`` line
in ``main`` is new: inside it the learner's policy loss, reference and old-policy log-probs
come from ``jaxhead.integrations.tunix`` and the rollouts are drawn by jaxhead; the block
restores Tunix's own on exit. ``tests/jaxhead/test_tunix.py`` trains this cluster with and
without ``drop_in(sampling=False)`` (Tunix's draw kept, so the completions are the same) and
compares the metrics, and trains it inside the whole ``drop_in()``.

The prompts are a numpy array of strings, as Tunix's learner expects: it repeats every
batch entry ``num_generations`` times with ``np.repeat`` over the batch's leaves, so a
Python list of strings would turn each string into an array of copies (and the tokenizer
would see no text).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import rl_cluster as rl
from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
from tunix.rl.rollout.base_rollout import RolloutConfig

from jaxhead.integrations import tunix as jaxhead_tunix

TEXTS = np.array(["what is 3 4?", "say 7"])
PROMPTS = [{"prompts": TEXTS}] * 2  # two batches: two steps


class CharTokenizer:
    """Characters as ids 3.. (pad 0, bos 1, eos 2): what Tunix's tokenizer adapter calls."""

    chars = "abcdefghijklmnopqrstuvwxyz 0123456789?"

    def encode(self, text, **kwargs):
        return [1] + [3 + self.chars.index(c) for c in text if c in self.chars]

    def decode(self, ids, **kwargs):
        return "".join(self.chars[i - 3] for i in ids if 3 <= i < 3 + len(self.chars))

    def bos_id(self):
        return 1

    def eos_id(self):
        return 2

    def pad_id(self):
        return 0


def reward(prompts, completions, **kwargs):
    """Toy reward: distinct characters, plus a bonus for each '7'."""
    return [float(len(set(c))) + 0.5 * c.count("7") for c in completions]


def tiny_qwen3(seed: int = 0) -> qwen3.Qwen3:
    cfg = qwen3.ModelConfig(
        num_layers=1, vocab_size=3 + len(CharTokenizer.chars), embed_dim=64, hidden_dim=128,
        num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6,
        use_tied_embedding=True,
    )
    return qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))


def cluster(max_steps: int = 2) -> rl.RLCluster:
    """Actor, reference and rollout on one device, vanilla sampler, SGD."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (rl.Role.ACTOR, rl.Role.REFERENCE, rl.Role.ROLLOUT)
    config = rl.ClusterConfig(
        role_to_mesh={role: mesh for role in roles},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=max_steps),
        rollout_config=RolloutConfig(max_tokens_to_generate=6, max_prompt_length=16,
                                     kv_cache_size=32, temperature=0.9),
    )
    return rl.RLCluster(actor=tiny_qwen3(), reference=tiny_qwen3(),
                        tokenizer=CharTokenizer(), cluster_config=config)


def main():
    rl_cluster = cluster()
    with jaxhead_tunix.drop_in():  # the one line: every head computation now runs on jaxhead
        learner = GRPOLearner(rl_cluster=rl_cluster, reward_fns=reward,
                              algo_config=GRPOConfig(num_generations=2, beta=0.04))
        learner.train(PROMPTS)
    logger = rl_cluster.actor_trainer.metrics_logger
    for name in ("loss", "kl", "grad_norm"):
        print(name, logger.get_metric_history("actor", name, "train"))


if __name__ == "__main__":
    main()
