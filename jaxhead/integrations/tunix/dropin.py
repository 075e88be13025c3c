"""``drop_in``: every LM-head computation of Tunix's RL learners on jaxhead.

Tunix 0.1.7's GRPO-family and PPO learners compute per-token log-probs from an LM head in
four places, and the drop-in reaches each through the narrowest hook there is:

=====================================  =========================================  ==========
what                                   Tunix's path                               hook
=====================================  =========================================  ==========
policy log-probs and entropy (loss)    the registered ``"grpo"`` / ``"ppo"`` loss  registry
reference log-probs (KL)               ``RLCluster.get_ref_per_token_logps`` ->     patch
                                       ``InferenceWorker`` ->
                                       ``common.compute_per_token_logps``
old-policy log-probs (importance       ``RLCluster.get_old_per_token_logps`` ->     patch
ratio; PPO, GRPO with ``num_           ``rollout.get_per_token_logps`` ->
iterations > 1``)                      ``common.compute_per_token_logps``
anchor-policy log-probs (agentic)      ``RLCluster.get_actor_per_token_logps`` ->   patch
                                       ``common.compute_per_token_logps``
the rollout's draw (vanilla sampler,   ``Sampler._sample`` ->                       patch
``top_p`` mode)                        ``tunix.generate.sampler.sample_top_p``
=====================================  =========================================  ==========

The losses go through Tunix's public ``function_registry`` (``losses.policy_losses``).
The other three have no extension point: the ``InferenceWorker`` is built inside
``RLCluster``, and every one of them calls the module attribute
``tunix.rl.common.compute_per_token_logps``. ``log_probs`` replaces that one attribute,
for the calls that do not ask for the logits (``return_logits=False``; the others, such as
Tunix's own losses, go to Tunix's function), and puts back what it found on exit.
Tunix's vanilla sampler (``tunix.generate.sampler.Sampler``) takes no sampling function
(greedy / top-p / beam search are fixed inside it): ``sampler.sampling`` replaces the
module function its ``top_p`` mode draws with, by ``jaxhead.sample_from_logits`` (the same
distribution, another random stream; the ``[B, V]`` logits of each decode step are still
computed by Tunix's model).

A model the adapter cannot read (not registered, LoRA on the head) keeps Tunix's own
computation inside the drop-in, with one warning per model class (``fallback``;
``drop_in(strict=True)`` raises instead).

What changes in the numbers: positions outside the completion mask are exactly 0 instead
of the log-prob of the padding token there (every Tunix loss masks them out); inside it,
the same log-probs (float32: to the matmul's rounding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flax import nnx
from tunix.rl import common

from jaxhead.integrations.tunix import fallback, logps
from jaxhead.integrations.tunix.losses import policy_losses
from jaxhead.integrations.tunix.patching import replaced
from jaxhead.integrations.tunix.sampler import sampling as jaxhead_sampling


def _jaxhead_compute_per_token_logps(original, impl: str):
    """``common.compute_per_token_logps``'s signature: jaxhead's unless the caller wants
    the logits or the adapter cannot read the model (then ``original``: ``fallback``)."""

    def compute_per_token_logps(graphdef, state, prompt_tokens, completion_tokens, pad_id,
                                eos_id, images=None, stop_gradient=True, return_logits=False,
                                segment_ids=None, segment_positions=None, temperature=1.0):
        if return_logits or not fallback.readable(nnx.merge(graphdef, state)):
            return original(graphdef, state, prompt_tokens, completion_tokens, pad_id,
                            eos_id, images, stop_gradient, return_logits, segment_ids,
                            segment_positions, temperature)
        return logps.compute_per_token_logps(
            graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, images,
            stop_gradient, False, segment_ids, segment_positions, temperature, impl=impl)

    compute_per_token_logps.original = original
    compute_per_token_logps.impl = impl
    return compute_per_token_logps


@contextlib.contextmanager
def log_probs(*, impl: str = "auto", strict: bool = False) -> Iterator[None]:
    """Inside the block, Tunix's reference, old-policy and anchor-policy log-probs come
    from jaxhead (``tunix.rl.common.compute_per_token_logps`` is replaced for calls with
    ``return_logits=False``; see the module docstring). Restored on exit, errors
    included; blocks nest. These paths run while a learner trains, so the block must hold
    ``learner.train(...)``. Not thread-safe while entering or leaving.

    Args:
      impl: the jaxhead implementation (``"auto"``: by backend).
      strict: a model the adapter cannot read raises (``TypeError`` /
        ``NotImplementedError``) instead of getting Tunix's log-probs with one warning
        (``jaxhead.integrations.tunix.fallback``).
    """
    with replaced(common, "compute_per_token_logps",
                  lambda original: _jaxhead_compute_per_token_logps(original, impl)), \
            fallback.leave_to_tunix(strict):
        yield


@contextlib.contextmanager
def drop_in(*, impl: str = "auto", sampling: bool = True, strict: bool = False
            ) -> Iterator[None]:
    """Every LM-head computation of the Tunix learners built and trained inside the block
    runs on jaxhead: the GRPO / PPO policy losses (``policy_losses``), the reference,
    old-policy and anchor-policy log-probs (``log_probs``) and the vanilla sampler's draw
    (``sampling``). Everything is restored on exit.

    Example::

        with jaxhead_tunix.drop_in():
            learner = GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=fn)
            learner.train(dataset)

    Args:
      impl: the jaxhead implementation of the log-probs (``"auto"``: by backend).
      sampling: also draw the rollouts' tokens with jaxhead (the same distribution as
        Tunix's draw, not the same tokens for a seed); ``False`` keeps Tunix's draw, so a
        run reproduces Tunix's completions token for token.
      strict: raise on a model the adapter cannot read. By default such a model (a class
        not registered with ``register_model``, LoRA on the head) keeps Tunix's own
        log-probs and loss, with one ``UserWarning`` per model class naming it and
        ``register_model`` (``jaxhead.integrations.tunix.fallback``): the drop-in never
        breaks a setup that works without it.

    Raises (with ``strict``, inside the block, from the first call that meets the model):
      TypeError: a model class the adapter does not know (``register_model``).
      NotImplementedError: LM-head parameters the registration does not read.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(fallback.leave_to_tunix(strict))
        stack.enter_context(policy_losses(impl=impl, strict=strict))
        stack.enter_context(log_probs(impl=impl, strict=strict))
        if sampling:
            stack.enter_context(jaxhead_sampling())
        yield
