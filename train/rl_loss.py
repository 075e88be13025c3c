"""GRPO-family losses: group advantages, clipped surrogate, KL estimators, aggregation.

Per-token arrays are ``[R, L]`` (packed rows, see ``train.packing``) with a float
``mask`` (1 on the positions that score completion tokens) and ``seq_index`` (the
completion each position belongs to, -1 elsewhere).

Sources:
* GRPO: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models", 2024 (arXiv:2402.03300), sec. 4.1: group-relative advantages
  ``(r - mean(r)) / std(r)`` over the G completions of a prompt, PPO's clipped surrogate,
  a KL penalty to a reference model with the k3 estimator, per-sequence token means.
* Clip-higher and token-level aggregation: Yu et al., "DAPO: An Open-Source LLM
  Reinforcement Learning System at Scale", 2025 (arXiv:2503.14476): separate
  ``eps_low`` / ``eps_high``, ``token-mean`` over all tokens of the batch.
* Dr. GRPO: Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective",
  2025 (arXiv:2503.20783): advantages ``r - mean(r)`` without the std division, and the
  sum of token losses divided by a constant (the generation budget) instead of each
  sequence's length (``seq-mean-token-sum-norm``).
* KL estimators: J. Schulman, "Approximating KL Divergence", 2020
  (http://joschu.net/blog/kl-approx.html): with ``r = pi_ref / pi`` sampled from ``pi``,
  k1 = ``-log r``, k2 = ``(log r)^2 / 2``, k3 = ``(r - 1) - log r``.
* PPO: Schulman et al., "Proximal Policy Optimization Algorithms", 2017.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ADVANTAGES = ("grpo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def group_advantages(rewards: np.ndarray, kind: str = "grpo", eps: float = 1e-6
                     ) -> np.ndarray:
    """Group-relative advantages.

    Args:
      rewards: float ``[P, G]``: G completions of each of P prompts.
      kind: ``"grpo"``: ``(r - mean_g r) / (std_g r + eps)`` (DeepSeekMath);
        ``"dr_grpo"``: ``r - mean_g r`` (Dr. GRPO).
      eps: added to the (population) standard deviation.

    Returns:
      float32 ``[P, G]``; zero for a group whose rewards are all equal.

    Raises:
      ValueError: unknown ``kind`` or rewards not 2-D.
    """
    _check("advantage kind", kind, ADVANTAGES)
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {r.shape}")
    centred = r - r.mean(axis=1, keepdims=True)
    if kind == "grpo":
        centred = centred / (r.std(axis=1, keepdims=True) + eps)
    return centred.astype(np.float32)


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    With ``d = ref_logp - logp`` (``log r``): k1 ``= -d``, k2 ``= d^2 / 2``,
    k3 ``= exp(d) - d - 1`` (unbiased and >= 0; GRPO's choice). float32, same shape.
    """
    _check("kl estimator", kind, KL_ESTIMATORS)
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    return jnp.expm1(d) - d


def aggregate(per_token: jax.Array, mask: jax.Array, seq_index: jax.Array, num_seqs: int,
              mode: str, max_completion_len: int) -> jax.Array:
    """Reduce a per-token loss ``[R, L]`` to a scalar.

    * ``token-mean``: ``sum(x m) / sum(m)``: every token of the batch weighs the same
      (DAPO).
    * ``seq-mean-token-mean``: mean over completions of each completion's token mean
      (GRPO as in DeepSeekMath).
    * ``seq-mean-token-sum-norm``: ``sum(x m) / (num_seqs * max_completion_len)``: a
      constant normaliser, no length bias (Dr. GRPO).

    Args:
      per_token: float ``[R, L]``; mask: float ``[R, L]``; seq_index: int ``[R, L]`` in
      ``[-1, num_seqs)``; num_seqs, max_completion_len: static ints.
    """
    _check("loss aggregation", mode, AGGREGATIONS)
    x = per_token * mask
    if mode == "token-mean":
        return x.sum() / jnp.maximum(mask.sum(), 1.0)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (num_seqs * max_completion_len)
    ids = jnp.where(seq_index >= 0, seq_index, num_seqs).reshape(-1)
    sums = jax.ops.segment_sum(x.reshape(-1), ids, num_segments=num_seqs + 1)[:num_seqs]
    counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=num_seqs + 1)[:num_seqs]
    present = counts > 0
    per_seq = jnp.where(present, sums / jnp.maximum(counts, 1.0), 0.0)
    return per_seq.sum() / jnp.maximum(present.sum(), 1)


class LossConfig(NamedTuple):
    """Static settings of the GRPO loss (hashable).

    Attributes:
      eps_low, eps_high: the ratio is clipped to ``[1 - eps_low, 1 + eps_high]``
        (``eps_high > eps_low`` is DAPO's clip-higher).
      beta: weight of the KL penalty (0: no reference model is needed).
      kl_estimator: ``"k1" | "k2" | "k3"``.
      entropy_coef: weight of the entropy bonus (the loss subtracts ``coef * entropy``).
      aggregation: one of ``AGGREGATIONS``.
      max_completion_len: the generation budget (``seq-mean-token-sum-norm``'s normaliser).
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    max_completion_len: int = 1


def grpo_loss(cfg: LossConfig, logp, old_logp, advantages, mask, seq_index, num_seqs,
              ref_logp=None, entropy=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped-surrogate GRPO loss and its diagnostics.

    Per token, with ``ratio = exp(logp - old_logp)`` and advantage ``A`` (the
    completion's, broadcast to its tokens)::

        pg = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
        loss_t = pg + beta * KL_k(pi || pi_ref) - entropy_coef * entropy

    aggregated by ``cfg.aggregation``.

    Args:
      cfg: ``LossConfig``.
      logp: float32 ``[R, L]`` current log-probs (differentiable).
      old_logp: float32 ``[R, L]`` log-probs of the policy that sampled (constant).
      advantages: float32 ``[R, L]``.
      mask: float32 ``[R, L]``; seq_index: int32 ``[R, L]``; num_seqs: static int.
      ref_logp: float32 ``[R, L]`` reference log-probs (needed iff ``beta > 0``).
      entropy: float32 ``[R, L]`` (needed iff ``entropy_coef != 0``; also reported).

    Returns:
      ``(loss, metrics)``; metrics are float32 scalars: ``pg_loss``, ``kl``,
      ``clip_fraction`` (tokens whose clipped term was active), ``ratio_mean``,
      ``entropy`` (token mean), ``approx_kl_old`` (k3 of the old vs current policy).

    Raises:
      ValueError: ``beta > 0`` without ``ref_logp``; ``entropy_coef`` without ``entropy``.
    """
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    if cfg.entropy_coef and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")

    def agg(x):
        return aggregate(x, mask, seq_index, num_seqs, cfg.aggregation,
                         cfg.max_completion_len)

    def token_mean(x):
        return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    old_logp = jax.lax.stop_gradient(old_logp)
    log_ratio = jnp.where(mask > 0, logp - old_logp, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    unclipped_term, clipped_term = ratio * advantages, clipped * advantages
    pg = -jnp.minimum(unclipped_term, clipped_term)
    per_token = pg
    metrics = {
        "pg_loss": agg(pg),
        "clip_fraction": token_mean((clipped_term < unclipped_term).astype(jnp.float32)),
        "ratio_mean": token_mean(ratio),
        "approx_kl_old": token_mean(kl_estimate(logp, old_logp, "k3")),
    }
    if ref_logp is not None:
        kl = kl_estimate(logp, jax.lax.stop_gradient(ref_logp), cfg.kl_estimator)
        metrics["kl"] = token_mean(kl)
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
    if entropy is not None:
        metrics["entropy"] = token_mean(entropy)
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy
    loss = agg(per_token)
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
