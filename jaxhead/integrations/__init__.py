"""Adapters from other JAX libraries to jaxhead, each in its own optional module.

Nothing is imported here: ``import jaxhead`` and ``import jaxhead.integrations`` never
import a third-party RL library. Import the module you need explicitly:

  jaxhead.integrations.tunix   Tunix (``google-tunix``; ``pip install 'jaxhead[tunix]'``):
                               ``compute_per_token_logps`` from the final hidden states, and
                               every LM-head computation of Tunix's GRPO / PPO learners
                               (losses, reference / old-policy log-probs) on jaxhead,
                               switched on with ``drop_in()``
"""
