"""Tunix 0.1.7's GRPO and PPO policy losses with log-probs and entropy from jaxhead, and
``policy_losses``, the switch that makes Tunix's learners use them.

The losses keep Tunix's arguments, formulas, aux metrics and registry names
(``tunix/rl/algo_core.py``: ``grpo_loss_fn``, ``ppo_policy_loss_fn``); only where the
per-token log-probs and the entropy come from changes (``logps.policy_logps`` instead of
Tunix's full logits). ``tests/jaxhead/test_tunix.py`` checks loss, aux and gradients
against the installed Tunix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from tunix.rl import algo_core, common, function_registry

from jaxhead.integrations.tunix import fallback, logps


def grpo_loss_fn(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    """Tunix's GRPO policy loss with log-probs and entropy from jaxhead.

    The same loss, aux metrics and gradients as ``tunix.rl.algo_core.grpo_loss_fn``
    (Tunix 0.1.7): clipped importance ratio (``epsilon``, ``epsilon_high``, dual clip
    ``epsilon_c``), ``loss_algo`` ``"grpo"`` or ``"gspo-token"``, ``loss_agg_mode``,
    sampler importance weights, KL to the reference (``beta``, ``kl_loss_mode``,
    ``kl_clamp_value``) and the logged entropy; only the policy log-probs and the entropy
    come from ``compute_per_token_logps`` (jaxhead) instead of Tunix's full logits. The aux
    keys and their meaning are Tunix's; ``tests/jaxhead/test_tunix.py`` checks loss,
    gradients and aux against the installed Tunix.

    Args:
      model: the policy, as Tunix's trainer passes it: a registered model class; inside
        ``drop_in()`` another one gets Tunix's own loss (``fallback``, one warning).
      train_example: ``tunix.rl.common.TrainExample`` (packed or not).
      algo_config: ``GRPOConfig`` (``temperature`` set by the learner).
      pad_id, eos_id: the tokenizer's ids.
      **kwargs: ignored, as in Tunix.

    The signature is Tunix's (``tunix.rl.algo_core.grpo_loss_fn``), so every call form of
    Tunix's trainers works, including ``nnx.value_and_grad(loss_fn)(model, **inputs)``
    (nnx binds keyword arguments to positions, and refuses keyword-only parameters). The
    jaxhead implementation is ``"auto"``; ``policy_losses(impl=...)`` registers the loss
    with another.

    Returns:
      ``(loss, aux)``: scalar float32 loss and Tunix's aux dict.
    """
    if not fallback.readable(model):  # inside the drop-in: Tunix's loss (see fallback)
        return algo_core.grpo_loss_fn(model, train_example, algo_config, pad_id, eos_id,
                                      **kwargs)
    del kwargs
    return _grpo(model, train_example, algo_config, pad_id, eos_id, "auto")


def _grpo(model, train_example, algo_config, pad_id, eos_id, impl):
    masked_mean = algo_core.masked_mean
    beta = algo_config.beta
    epsilon = algo_config.epsilon
    epsilon_high = getattr(algo_config, "epsilon_high", epsilon)
    epsilon_c = getattr(algo_config, "epsilon_c", None)
    agg = algo_config.loss_agg_mode
    mask = train_example.completion_mask

    per_token_logps, token_entropy = logps.policy_logps(
        model, train_example, pad_id, eos_id, temperature=algo_config.temperature,
        with_entropy=True, impl=impl,
    )
    advantages = jnp.astype(train_example.advantages, jnp.float32)
    if train_example.old_per_token_logps is None:
        old_per_token_logps = jax.lax.stop_gradient(per_token_logps)
    else:
        old_per_token_logps = jnp.astype(train_example.old_per_token_logps, jnp.float32)

    log_ratio = per_token_logps - old_per_token_logps
    ppo_kl = masked_mean(-log_ratio, mask)
    log_ratio = jnp.clip(log_ratio, max=20.0, min=-20.0)
    if algo_config.loss_algo == "gspo-token":
        seq_log_ratio = (log_ratio * mask).sum(axis=-1) / jnp.clip(mask.sum(-1), min=1)
        log_ratio = (per_token_logps - jax.lax.stop_gradient(per_token_logps)
                     + jnp.expand_dims(jax.lax.stop_gradient(seq_log_ratio), axis=-1))
        log_ratio = jnp.clip(log_ratio, max=10.0)
    is_ratio = jnp.exp(log_ratio)

    adv = advantages if advantages.ndim == 2 else jnp.expand_dims(advantages, 1)
    pg_loss_1 = -adv * is_ratio
    pg_loss_2 = -adv * jnp.clip(is_ratio, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = jnp.maximum(pg_loss_1, pg_loss_2).astype(jnp.float32)
    clipped_fraction = masked_mean(jnp.greater(pg_loss_2, pg_loss_1), mask)

    pg_loss_3 = -epsilon_c * adv if epsilon_c is not None else per_token_loss
    pg_clipfrac_lower = common.aggregate_loss(
        ((per_token_loss > pg_loss_3) & (adv < 0.0)).astype(jnp.float32), mask, agg
    )
    per_token_loss = jnp.where(adv < 0.0, jnp.minimum(pg_loss_3, per_token_loss),
                               per_token_loss)
    sampler_is_weights = getattr(train_example, "sampler_is_weights", None)
    if sampler_is_weights is not None:
        per_token_loss = per_token_loss * sampler_is_weights.astype(jnp.float32)
    loss = common.aggregate_loss(per_token_loss, mask, agg)

    adv_broadcast = jnp.broadcast_to(adv, mask.shape)
    aux = {
        "kl": 0.0,
        "kl_loss": 0.0,
        "pg_loss": loss,
        "pg_clipfrac": clipped_fraction,
        "ppo_kl": ppo_kl,
        "pg_clipfrac_lower": pg_clipfrac_lower,
        "is_ratio/mean": masked_mean(is_ratio, mask),
        "is_ratio/max": jnp.max(jnp.where(mask > 0, is_ratio, 0.0)),
        "is_ratio/min": jnp.min(jnp.where(mask > 0, is_ratio, jnp.inf)),
        "log_ratio/abs_mean": masked_mean(jnp.abs(log_ratio), mask),
        "pg_loss/unclipped_mean": masked_mean(pg_loss_1, mask),
        "pg_loss/clipped_mean": masked_mean(pg_loss_2, mask),
        "advantage/abs_mean": masked_mean(jnp.abs(adv_broadcast), mask),
        "advantage/max": jnp.max(jnp.where(mask > 0, adv_broadcast, -jnp.inf)),
        "advantage/min": jnp.min(jnp.where(mask > 0, adv_broadcast, jnp.inf)),
        "advantage/nonzero_frac": masked_mean(
            (jnp.abs(adv_broadcast) > 1e-8).astype(jnp.float32), mask),
    }
    if sampler_is_weights is not None:
        sis = sampler_is_weights.astype(jnp.float32)
        aux["sampler_is/weight_mean"] = masked_mean(sis, mask)
        aux["sampler_is/weight_min"] = jnp.min(jnp.where(mask > 0, sis, jnp.inf))
    else:
        aux["sampler_is/weight_mean"] = jnp.float32(1.0)
        aux["sampler_is/weight_min"] = jnp.float32(1.0)
    if train_example.ref_per_token_logps is not None:
        kl = common.compute_kl_divergence(
            per_token_logps, train_example.ref_per_token_logps, algo_config.kl_loss_mode,
            clamp_value=algo_config.kl_clamp_value,
        )
        aux["kl"] = jnp.astype((kl * mask).sum() / jnp.clip(mask.sum(), min=1), jnp.float32)
        kl_loss = common.aggregate_loss(kl, mask, agg)
        aux["kl_loss"] = kl_loss
        if beta is not None and beta != 0.0:
            loss = loss + beta * kl_loss
    aux["entropy"] = common.aggregate_loss(token_entropy, mask, agg)
    return loss, aux


def ppo_loss_fn(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    """Tunix's PPO policy loss with log-probs and entropy from jaxhead.

    The same loss, aux and gradients as ``tunix.rl.algo_core.ppo_policy_loss_fn`` (Tunix
    0.1.7): clipped ratio (``epsilon_low``, ``epsilon_high``, dual clip ``epsilon_c``),
    token-mean over the completion mask, the entropy bonus ``entropy_coef`` (its gradient
    goes through jaxhead's entropy) and the optional KL term (``kl_coef``). As in Tunix,
    the log-probs are at temperature 1. The entropy is computed only when
    ``entropy_coef`` is set and non-zero.

    Args / Returns / signature: as ``grpo_loss_fn`` (``algo_config`` a ``PPOConfig``;
    ``tunix.rl.algo_core.ppo_policy_loss_fn``'s signature).
    """
    if not fallback.readable(model):
        return algo_core.ppo_policy_loss_fn(model, train_example, algo_config, pad_id, eos_id,
                                            **kwargs)
    del kwargs
    return _ppo(model, train_example, algo_config, pad_id, eos_id, "auto")


def _ppo(model, train_example, algo_config, pad_id, eos_id, impl):
    masked_mean = algo_core.masked_mean
    entropy_coef = algo_config.entropy_coef
    with_entropy = entropy_coef is not None and entropy_coef != 0.0
    mask = train_example.completion_mask

    per_token_logps, token_entropy = logps.policy_logps(
        model, train_example, pad_id, eos_id, temperature=1.0, with_entropy=with_entropy,
        impl=impl,
    )
    advantages = train_example.advantages
    ratio = jnp.exp(per_token_logps - train_example.old_per_token_logps)
    pg_losses_1 = -ratio * advantages
    pg_losses_2 = -jnp.clip(ratio, 1 - algo_config.epsilon_low,
                            1 + algo_config.epsilon_high) * advantages
    per_token_loss = jnp.maximum(pg_losses_1, pg_losses_2)
    epsilon_c = getattr(algo_config, "epsilon_c", None)
    pg_loss_3 = -epsilon_c * advantages if epsilon_c is not None else per_token_loss
    pg_clipfrac_lower = masked_mean(
        ((per_token_loss > pg_loss_3) & (advantages < 0.0)).astype(jnp.float32), mask
    )
    pg_losses = jnp.where(advantages < 0.0, jnp.minimum(pg_loss_3, per_token_loss),
                          per_token_loss)
    aux = {
        "pg_clipfrac": masked_mean(jnp.greater(pg_losses_2, pg_losses_1), mask),
        "pg_clipfrac_lower": pg_clipfrac_lower,
    }
    loss = masked_mean(pg_losses, mask)
    if with_entropy:
        entropy_loss = masked_mean(token_entropy, mask)
        loss = loss - entropy_coef * entropy_loss
        aux["loss/entropy"] = entropy_loss
    kl_coef = getattr(algo_config, "kl_coef", 0.0)
    if kl_coef > 0.0 and train_example.ref_per_token_logps is not None:
        kl = common.compute_kl_divergence(
            per_token_logps, train_example.ref_per_token_logps, "kl",
            clamp_value=getattr(algo_config, "kl_clamp_value", None),
        )
        kl_loss = masked_mean(kl, mask)
        loss = loss + kl_coef * kl_loss
        aux["kl"] = kl_loss
    return loss, aux


_LOSSES = {"grpo": (grpo_loss_fn, _grpo), "ppo": (ppo_loss_fn, _ppo)}
_TUNIX_LOSSES = {"grpo": "grpo_loss_fn", "ppo": "ppo_policy_loss_fn"}  # in algo_core


def registered_loss(name: str, impl: str = "auto"):
    """The loss ``policy_losses`` registers for ``name`` with jaxhead implementation
    ``impl``: the public function for ``"auto"``, else a function of the same (Tunix's)
    signature that runs ``impl``; its attribute ``impl`` names it."""
    public, body = _LOSSES[name]
    if impl == "auto":
        return public

    def loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
        if not fallback.readable(model):
            return getattr(algo_core, _TUNIX_LOSSES[name])(
                model, train_example, algo_config, pad_id, eos_id, **kwargs)
        del kwargs
        return body(model, train_example, algo_config, pad_id, eos_id, impl)

    loss.__name__ = loss.__qualname__ = public.__name__
    loss.__doc__ = f"{public.__name__} with jaxhead impl={impl!r}."
    loss.impl = impl
    return loss


@contextlib.contextmanager
def policy_losses(names: Sequence[str] = ("grpo", "ppo"), *, impl: str = "auto",
                  strict: bool = False) -> Iterator[None]:
    """Inside the block, Tunix's policy-loss names resolve to the jaxhead losses.

    Why a context manager: Tunix 0.1.7's ``AlgorithmConfig.__post_init__`` accepts only
    ``"grpo"`` and ``"ppo"`` for ``policy_loss_fn``, so a loss registered under a new name
    could not be selected from a config. Tunix's learners (GRPO, PPO, agentic GRPO) look
    the name up in ``tunix.rl.function_registry`` once, in their constructor, and keep the
    function. So this re-registers ``names`` with the public
    ``function_registry.register_policy_loss_fn`` (Tunix logs an "Overwriting" warning for
    each), and on exit registers back the functions that were there: learners built
    inside the block train with jaxhead, learners built after it with Tunix's own losses,
    and nothing stays patched. Blocks nest (each restores what it found). The swap is not
    atomic: do not construct learners in other threads while entering or leaving it.

    Example::

        with jaxhead_tunix.policy_losses():
            learner = GRPOLearner(rl_cluster=cluster, algo_config=config, reward_fns=fn)
        learner.train(dataset)

    Args:
      names: which of ``"grpo"`` and ``"ppo"`` to switch.
      impl: jaxhead implementation the losses use (``"auto"``: by backend).
      strict: a model the adapter cannot read raises (``TypeError`` /
        ``NotImplementedError``) instead of getting Tunix's loss with one warning
        (``jaxhead.integrations.tunix.fallback``).

    Raises:
      ValueError: a name other than ``"grpo"`` / ``"ppo"``.
    """
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = sorted(set(names) - set(_LOSSES))
    if unknown:
        raise ValueError(f"policy_losses: unknown names {unknown}; jaxhead provides "
                         f"{sorted(_LOSSES)}")
    saved = {name: function_registry.get_policy_loss_fn(name) for name in names}
    for name in names:
        function_registry.register_policy_loss_fn(name)(registered_loss(name, impl))
    try:
        with fallback.leave_to_tunix(strict):
            yield
    finally:
        for name, loss_fn in saved.items():
            function_registry.register_policy_loss_fn(name)(loss_fn)
