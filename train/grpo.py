"""GRPO on reasoning-gym tasks: ``python -m train.grpo --config=configs/grpo_tiny.py``.

One run, in ``cfg.workdir``: the warm start (the SFT stage ``train.sft`` when
``sft.steps > 0``, else ``init.sft_checkpoint``, an HF checkpoint or a random init); the
held-out evaluation of it (``train.run.evaluate.held_out``, saved so a resumed run does not
redo it); ``train.steps`` GRPO steps (``train.run.grpo_stage``: G sampled completions for
each of P prompts, their rewards, group advantages, the clipped-surrogate updates of
``train.rl.updates``; metrics every step, checkpoints by ``train.run.loop``); the held-out
evaluation of the final policy and the before/after table.

Rerunning the same command resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import os
import time

from train import export
from train.config import cli
from train.rl import rollout, steps, updates
from train.rl.rollout_settings import RolloutSettings
from train.run import evaluate, experience, plot, setup
from train.run.experience import generator
from train.run.grpo_stage import train_grpo
from train.run.metrics import machine
from train.sft import run_sft


def check_loss(cfg) -> None:
    """The loss settings and ``loss.logprob_support`` (``setup.start``'s check before any
    work).

    Raises:
      ValueError: see ``updates.loss_config``, ``experience.scored_on_sampler_support``.
    """
    settings = RolloutSettings.from_config(cfg)
    updates.loss_config(cfg.loss, settings.max_new_tokens)
    experience.scored_on_sampler_support(cfg, settings)


def train(cfg, config_file: str | None = None) -> None:
    """``python -m train.grpo``: warm start, evaluation, GRPO, evaluation, report."""
    t_start = time.perf_counter()
    s = setup.start(cfg, checks=(check_loss, updates.Schedule.from_config,
                                 export.check_destination))
    if s.writer.enabled:
        print(setup.banner(cfg, s, "train.grpo", config_file), flush=True)
    if cfg.sft.steps > 0 and not cfg.init.sft_checkpoint:
        start = run_sft(cfg, s, final_params_only=True)
    else:
        start = setup.initial_params(cfg, s)
    n = len(s.eval_problems)
    rollouts = generator(s)
    # held-out evaluations sample untruncated (and decode greedily): same compiled decoder
    # as the rollouts unless those are truncated
    evals = generator(s, rollout.Truncation()) if s.rollout.truncation.active else rollouts
    before = None
    answer_logprobs = steps.reference_logprobs(s.mdef, s.placement,
                                               temperature=s.rollout.temperature)
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
                 f"T={s.rollout.temperature:g}, {cfg.train.steps} GRPO steps")
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
