"""GRPO on reasoning-gym tasks: ``python -m train.grpo --config=configs/grpo_tiny.py``.

One run, in ``cfg.workdir``:

1. warm start: the SFT stage (``train.sft``, when ``sft.steps > 0``; resumed or just
   loaded if it already ran), else ``init.sft_checkpoint``, an HF checkpoint or a random
   init;
2. held-out evaluation of the warm start (saved, so a resumed run does not redo it);
3. ``train.steps`` GRPO steps (``GRPOIteration``): G completions for each of P prompts
   sampled with the KV cache (jaxhead's chunked Gumbel-max, sampler log-probs recorded;
   on a mesh each data-parallel group decodes its own rows, ``train.rollout``),
   rewards from the task's ``score_answer``, group advantages, packed rows, the frozen
   reference's log-probs when ``loss.beta > 0``, the clipped-surrogate updates
   (``train.updates``: one by default; epochs, mini-batches, micro-batches); metrics
   every step, checkpoints every ``checkpoint.every`` steps and at the end
   (``train.loop``);
4. held-out evaluation of the final policy and the before/after table.

Rerunning the same command resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from train import cli, evaluate, plot, rl_loss, rollout, setup, steps, updates
from train.loop import Loop, Stage
from train.metrics import machine, peak_flops, reduce_updates, train_step_flops
from train.placement import place_batch
from train.sft import run_sft
from train.state import Params


def stage(cfg) -> Stage:
    """The GRPO stage of ``cfg`` (``cfg.train``, ``cfg.rollout``) as the loop sees it."""
    return Stage(setup.GRPO_DIR, cfg.train.steps, cfg.rollout.prompts_per_step,
                 cfg.train.log_every, cfg.train.optim, kind="train",
                 postfix=("reward_mean", "accuracy"))


def loss_config(cfg) -> rl_loss.LossConfig:
    """The ``rl_loss.LossConfig`` of ``cfg.loss``.

    Raises:
      ValueError: see ``rl_loss.LossConfig.check``.
    """
    c = cfg.loss
    return rl_loss.LossConfig(
        eps_low=c.eps_low, eps_high=c.eps_high, beta=c.beta, kl_estimator=c.kl_estimator,
        entropy_coef=c.entropy_coef, aggregation=c.aggregation,
        max_completion_len=cfg.rollout.max_new_tokens, tis_cap=c.tis_cap,
        mask_ratio_low=c.mask_ratio_low, mask_ratio_high=c.mask_ratio_high,
        clip_ratio_c=c.clip_ratio_c, ratio_level=c.ratio_level).check()


#: ``loss.logprob_support`` values: score a truncated rollout's tokens on the support they
#: were drawn from, or on the whole softmax.
LOGPROB_SUPPORTS = ("sampler", "full")


def truncation(cfg) -> rollout.Truncation:
    """The rollouts' ``top_k`` / ``top_p`` / ``min_p`` (``cfg.rollout``)."""
    r = cfg.rollout
    return rollout.Truncation(int(r.top_k), float(r.top_p), float(r.min_p))


def scored_on_sampler_support(cfg) -> bool:
    """Whether the trainer scores tokens on the rollouts' truncated support (the trainer's
    and the reference's log-probs take ``min_logit``); False when sampling is not truncated
    or ``loss.logprob_support == "full"``.

    Raises:
      ValueError: ``loss.logprob_support`` not in ``LOGPROB_SUPPORTS``.
    """
    support = cfg.loss.logprob_support
    if support not in LOGPROB_SUPPORTS:
        raise ValueError(f"loss.logprob_support must be one of {LOGPROB_SUPPORTS}, "
                         f"got {support!r}")
    return support == "sampler" and truncation(cfg).active


def generator(cfg, s: setup.Setup, trunc: rollout.Truncation) -> rollout.Generator:
    """The run's KV-cache sampler (``train.rollout.Generator``) with ``trunc``, sharded
    over the run's mesh (``s.placement``) like the training step."""
    return rollout.Generator(s.mdef, max_new_tokens=cfg.rollout.max_new_tokens,
                             stop_ids=s.tasks.stop_ids, num_valid=s.tokenizer.num_valid,
                             truncation=trunc, placement=s.placement)


def score(cfg, s: setup.Setup, problems, ro: rollout.Rollout) -> tuple[np.ndarray, np.ndarray]:
    """``(rewards [P, G], correct [P, G])`` of the rollout's ``P * G`` completions (G per
    problem, in order): ``Tasks.reward`` with the format reward, and whether the task
    score alone is 1."""
    g = cfg.rollout.group_size
    rewards, correct = [], []
    for i in range(len(problems) * g):
        text = evaluate.completion_text(s.tokenizer, ro, i)
        p = problems[i // g]
        rewards.append(s.tasks.reward(p, text, cfg.data.format_reward))
        correct.append(float(s.tasks.reward(p, text) >= 1.0))
    shape = (len(problems), g)
    return np.reshape(rewards, shape), np.reshape(correct, shape)


def rollout_sequences(cfg, problems, ro: rollout.Rollout,
                      advantages: np.ndarray) -> updates.Sequences:
    """Prompt + completion of every row of the rollout with the sampler log-probs
    (``old_logp``), the completion's advantage on each of its tokens and, when scored on
    the sampler's support (``scored_on_sampler_support``), each token's ``min_logit``;
    with ``loss.logprob_support == "full"`` ``old_logp`` is the full-softmax log-prob
    (``logprobs + logmass``)."""
    g = cfg.rollout.group_size
    n = len(problems) * g
    comps = [ro.completion(i) for i in range(n)]
    adv = advantages.reshape(-1)
    on_support = scored_on_sampler_support(cfg)
    old = ro.logprobs if on_support else ro.logprobs + ro.logmass

    def per_token(x):
        return [x[i, : len(c)] for i, c in enumerate(comps)]

    values = {"old_logp": per_token(old),
              "advantages": [np.full(len(c), adv[i], np.float32) for i, c in enumerate(comps)]}
    if on_support:
        values["min_logit"] = per_token(ro.min_logit)
    return updates.Sequences([problems[i // g].prompt for i in range(n)], comps, values, g)


def truncated_mass_mean(ro: rollout.Rollout) -> float:
    """Mean over the rollout's completion tokens of the probability mass the truncation
    left out (``1 - exp(logmass)``; 0 when untruncated)."""
    live = np.arange(ro.tokens.shape[1])[None, :] < ro.lengths[:, None]
    return float(-np.expm1(ro.logmass[live]).mean()) if live.any() else 0.0


def grpo_metrics(report: updates.StepReport, rewards: np.ndarray, correct: np.ndarray,
                 ro: rollout.Rollout, *, epochs: int, times: dict, flops: float,
                 peak: float) -> dict:
    """The metrics line of one GRPO step (besides the loop's ``lr``, ``skipped_prompts``,
    ``peak_memory_bytes``).

    Args:
      report: the step's updates (``train.updates.StepReport``: loss, KL, clip fractions,
        ... per update, reduced by ``train.metrics.reduce_updates``; the batches' sizes).
      rewards, correct: ``[P, G]`` (``score``).
      ro: the rollout.
      epochs: passes over the rollout (``train.updates_per_batch``).
      times: seconds of ``rollout`` (sampling and scoring), ``reference`` (advantages,
        packing and the forwards before the first update), ``train`` (the updates).
      flops: model FLOPs of the updates (``train.metrics.train_step_flops`` per epoch).
      peak: peak FLOP/s of the local devices.
    """
    total = report.positions
    seconds = sum(times.values())
    return {
        **reduce_updates(report.updates),
        "reward_mean": rewards.mean(), "reward_std": rewards.std(),
        "accuracy": correct.mean(),
        "zero_std_group_fraction": float(np.mean(rewards.std(axis=1) == 0)),
        "completion_length_mean": float(ro.lengths.mean()),
        "completion_length_max": float(ro.lengths.max()),
        "stop_fraction": float(ro.stopped.mean()),
        "lm_head_token_fraction": report.kept / total,
        "lm_head_bucket_fraction": report.head_tokens / total,
        "tokens_per_s": report.real / seconds,
        "train_tokens_per_s": report.real * epochs / times["train"],
        "mfu": flops / times["train"] / peak,
        "time_rollout_s": times["rollout"], "time_reference_s": times["reference"],
        "time_train_s": times["train"], "sampling_path": ro.path,
        "truncated_mass_mean": truncated_mass_mean(ro),
    }


class GRPOIteration:
    """One GRPO step (a ``train.loop.Iteration``), with the jitted functions it owns for
    the whole run: the sampler and the updates (``train.updates.Updater``: the update
    step and the forward of the reference and of the old policy).

    Args:
      cfg, s: the run's config and setup.
      loop: the stage's loop (its optimiser builds the update).
      generate: the run's sampler (``generator(cfg, s, truncation(cfg))``).
      ref_params: the frozen reference policy (needed when ``loss.beta > 0``).

    Raises:
      ValueError: a bad ``train.updates_per_batch`` / ``mini_batches`` / ``micro_batches``
        or ``loss.old_logprobs`` (``train.updates.Schedule.from_config``), or loss setting
        (``loss_config``).
    """

    def __init__(self, cfg, s: setup.Setup, loop: Loop, generate: rollout.Generator,
                 ref_params: Params | None):
        self.cfg, self.s, self.generate, self.ref_params = cfg, s, generate, ref_params
        self.schedule = updates.Schedule.from_config(cfg)
        self.skip = cfg.train.skip_unkept
        self.updater = updates.Updater(
            s.mdef, loop.tx, loss_config(cfg), s.placement, self.schedule,
            temperature=cfg.rollout.temperature, skip=self.skip, frozen=loop.frozen,
            row_len=cfg.train.row_len,
            row_multiple=s.placement.row_multiple(cfg.train.row_multiple),
            bucket_multiple=cfg.train.bucket_multiple)
        self.peak = peak_flops(cfg.metrics.peak_flops)

    def __call__(self, params, opt_state, problems, key, step):
        cfg, s = self.cfg, self.s
        t0 = time.perf_counter()
        # 1. rollout: G completions per prompt from the current policy
        prompts = [p.prompt for p in problems for _ in range(cfg.rollout.group_size)]
        ro = self.generate(params, prompts, key, temperature=cfg.rollout.temperature)
        # 2. reward
        rewards, correct = score(cfg, s, problems, ro)
        t1 = time.perf_counter()
        # 3. advantage within each group
        adv = rl_loss.group_advantages(rewards, cfg.loss.advantage,
                                        negative_weight=cfg.loss.negative_weight)
        seqs = rollout_sequences(cfg, problems, ro, adv)
        t2 = time.perf_counter()
        # 4. packed mini-batches, the reference's (loss.beta > 0) and the old policy's
        # log-probs, the clipped-surrogate updates
        params, opt_state, report = self.updater(params, opt_state, seqs, key,
                                                 self.ref_params)

        def metrics():
            epochs = self.schedule.epochs
            flops = epochs * train_step_flops(s.mdef.cfg, report.real, report.head_tokens,
                                              context=report.real / len(seqs.prompts) / 2)
            times = {"rollout": t1 - t0, "reference": t2 - t1 + report.seconds["reference"],
                     "train": report.seconds["train"]}
            return grpo_metrics(report, rewards, correct, ro, epochs=epochs, times=times,
                                flops=flops, peak=self.peak)

        return params, opt_state, metrics


def train_grpo(cfg, s: setup.Setup, start_params: Params,
               generate: rollout.Generator | None = None) -> Params:
    """The GRPO stage (resumed from ``<workdir>/grpo`` if it has a checkpoint) from
    ``start_params``, which also serve as the reference policy; ``generate``: the run's
    sampler (None: a new one). Returns the final params."""
    loop = Loop(cfg, s, stage(cfg))
    generate = generate or generator(cfg, s, truncation(cfg))
    ref = start_params if cfg.loss.beta > 0 else None
    return loop.run(lambda: start_params, GRPOIteration(cfg, s, loop, generate, ref))


def _atomic_json(path, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def held_out(cfg, s: setup.Setup, generate: rollout.Generator, logprobs, params, name: str,
             step: int) -> evaluate.EvalResult:
    """Evaluate ``params`` on the held-out set, or load the saved result ``name``. The
    same key is used before and after GRPO (common random numbers: the paired difference
    has less noise). ``logprobs``: the run's jitted teacher-forced log-probs
    (``train.steps.reference_logprobs`` at the sampling temperature), built once so that
    both evaluations share its compiles."""
    path = s.workdir / f"eval_{name}.json"
    if path.exists():
        return evaluate.EvalResult.from_json(json.loads(path.read_text()))
    t0 = time.perf_counter()
    res = evaluate.evaluate(
        generate, params, s.eval_problems, s.tasks, s.tokenizer,
        temperature=cfg.rollout.temperature, samples=cfg.eval.samples,
        batch=cfg.eval.batch or cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        key=jax.random.fold_in(jax.random.key(cfg.seed), 10**6),
        format_weight=cfg.data.format_reward,
        progress=f"eval {name}" if s.writer.enabled else None)
    placement = s.placement
    res.answer_prob = np.exp(evaluate.answer_logprobs(
        logprobs, params, s.eval_problems, s.tasks, row_len=cfg.train.row_len,
        row_multiple=placement.row_multiple(cfg.train.row_multiple),
        batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        place=lambda packed: place_batch(packed.arrays(), placement.mesh),
        bucket=lambda packed: placement.bucket(packed, cfg.train.bucket_multiple)))
    if s.writer.enabled:
        _atomic_json(path, res.to_json())
    (r, r_se), (a, a_se), (q, q_se) = (res.sampled_reward(), res.greedy_accuracy(),
                                       res.answer_probability())
    s.writer.write(step, {"sampled_reward": r, "sampled_reward_se": r_se, "greedy_accuracy": a,
                          "greedy_accuracy_se": a_se, "answer_prob": q, "answer_prob_se": q_se,
                          "seconds": time.perf_counter() - t0},
                   kind=f"eval_{name}")
    return res


def _summary(res: evaluate.EvalResult, n: int, label: str) -> str:
    (r, r_se), (a, a_se) = res.sampled_reward(), res.greedy_accuracy()
    return (f"{label}: {n} held-out problems: sampled reward (T={res.temperature:g}) "
            f"{r:.4f} ± {r_se:.4f}, greedy accuracy {a:.4f} ± {a_se:.4f}")


def train(cfg, config_file: str | None = None) -> None:
    """``python -m train.grpo``: warm start, evaluation, GRPO, evaluation, report."""
    t_start = time.perf_counter()
    s = setup.start(cfg, checks=(loss_config, updates.Schedule.from_config))
    if s.writer.enabled:
        print(setup.banner(cfg, s, "train.grpo", config_file), flush=True)
    if cfg.sft.steps > 0 and not cfg.init.sft_checkpoint:
        start = run_sft(cfg, s, final_params_only=True)
    else:
        start = setup.initial_params(cfg, s)
    n = len(s.eval_problems)
    scored_on_sampler_support(cfg)  # a bad loss.logprob_support fails before any work
    rollouts = generator(cfg, s, truncation(cfg))
    # held-out evaluations sample untruncated (and decode greedily): same compiled decoder
    # as the rollouts unless those are truncated
    evals = rollouts if not truncation(cfg).active else generator(cfg, s, rollout.Truncation())
    before = None
    answer_logprobs = steps.reference_logprobs(s.mdef, s.placement,
                                               temperature=cfg.rollout.temperature)
    if cfg.eval.before_after:
        before = held_out(cfg, s, evals, answer_logprobs, start, "before", 0)
        print(_summary(before, n, "before GRPO"), flush=True)
    params = train_grpo(cfg, s, start, rollouts)
    if before is not None:
        after = held_out(cfg, s, evals, answer_logprobs, params, "after", cfg.train.steps)
        print(_summary(after, n, "after GRPO"), flush=True)
        title = (f"tasks {', '.join(cfg.data.tasks)}: {n} held-out problems (question texts "
                 f"never in training), {cfg.eval.samples} samples each at "
                 f"T={cfg.rollout.temperature:g}, {cfg.train.steps} GRPO steps")
        print(evaluate.report(before, after, title), flush=True)
    cpu = sum(os.times()[:2])  # user + system seconds of this process
    print(f"prompts skipped as too long: {s.tasks.skipped}; wall time "
          f"{time.perf_counter() - t_start:.0f} s (CPU time {cpu:.0f} s); run directory "
          f"{s.workdir}", flush=True)
    s.writer.close()
    if s.writer.enabled and before is not None:  # the curve of this run: PNG or how to get it
        print(plot.write_or_hint(s.workdir, machine()), flush=True)


def main(argv):
    del argv
    train(cli.config(), cli.config_file())


if __name__ == "__main__":
    cli.run(main)
