"""GRPO on reasoning-gym tasks: ``python -m train.grpo --config=configs/grpo_tiny.py``.

One run, in ``cfg.workdir``: the warm start (the SFT stage ``train.sft`` when
``sft.steps > 0``, else ``init.sft_checkpoint``, an HF checkpoint or a random init); the
held-out evaluation of it (``train.evaluate.held_out``, saved so a resumed run does not
redo it); ``train.steps`` GRPO steps (``GRPOIteration``: G sampled completions for each of
P prompts, their rewards, group advantages, the clipped-surrogate updates of
``train.updates``; metrics every step, checkpoints by ``train.loop``); the held-out
evaluation of the final policy and the before/after table.

Rerunning the same command resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import os
import time

from train import (
    cli,
    evaluate,
    experience,
    export,
    nonfinite,
    plot,
    rl_loss,
    rollout,
    setup,
    steps,
    updates,
)
from train.experience import generator, rollout_sequences, score, truncation
from train.loop import Loop, Stage
from train.metrics import grpo_metrics, machine, peak_flops, train_step_flops
from train.sft import run_sft
from train.state import Params


def stage(cfg) -> Stage:
    """The GRPO stage of ``cfg`` (``cfg.train``, ``cfg.rollout``) as the loop sees it."""
    t = cfg.train
    return Stage(setup.GRPO_DIR, t.steps, cfg.rollout.prompts_per_step, t.log_every, t.optim,
                 kind="train", postfix=("reward_mean", "accuracy"),
                 updates_per_step=t.updates_per_batch * t.mini_batches)


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
        (``train.updates.loss_config``).
    """

    def __init__(self, cfg, s: setup.Setup, loop: Loop, generate: rollout.Generator,
                 ref_params: Params | None):
        self.cfg, self.s, self.generate, self.ref_params = cfg, s, generate, ref_params
        self.schedule = updates.Schedule.from_config(cfg)
        self.skip = cfg.train.skip_unkept
        self.updater = updates.Updater(
            s.mdef, loop.tx, updates.loss_config(cfg), s.placement, self.schedule,
            temperature=cfg.rollout.temperature, skip=self.skip, frozen=loop.frozen,
            row_len=cfg.train.row_len,
            row_multiple=s.placement.row_multiple(cfg.train.row_multiple),
            bucket_multiple=cfg.train.bucket_multiple,
            routing_replay=cfg.loss.routing_replay)
        self.peak = peak_flops(cfg.metrics.peak_flops)
        self.guard = nonfinite.Guard(cfg.train.max_nonfinite_updates, "grpo",
                                     s.writer.enabled)

    def __call__(self, params, opt_state, problems, key, step):
        cfg, s = self.cfg, self.s
        t0 = time.perf_counter()
        # 1. rollout: G completions per prompt from the current policy (each prompt
        # prefilled once)
        ro = self.generate(params, [p.prompt for p in problems], key,
                           temperature=cfg.rollout.temperature,
                           group_size=cfg.rollout.group_size)
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
        if (cfg.eval.before_after and cfg.eval.curve_every and s.eval_problems
                and step % cfg.eval.curve_every == 0):
            evaluate.greedy_point(cfg, s, self.generate, params, step)
        many = len(report.updates) > 1  # the updates named <epoch>.<mini-batch>
        skipped = self.guard.observe(step, [(f"{e}.{m}" if many else "", metrics)
                                            for (e, m), metrics in report.updates])

        def metrics():
            epochs = self.schedule.epochs
            flops = epochs * train_step_flops(s.mdef.cfg, report.real, report.head_tokens,
                                              context=report.real / len(seqs.prompts) / 2)
            times = {"rollout": t1 - t0, "reference": t2 - t1 + report.seconds["reference"],
                     "train": report.seconds["train"]}
            return {**grpo_metrics(report, rewards, correct, ro, epochs=epochs, times=times,
                                   flops=flops, peak=self.peak),
                    "nonfinite_updates": skipped}

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


def train(cfg, config_file: str | None = None) -> None:
    """``python -m train.grpo``: warm start, evaluation, GRPO, evaluation, report."""
    t_start = time.perf_counter()
    s = setup.start(cfg, checks=(updates.loss_config, updates.Schedule.from_config,
                                 export.check_destination))
    if s.writer.enabled:
        print(setup.banner(cfg, s, "train.grpo", config_file), flush=True)
    if cfg.sft.steps > 0 and not cfg.init.sft_checkpoint:
        start = run_sft(cfg, s, final_params_only=True)
    else:
        start = setup.initial_params(cfg, s)
    n = len(s.eval_problems)
    experience.scored_on_sampler_support(cfg)  # a bad loss.logprob_support fails before any work
    rollouts = generator(cfg, s, truncation(cfg))
    # held-out evaluations sample untruncated (and decode greedily): same compiled decoder
    # as the rollouts unless those are truncated
    evals = rollouts if not truncation(cfg).active else generator(cfg, s, rollout.Truncation())
    before = None
    answer_logprobs = steps.reference_logprobs(s.mdef, s.placement,
                                               temperature=cfg.rollout.temperature)
    if cfg.eval.before_after:
        before = evaluate.held_out(cfg, s, evals, answer_logprobs, start, "before", 0)
        print(evaluate.summary(before, n, "before GRPO"), flush=True)
    params = train_grpo(cfg, s, start, rollouts)
    export.at_end(cfg, s, params)  # export.hf_dir
    if before is not None:
        after = evaluate.held_out(cfg, s, evals, answer_logprobs, params, "after", cfg.train.steps)
        print(evaluate.summary(after, n, "after GRPO"), flush=True)
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
