"""Tunix on jaxhead: per-token log-probs and entropy without Tunix's ``[B, T, V]`` logits.

Tunix (``google-tunix``, https://github.com/google/tunix) computes the policy log-probs of
its RL losses with ``tunix.rl.common.compute_per_token_logps(..., return_logits=True)``: the
model returns float32 logits for every position of prompt + completion, and the GRPO / PPO
losses (``tunix/rl/algo_core.py``) read the label's log-prob and the entropy
(``compute_entropy_from_logits``) from them. At a Qwen3-8B head (H = 4096, V = 151936) and
16,384 completion tokens, the loss's forward + backward holds ~31 GiB of temporaries
(``benchmarks/tunix_memory.py``).

This package computes the same numbers from the model's final hidden states (Tunix's models
sow them: ``model(..., output_hidden_states=True)`` -> ``nnx.Intermediate``
``"all_hidden_states"``) and the LM-head weight with ``jaxhead.token_logprobs`` on the
completion positions only. Under ``jit`` the model's own logits, which nothing reads, are
removed by the compiler.

  compute_per_token_logps   Tunix's function of that name (same arguments, same return
                            layout), plus ``return_entropy`` / ``completion_mask``
  grpo_loss_fn, ppo_loss_fn Tunix 0.1.7's GRPO / PPO policy losses (same arguments, loss and
                            aux metrics) with log-probs and entropy from jaxhead
  drop_in                   context manager: every LM-head computation of the Tunix
                            learners built and trained inside it (policy losses,
                            reference / old-policy / anchor log-probs, the rollout's draw)
                            on jaxhead (the one line to add; ``dropin.py`` says which hook
                            serves each)
  policy_losses, log_probs, its three parts: Tunix's registry names ``"grpo"`` / ``"ppo"``
  sampling                  resolve to the jaxhead losses; ``common.compute_per_token_logps``
                            is jaxhead's; the vanilla sampler draws with
                            ``jaxhead.sample_from_logits``
  register_model, TunixHead how to find the head (weight, optional bias) of a model class
                            (Qwen3 and Qwen2 are built in, tied and untied)

Use (``examples/tunix_grpo.py``)::

    from jaxhead.integrations import tunix as jaxhead_tunix

    with jaxhead_tunix.drop_in():                # the one line
        learner = GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=reward)
        learner.train(dataset)

Importing this package requires Tunix (``pip install 'jaxhead[tunix]'``); ``import jaxhead``
never imports it. Written against Tunix 0.1.7.
"""

try:
    import tunix.rl.algo_core  # noqa: F401 - fail here, with the install hint
except ImportError as err:  # pragma: no cover - exercised only without Tunix installed
    raise ImportError(
        "jaxhead.integrations.tunix needs Tunix: pip install 'jaxhead[tunix]' "
        "(the google-tunix package)"
    ) from err

from jaxhead.integrations.tunix.dropin import drop_in, log_probs
from jaxhead.integrations.tunix.heads import TunixHead, register_model
from jaxhead.integrations.tunix.logps import compute_per_token_logps
from jaxhead.integrations.tunix.losses import grpo_loss_fn, policy_losses, ppo_loss_fn
from jaxhead.integrations.tunix.sampler import sampling

__all__ = [
    "TunixHead",
    "compute_per_token_logps",
    "drop_in",
    "grpo_loss_fn",
    "log_probs",
    "policy_losses",
    "ppo_loss_fn",
    "register_model",
    "sampling",
]
