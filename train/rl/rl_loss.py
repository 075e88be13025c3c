"""GRPO-family losses: group advantages, clipped surrogate, KL estimators, aggregation.

Per-token arrays are ``[R, L]`` (packed rows, see ``train.rl.packing``) with a float
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
  k1 = ``-log r``, k2 = ``(log r)^2 / 2``, k3 = ``(r - 1) - log r``. Their values
  estimate ``KL(pi || pi_ref)`` (k1 and k3 without bias); their gradients, taken through
  ``log pi`` of the sampled tokens as a loss does, do not all follow it: k3's expected
  gradient is ``E_pi[(1 - r) grad log pi] = grad KL(pi_ref || pi)``, the reverse KL's
  (as in DeepSeekMath's GRPO; k2's is ``grad KL(pi || pi_ref)``).
* PPO: Schulman et al., "Proximal Policy Optimization Algorithms", 2017.
* Sampler-trainer mismatch: when the rollout's log-probs come from another computation
  than the trainer's (a bf16 KV-cache decode against a full forward, another kernel), the
  tokens are off-policy for the trainer. Truncated importance sampling (TIS): weight each
  token's surrogate by ``min(pi_trainer / pi_sampler, C)`` with the PPO ratio taken against
  the trainer's own recomputation (F. Yao, L. Liu et al., "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", 2025; ``rollout_is`` in verl). Masked
  importance sampling: drop tokens whose ratio leaves a band instead (IcePop, inclusionAI's
  Ring-1T report, 2025, with the band [0.5, 5]).
* Dual-clip: Ye et al., "Mastering Complex Control in MOBA Games with Deep Reinforcement
  Learning", AAAI 2020 (arXiv:1912.09729), eq. 4, as verl's ``clip_ratio_c`` applies it
  (``compute_policy_loss``: for a negative advantage the clipped loss is bounded by
  ``-c A``, ``c > 1``): a token whose ratio is far above 1 with ``A < 0`` (the policy moved
  towards a bad token since the rollout) no longer carries a gradient that grows with the
  ratio (verl PR #784: one token with ratio 30 among 256 carried 10.5% of the gradient).
* GSPO: Zheng et al., "Group Sequence Policy Optimization", 2025 (arXiv:2507.18071):
  the importance ratio of a completion is the geometric mean of its token ratios,
  ``s_i = exp(mean_t log(pi(y_t) / pi_old(y_t)))``, clipped per sequence (eq. 7), in the
  token form of its eq. 13 (``GSPO-token``, Tunix's ``loss_algo="gspo-token"``):
  ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, equal to ``s_i`` in value, whose
  gradient is ``s_i`` times the token's.
* Bounded ratios: a ratio is ``exp`` of a difference of log-probs, and a sampled token far
  below the old policy (log-ratio >= 88.7) overflows float32; the branch of the clipped
  surrogate that ``min`` leaves unused then has gradient ``0 * inf = NaN`` while the loss
  stays finite (prime-rl #2601, slime #2198, NeMo-RL #307). Every ratio here (the token's,
  GSPO's, the importance weight of TIS and of ratio masking) is ``bounded_exp`` of its
  log-ratio, held in ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` (verl clamps it to the same 20).
* Split batches: a batch whose loss is summed over parts (the micro-batches of gradient
  accumulation) must normalise each part by the whole batch's token / sequence count, not
  its own: a mean of per-part means weighs a token by the inverse of its part's size, so
  the gradient depends on how the batch was split (verl issue #5625, torchtitan issue
  #2206). ``LossNorm`` carries the whole batch's counts.
* Ratio masking removes a token from the whole loss: its surrogate, its KL penalty, its
  entropy bonus and the count of every denominator (a completion whose tokens are all
  rejected is no longer one of seq-mean's completions), as verl's rejection sampling
  removes it from ``response_mask`` (verl PR #3915) and slime and TRL mask it out of the
  loss (slime PR #657, TRL PR #3744). A rejected token that still carried the KL or the
  entropy term would be pulled towards the reference by a policy the correction has
  ruled off-policy, and a denominator counting it would shrink every kept token's weight.
  GSPO's sequence ratio is the geometric mean over the kept tokens.
  ``seq-mean-token-sum-norm``'s denominator is the constant ``num_seqs x budget`` by
  definition (Dr. GRPO): it does not change.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from train.config import domains as d

ADVANTAGES = ("grpo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
#: The domains of the ``loss`` keys these functions take (``train/run/schema.py`` declares the
#: keys with them; the functions' errors are the config check's lines).
ADVANTAGE = d.one_of(*ADVANTAGES)
KL_ESTIMATOR = d.one_of(*KL_ESTIMATORS)
AGGREGATION = d.one_of(*AGGREGATIONS)
RATIO_LEVEL = d.one_of(*RATIO_LEVELS)
NEGATIVE_WEIGHT = d.FRACTION
OFF_OR_ABOVE_1 = d.Domain("0 (off) or a number > 1",
                          lambda v: d.NUMBER.ok(v) and (v == 0 or v > 1))
#: The bound on a log-ratio (module docstring, "Bounded ratios"): ``e^20 = 4.9e8``.
MAX_LOG_RATIO = 20.0


@jax.custom_jvp
def bounded_exp(log_ratio: jax.Array) -> jax.Array:
    """A ratio from its log: ``exp(clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))``, float,
    same shape; NaN stays NaN.

    Its derivative is the value itself, inside the bound and beyond it: a token past the
    bound keeps the direction of its gradient, at the size it has at the bound, so the
    gradient is always finite. Where the clipped surrogate or dual-clip leaves the ratio's
    branch unused (every case but ``A < 0`` without dual-clip above the bound, and ``A > 0``
    below it, where the float64 gradient itself is ``-rho A`` at ``|log rho| > 20``) the
    gradient is the float64 limit, 0.
    """
    return jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


@bounded_exp.defjvp
def _bounded_exp_jvp(primals, tangents):
    ratio = bounded_exp(primals[0])
    return ratio, ratio * tangents[0]


class LossNorm(NamedTuple):
    """The denominators of a batch's loss when the batch is split into parts whose losses
    are added (the micro-batches of one optimizer step): each part then gives its share of
    the whole batch's loss and metrics, and the shares add up to the unsplit values for
    every aggregation (module docstring, "Split batches"). A completion must lie in one
    part (packing puts it in one row).

    Attributes (float32 scalars, traced: one compile for every split):
      tokens: completion tokens of the whole batch (``sum(mask)``).
      seqs: its completions with at least one completion token.
      num_seqs: its completions (``seq-mean-token-sum-norm``'s count).
      real: its tokens that are not padding (``segment_ids > 0``: the tokens an MoE
        router counts; ``train.rl.steps`` weighs each part's load-balancing loss by its share
        of them), or None when not given.
      kept_tokens, kept_seqs: with ratio masking (``LossConfig.masks_ratios``), its
        completion tokens the mask keeps and its completions with at least one of them:
        the loss's denominators (module docstring, "Ratio masking"); ``tokens`` and
        ``seqs`` stay the metrics' denominators. None without ratio masking. They depend
        on the trainer's log-probs, so they are counted on the device
        (``with_kept``).
    """

    tokens: jax.Array
    seqs: jax.Array
    num_seqs: jax.Array
    real: jax.Array | None = None
    kept_tokens: jax.Array | None = None
    kept_seqs: jax.Array | None = None

    @classmethod
    def of(cls, mask: np.ndarray, seq_index: np.ndarray, num_seqs: int,
           segment_ids: np.ndarray | None = None) -> LossNorm:
        """The counts of a whole batch from its host arrays ``[R, L]``."""
        scored = np.asarray(seq_index)[np.asarray(mask) > 0]
        real = None if segment_ids is None else np.float32(np.count_nonzero(segment_ids))
        return cls(np.float32(scored.size), np.float32(np.unique(scored).size),
                   np.float32(num_seqs), real)

    def with_kept(self, kept_tokens: jax.Array, kept_seqs: jax.Array) -> LossNorm:
        """These counts with the whole batch's ratio-masking counts (float32 scalars, the
        sums over the parts of ``kept_counts``)."""
        return self._replace(kept_tokens=kept_tokens, kept_seqs=kept_seqs)

    def of_loss(self, masks_ratios: bool) -> LossNorm:
        """The denominators of the loss: the kept counts with ratio masking, else these.

        Raises:
          ValueError: ratio masking without the kept counts (``with_kept``).
        """
        if not masks_ratios:
            return self
        if self.kept_tokens is None or self.kept_seqs is None:
            raise ValueError(
                "ratio masking on a split batch needs the whole batch's kept counts "
                "(LossNorm.with_kept): rejected tokens are left out of its denominators")
        return self._replace(tokens=self.kept_tokens, seqs=self.kept_seqs)


def group_advantages(rewards: np.ndarray, kind: str = "grpo", eps: float = 1e-6,
                     negative_weight: float = 1.0) -> np.ndarray:
    """Group-relative advantages.

    Args:
      rewards: float ``[P, G]``: G completions of each of P prompts.
      kind: ``"grpo"``: ``(r - mean_g r) / (std_g r + eps)`` (DeepSeekMath);
        ``"dr_grpo"``: ``r - mean_g r`` (Dr. GRPO).
      eps: added to the (population) standard deviation.
      negative_weight: factor on the negative advantages (completions below their group's
        mean), in ``[0, 1]``. 1: the plain estimator. Below 1 the update leans on the
        positive samples: a negative sample's gradient ``-(1 - p) dlogit`` stays large
        however unlikely the token already is and pushes the mass it removes onto every
        other token, while a positive one fades as ``p -> 1`` (Zhu et al., "The
        Surprising Effectiveness of Negative Reinforcement in LLM Reasoning", 2025,
        arXiv:2506.01347, weigh the two sides; 0 keeps the positive samples only, as in
        RAFT / rejection-sampling fine-tuning, Dong et al. 2023, arXiv:2304.06767).

    Returns:
      float32 ``[P, G]``; zero for a group whose rewards are all equal.

    Raises:
      ValueError: unknown ``kind``, rewards not 2-D, or ``negative_weight`` outside
        ``[0, 1]``.
    """
    ADVANTAGE.require("loss.advantage", kind)
    NEGATIVE_WEIGHT.require("loss.negative_weight", negative_weight)
    r = np.asarray(rewards, np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {r.shape}")
    centred = r - r.mean(axis=1, keepdims=True)
    if kind == "grpo":
        centred = centred / (r.std(axis=1, keepdims=True) + eps)
    centred = np.where(centred < 0, negative_weight * centred, centred)
    return centred.astype(np.float32)


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    With ``d = ref_logp - logp`` (``log r``): k1 ``= -d``, k2 ``= d^2 / 2``,
    k3 ``= exp(d) - d - 1`` (>= 0, GRPO's choice; its value is unbiased for
    ``KL(pi || pi_ref)``, but its expected gradient is that of ``KL(pi_ref || pi)``, see the
    module docstring). float32, same shape, as
    accurate as float32 allows for every gap: ``expm1(d) - d`` cancels for small ``|d|``
    (at ``d = 1e-4`` only 3 digits survive, at ``1e-7`` none, and the result can come out
    negative), so for ``|d| < 1/2`` k3 is its Taylor series ``sum_k d^k / k!`` from ``k = 2``
    to 10, whose remainder is below 1e-9 relative; beyond, ``expm1(d) - d`` loses at most
    3 bits. k3 is never negative.
    """
    KL_ESTIMATOR.require("loss.kl_estimator", kind)
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    series = jnp.zeros_like(d)
    for k in range(10, 1, -1):  # Horner: d^2 (1/2! + d (1/3! + ...))
        series = (series + 1.0 / math.factorial(k)) * (d if k > 2 else d * d)
    small = jnp.abs(d) < 0.5
    return jnp.maximum(jnp.where(small, series, jnp.expm1(jnp.where(small, 0.0, d)) - d), 0.0)


def aggregate(per_token: jax.Array, mask: jax.Array, seq_index: jax.Array, num_seqs: int,
              mode: str, max_completion_len: int, norm: LossNorm | None = None) -> jax.Array:
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
      norm: this batch is a part of a larger one whose counts these are (``LossNorm``):
        the result is this part's share of the larger batch's value. None: the batch alone.
    """
    AGGREGATION.require("loss.aggregation", mode)
    x = jnp.where(mask > 0, per_token * mask, 0.0)  # a NaN off the mask never gets in
    if mode == "token-mean":
        return x.sum() / jnp.maximum(mask.sum() if norm is None else norm.tokens, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / ((num_seqs if norm is None else norm.num_seqs) * max_completion_len)
    sums, counts = _per_sequence_sums(x, mask, seq_index, num_seqs)
    present = counts > 0
    per_seq = jnp.where(present, sums / jnp.maximum(counts, 1.0), 0.0)
    return per_seq.sum() / jnp.maximum(present.sum() if norm is None else norm.seqs, 1)


def _per_sequence_sums(x, mask, seq_index, num_seqs):
    """``(sum of x, sum of mask)`` over each completion's positions, float32 ``[num_seqs]``."""
    ids = jnp.where(seq_index >= 0, seq_index, num_seqs).reshape(-1)
    sums = jax.ops.segment_sum(x.reshape(-1), ids, num_segments=num_seqs + 1)[:num_seqs]
    counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=num_seqs + 1)[:num_seqs]
    return sums, counts


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
      tis_cap: > 0: truncated importance sampling (module docstring): the PPO ratio is taken
        against the trainer's log-probs of the rollout policy and each token's term is
        weighted by ``min(pi_trainer / pi_sampler, tis_cap)``; 0: off (the ratio is taken
        against the sampler's log-probs, as in plain GRPO).
      mask_ratio_low, mask_ratio_high: > 0: tokens whose ``pi_trainer / pi_sampler`` is
        below ``mask_ratio_low`` or above ``mask_ratio_high`` are left out of the loss:
        of its surrogate, KL penalty and entropy bonus and of every aggregation's counts
        (masked importance sampling, module docstring "Ratio masking"; the PPO ratio is
        then also taken against the trainer's log-probs); 0: no bound on that side.
      clip_ratio_c: > 1: dual-clip (module docstring): with ``A < 0`` a token's loss is at
        most ``-clip_ratio_c * A``; 0: off.
      ratio_level: ``"token"``: each token's own ratio (PPO, GRPO); ``"sequence"``: GSPO's
        geometric-mean ratio of the token's completion, in the token-gradient form.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    max_completion_len: int = 1
    tis_cap: float = 0.0
    mask_ratio_low: float = 0.0
    mask_ratio_high: float = 0.0
    clip_ratio_c: float = 0.0
    ratio_level: str = "token"

    @property
    def masks_ratios(self) -> bool:
        """Whether tokens outside a ratio band are left out of the loss."""
        return self.mask_ratio_low > 0 or self.mask_ratio_high > 0

    @property
    def corrects_mismatch(self) -> bool:
        """Whether the sampler-trainer mismatch is corrected (TIS or ratio masking)."""
        return self.tis_cap > 0 or self.masks_ratios

    def check(self) -> LossConfig:
        """``self`` if its dual-clip and ratio settings are valid.

        Raises:
          ValueError: ``clip_ratio_c`` not in ``OFF_OR_ABOVE_1``, or ``ratio_level`` not
            in ``RATIO_LEVELS`` (the config key and the value named, as the config check
            words it).
        """
        OFF_OR_ABOVE_1.require("loss.clip_ratio_c", self.clip_ratio_c)
        RATIO_LEVEL.require("loss.ratio_level", self.ratio_level)
        return self


def _behaviour(cfg: LossConfig, logp, sampler_logp, trainer_logp, mask, total):
    """``(old_logp, weight, kept, metrics)``: the log-probs the PPO ratio is taken against,
    the per-token weight of the surrogate (TIS cap, ratio mask), the float mask of the
    tokens the loss reads (``mask`` less the ratio-masked ones) and the diagnostics."""
    if not cfg.corrects_mismatch:
        return (sampler_logp if trainer_logp is None else trainer_logp), mask, mask, {}
    # the trainer's log-probs of the rollout policy: given, or this forward's own
    old = jax.lax.stop_gradient(logp) if trainer_logp is None else trainer_logp
    log_is = jnp.where(mask > 0, old - sampler_logp, 0.0)
    is_ratio = bounded_exp(log_is)
    keep = mask > 0
    if cfg.mask_ratio_low > 0:
        keep = keep & (is_ratio >= cfg.mask_ratio_low)
    if cfg.mask_ratio_high > 0:
        keep = keep & (is_ratio <= cfg.mask_ratio_high)
    weight = jnp.where(keep, 1.0, 0.0)
    metrics = {"is_ratio_mean": _token_mean(is_ratio, mask, total),
               "ratio_masked_fraction": _token_mean((mask > 0) & ~keep, mask, total)}
    if cfg.tis_cap > 0:
        weight = weight * jnp.minimum(is_ratio, cfg.tis_cap)
        metrics["tis_capped_fraction"] = _token_mean(keep & (is_ratio > cfg.tis_cap), mask,
                                                     total)
    return old, weight, jnp.where(keep, mask, 0.0), metrics


def _inputs(logp, old_logp, mask, advantages=None, entropy=None, trainer_logp=None):
    """``(logp, sampler_logp, trainer_logp, advantages, entropy)`` zeroed off the mask
    (NaN included), the constants detached, a NaN ``trainer_logp`` replaced by ``logp``."""

    def on_mask(x):
        return None if x is None else jnp.where(mask > 0, x, 0.0)

    logp = on_mask(logp)
    if trainer_logp is not None:  # NaN: not known yet, this forward's own
        trainer_logp = on_mask(trainer_logp)
        trainer_logp = jax.lax.stop_gradient(
            jnp.where(jnp.isnan(trainer_logp), logp, trainer_logp))
    return (logp, jax.lax.stop_gradient(on_mask(old_logp)), trainer_logp,
            on_mask(advantages), on_mask(entropy))


def kept_counts(cfg: LossConfig, logp, old_logp, mask, seq_index, num_seqs, *,
                trainer_logp=None) -> tuple[jax.Array, jax.Array]:
    """``(tokens, seqs)``: the completion tokens ``grpo_loss`` keeps under ratio masking
    and the completions with at least one of them (float32 scalars; without ratio masking
    every completion token and every completion that has one). The arguments are
    ``grpo_loss``'s; a split batch's ``LossNorm.with_kept`` takes the sums over its parts.
    """
    logp, sampler, trainer, _, _ = _inputs(logp, old_logp, mask, trainer_logp=trainer_logp)
    kept = _behaviour(cfg, jax.lax.stop_gradient(logp), sampler, trainer, mask, None)[2]
    _, counts = _per_sequence_sums(kept, kept, seq_index, num_seqs)
    return kept.sum(dtype=jnp.float32), jnp.sum(counts > 0, dtype=jnp.float32)


def _token_mean(x, mask, total=None):
    """Mean of ``x`` over the tokens of ``mask`` (float32; nothing off the mask read), or
    with ``total`` (a larger batch's token count) this batch's share of that mean."""
    s = jnp.sum(jnp.where(mask > 0, x, 0.0).astype(jnp.float32))
    return s / jnp.maximum(mask.sum() if total is None else total, 1.0)


def _any_nonfinite(x, mask) -> jax.Array:
    """float32 1.0 if ``x`` is NaN or infinite on a token of ``mask``, else 0.0."""
    return jnp.any((mask > 0) & ~jnp.isfinite(x)).astype(jnp.float32)


def _log_ratio(cfg: LossConfig, logp, old_logp, mask, seq_index, num_seqs):
    """``log`` of the PPO ratio per token: ``logp - old_logp``, or at the sequence level
    (GSPO-token) ``logp - sg(logp) + sg(mean over the completion of logp - old_logp)``."""
    log_ratio = logp - old_logp
    if cfg.ratio_level == "token":
        return log_ratio
    sums, counts = _per_sequence_sums(jnp.where(mask > 0, log_ratio, 0.0), mask, seq_index,
                                      num_seqs)
    seq_mean = jnp.append(sums / jnp.maximum(counts, 1.0), 0.0)  # [num_seqs + 1]: 0 off
    per_token = seq_mean[jnp.where(seq_index >= 0, seq_index, num_seqs)]
    return logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(per_token)


def grpo_loss(cfg: LossConfig, logp, old_logp, advantages, mask, seq_index, num_seqs,
              ref_logp=None, entropy=None, *, trainer_logp=None,
              norm: LossNorm | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped-surrogate GRPO loss and its diagnostics.

    Per token, with the PPO ratio ``rho`` (below) and advantage ``A`` (the completion's,
    broadcast to its tokens)::

        pg = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
        pg = min(pg, -clip_ratio_c * A)  where A < 0   (dual-clip, when on)
        loss_t = w * pg + beta * KL_k(pi || pi_ref) - entropy_coef * entropy

    aggregated by ``cfg.aggregation`` over the completion tokens, less those ratio masking
    rejects (module docstring, "Ratio masking": no term of a rejected token reaches the
    loss or its gradient, and no denominator counts it). ``rho = exp(logp - a)``
    (``ratio_level="token"``) or GSPO-token's ``exp(logp - sg(logp) + sg(mean_{t in seq} (logp_t - a_t)))``
    (``"sequence"``), each ``exp`` being ``bounded_exp`` (module docstring, "Bounded
    ratios"), against the anchor ``a``: ``trainer_logp`` if given, else the
    sampler's ``old_logp``, or with a mismatch correction (``cfg.tis_cap``,
    ``cfg.mask_ratio_*``) the trainer's own detached ``logp``. ``w = 1``, or with a
    correction the token's importance weight from ``a / old_logp``. Values at positions
    whose mask is 0 (NaN or inf included) never reach the loss, its gradient or a metric.

    Args:
      cfg: ``LossConfig``.
      logp: float32 ``[R, L]`` current log-probs (differentiable).
      old_logp: float32 ``[R, L]`` log-probs of the policy that sampled (constant): the
        sampler's, on the support it drew from.
      advantages: float32 ``[R, L]``.
      mask: float32 ``[R, L]``; seq_index: int32 ``[R, L]``; num_seqs: static int.
      ref_logp: float32 ``[R, L]`` reference log-probs (needed iff ``beta > 0``).
      entropy: float32 ``[R, L]`` (needed iff ``entropy_coef != 0``; also reported).
      trainer_logp: float32 ``[R, L]``, the trainer's log-probs of the rollout policy
        (constant): the old policy of the PPO ratio when several updates use one rollout
        (``train.rl.updates``); a NaN entry (not known yet) stands for this forward's own
        detached log-prob; None: as above.
      norm: the counts of the whole batch this one is a part of (``LossNorm``): the loss
        and the mean metrics are then this part's shares, which add up over the parts.
        With ratio masking it must carry the kept counts (``LossNorm.with_kept``).

    Returns:
      ``(loss, metrics)``; metrics are float32 scalars: ``pg_loss`` (the surrogate's
      part of the loss), ``kl``; the token means below are over every completion token,
      rejected ones included:
      ``clip_fraction`` (tokens whose clipped term was active), ``clip_fraction_low`` /
      ``clip_fraction_high`` (of those, ``A < 0`` with ``rho < 1 - eps_low`` / ``A > 0``
      with ``rho > 1 + eps_high``), with dual-clip ``clip_fraction_dual`` (``A < 0`` with
      ``rho > clip_ratio_c``), ``ratio_mean``, ``ratio_max`` (of ``rho``), ``entropy``
      (token mean), ``approx_kl_old`` (k3 of the anchor vs the current policy), and with
      a mismatch correction ``is_ratio_mean``, ``ratio_masked_fraction``,
      ``tis_capped_fraction``; ``nonfinite_logprob`` / ``nonfinite_ratio``: 1.0 if ``logp``
      / ``rho`` is NaN or infinite on a completion token (else 0.0).

    Raises:
      ValueError: ``beta > 0`` without ``ref_logp``; ``entropy_coef`` without ``entropy``;
        an invalid ``cfg`` (``LossConfig.check``); ratio masking with a ``norm`` that
        lacks the kept counts.
    """
    cfg.check()
    if cfg.beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    if cfg.entropy_coef and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    total = None if norm is None else norm.tokens
    loss_norm = None if norm is None else norm.of_loss(cfg.masks_ratios)

    def mean(x):
        return _token_mean(x, mask, total)

    logp, sampler_logp, trainer_logp, advantages, entropy = _inputs(
        logp, old_logp, mask, advantages, entropy, trainer_logp)
    old_logp, weight, kept, metrics = _behaviour(cfg, logp, sampler_logp, trainer_logp, mask,
                                                 total)

    def agg(x):  # over the tokens the loss reads: ratio-masked ones left out of every term
        return aggregate(x, kept, seq_index, num_seqs, cfg.aggregation,
                         cfg.max_completion_len, loss_norm)

    ratio = bounded_exp(_log_ratio(cfg, logp, old_logp, kept, seq_index, num_seqs))
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    unclipped_term, clipped_term = ratio * advantages, clipped * advantages
    pg = -jnp.minimum(unclipped_term, clipped_term)
    clip_active = clipped_term < unclipped_term
    if cfg.clip_ratio_c > 0:
        bound = -cfg.clip_ratio_c * advantages
        dual = (advantages < 0) & (pg > bound)
        pg = jnp.where(advantages < 0, jnp.minimum(pg, bound), pg)
        metrics["clip_fraction_dual"] = mean(dual)
    pg = pg * weight
    per_token = pg
    metrics.update({
        "pg_loss": agg(pg),
        "clip_fraction": mean(clip_active),
        "clip_fraction_low": mean(clip_active & (advantages < 0)),
        "clip_fraction_high": mean(clip_active & (advantages > 0)),
        "ratio_mean": mean(ratio),
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
        "approx_kl_old": mean(kl_estimate(logp, old_logp, "k3")),
        # what went non-finite on a completion token (train.steps names it)
        "nonfinite_logprob": _any_nonfinite(logp, mask),
        "nonfinite_ratio": _any_nonfinite(ratio, mask),
    })
    if ref_logp is not None:
        ref_logp = jax.lax.stop_gradient(jnp.where(mask > 0, ref_logp, 0.0))
        kl = kl_estimate(logp, ref_logp, cfg.kl_estimator)
        metrics["kl"] = mean(kl)
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
    if entropy is not None:
        metrics["entropy"] = mean(entropy)
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy
    loss = agg(per_token)
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
