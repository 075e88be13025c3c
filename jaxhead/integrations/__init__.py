"""Adapters from other JAX libraries to jaxhead, each in its own optional module.

Nothing is imported here: ``import jaxhead`` and ``import jaxhead.integrations`` never
import a third-party RL library. Import the module you need explicitly:

  jaxhead.integrations.tunix   Tunix (``google-tunix``; ``pip install 'jaxhead[tunix]'``):
                               ``compute_per_token_logps`` from the final hidden states, and
                               Tunix's GRPO / PPO policy losses on jaxhead, switched on with
                               ``policy_losses()``
"""
